"""End-to-end ``LLM`` tests: greedy output token-for-token equal to transformers.

Prompts of different lengths run as one batch with a small token budget and a shared
prefix, so continuous batching, chunked prefill and prefix caching are all exercised.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.checkpoints import assert_greedy_matches_hf


def _hf_greedy(hf_model, prompt_ids: list[int], max_new: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt_ids):].tolist()


SMOL_PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a short poem about the sea. " * 6,
    "Write a short poem about the sea. " * 6 + "Make it rhyme.",  # prefix-cache hit
    "List three prime numbers greater than ten and explain why each one is prime.",
]


@pytest.fixture(scope="module")
def smol_llm(smollm2_path):
    # max_num_batched_tokens 48 < the longest prompt: chunked prefill on every long prompt.
    return LLM(smollm2_path, dtype="float32", device="cpu", max_num_batched_tokens=48,
               max_num_seqs=4, kv_cache_memory=64 << 20)


def test_smollm2_greedy_matches_transformers(smol_llm, hf_smollm2):
    tok = smol_llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = smol_llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
    stats = smol_llm.engine.scheduler.stats
    assert stats.prefix_cache_hits > 0  # the shared prefix was served from the cache
    eos = smol_llm.engine.model_config.eos_token_ids[0]
    for prompt, out in zip(SMOL_PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        want = _hf_greedy(hf_smollm2, ids, 12, eos)
        assert out.outputs[0].token_ids == want, prompt
        assert out.outputs[0].text == tok.decode(
            [t for t in want if t != eos], skip_special_tokens=True)


def test_chat_applies_template(smol_llm):
    msgs = [{"role": "user", "content": "Say hello."}]
    out = smol_llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out) == 1
    expected = smol_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                      tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert out[0].prompt_token_ids == list(expected)


LONG = [5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 41, 55, 61, 90, 101, 11,
        13, 150, 160, 170, 180, 190, 30]


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "mistral", "granite"])
def test_tiny_models_greedy_match_transformers(tiny_checkpoints, name):
    ckpt = tiny_checkpoints[name]
    llm = LLM(ckpt.path, dtype="float32", device="cpu", max_num_batched_tokens=24,
              max_num_seqs=3, kv_cache_memory=8 << 20, block_size=8)
    # The third prompt shares LONG's first two blocks: a prefix-cache hit.
    assert_greedy_matches_hf(llm, ckpt.hf_model, [LONG, [9, 8, 7], LONG[:16] + [44]], 10)


def test_triton_backend_interpreter_matches_transformers(tiny_checkpoints):
    import deepinfer_kernels

    ckpt = tiny_checkpoints["qwen3"]
    llm = LLM(ckpt.path, dtype="float32", device="cpu", attention_backend="triton",
              max_num_batched_tokens=16, max_num_seqs=2, kv_cache_memory=4 << 20,
              block_size=8)
    assert llm.engine.backend is deepinfer_kernels
    assert_greedy_matches_hf(llm, ckpt.hf_model, [LONG[:18], [9, 8]], 6)


# ------------------------------------------------------------------ bad input
def test_invalid_request_raises_before_any_work(smol_llm):
    engine = smol_llm.engine
    steps = engine.stats.steps
    too_long = "word " * (engine.max_model_len + 10)
    with pytest.raises(ValueError, match="prompt 1"):
        smol_llm.generate(["fine", too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    assert engine.stats.steps == steps
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"\bn\b"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="sampling_params"):
        smol_llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_unknown_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        LLM(missing, device="cpu")


def test_cpu_backend_builds_its_c_kernel_at_start_up():
    """Choosing the CPU backend builds (or loads from the cache) the C decode kernel then,
    not inside the first decode step."""
    from deepinfer.worker import resolve_backend
    from deepinfer_kernels import cpu_native

    cpu_native.native_library.cache_clear()
    backend = resolve_backend("auto", torch.device("cpu"))
    assert backend.__name__ == "deepinfer_kernels.cpu_backend"
    assert cpu_native.native_library.cache_info().currsize == 1
