"""LoRA adapters through the engine against PEFT's own model on the same adapter files:
greedy tokens and prompt log-probabilities, several adapters and the base model in one
batch, on the CPU kernels (float32), with a chunked prefill and the prefix cache on."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, LoRARequest, SamplingParams
from tests.checkpoints import tiny_configs
from tests.lora.adapters import greedy, logits, save_peft_adapter
from tests.models.hf_checkpoints import save_random_model

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 30)]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=8,
               max_num_batched_tokens=16, enable_lora=True, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama 3 checkpoint, two adapters (all seven projections at rank 4; three of
    them at rank 8 with rsLoRA and per-module rank/alpha patterns) and their PEFT models."""
    root = tmp_path_factory.mktemp("lora_llama")
    hf = save_random_model(tiny_configs()["llama3"], str(root / "model"), 0)
    a = save_peft_adapter(hf, str(root / "a"), 1)
    b = save_peft_adapter(hf, str(root / "b"), 2, r=8, alpha=4,
                          targets=("q_proj", "v_proj", "down_proj"), use_rslora=True,
                          rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 16})
    return root, hf, {"a": a, "b": b}


def test_mixed_batch_matches_peft(llama):
    """Each prompt with adapter a, adapter b and none, all in one batch: every output is
    PEFT's (or transformers') greedy output for that adapter. The same prompts under
    different adapters must not share prefix-cache blocks (their K/V differ)."""
    root, hf, peft = llama
    llm = _llm(str(root / "model"))
    reqs = {"a": LoRARequest("a", 1, str(root / "a")), "b": LoRARequest("b", 2, str(root / "b"))}
    prompts = _prompts(hf.config.vocab_size)
    jobs = [(p, name) for name in ("a", "b", None) for p in prompts]
    outs = llm.generate([p for p, _ in jobs], GREEDY, use_tqdm=False,
                        lora_request=[reqs.get(n) for _, n in jobs])
    for (p, name), o in zip(jobs, outs):
        want = greedy(peft[name] if name else hf, p, NEW)
        assert o.outputs[0].token_ids == want, (name, len(p))
    # The adapters changed the outputs (else the test would not see a missing delta).
    assert outs[0].outputs[0].token_ids != outs[6].outputs[0].token_ids
    # Once finished, no request holds an adapter; both stay cached (max_loras 4).
    assert llm.engine.lora.loaded == ["a", "b"]
    assert llm.engine.lora.weight_bytes > 0


def test_prompt_logprobs_match_peft(llama):
    """Prefill through the adapter: each prompt token's log-probability is PEFT's."""
    root, hf, peft = llama
    llm = _llm(str(root / "model"))
    prompt = _prompts(hf.config.vocab_size)[2]
    req = LoRARequest("b", 2, str(root / "b"))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False, lora_request=req)[0]
    want = torch.log_softmax(logits(peft["b"], prompt), -1)
    got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    ref = [want[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-4, rtol=0)


def test_decode_batches_with_samples_and_chat(llama):
    """n=2 samples forked from an adapter's prompt, beside a chat request without one."""
    root, hf, peft = llama
    llm = _llm(str(root / "model"))
    prompt = _prompts(hf.config.vocab_size)[1]
    req = LoRARequest("a", 1, str(root / "a"))
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, n=2,
                                                          max_tokens=NEW, ignore_eos=True),
                                           GREEDY], use_tqdm=False,
                        lora_request=[req, None])
    want = greedy(peft["a"], prompt, NEW)
    assert [c.token_ids for c in outs[0].outputs] == [want, want]
    assert outs[1].outputs[0].token_ids == greedy(hf, prompt, NEW)


def test_adapters_beyond_max_loras(llama):
    """max_loras=1: an adapter no request uses is dropped for the next one and read
    again when asked for; two in use at once both stay (and both are right)."""
    root, hf, peft = llama
    llm = _llm(str(root / "model"), max_loras=1)
    prompt = _prompts(hf.config.vocab_size)[0]
    reqs = {"a": LoRARequest("a", 1, str(root / "a")), "b": LoRARequest("b", 2, str(root / "b"))}
    for name in ("a", "b", "a"):
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=reqs[name])[0]
        assert out.outputs[0].token_ids == greedy(peft[name], prompt, NEW)
        assert llm.engine.lora.loaded == [name]
    outs = llm.generate([prompt, prompt], GREEDY, use_tqdm=False,
                        lora_request=[reqs["a"], reqs["b"]])
    assert [o.outputs[0].token_ids for o in outs] == [greedy(peft["a"], prompt, NEW),
                                                      greedy(peft["b"], prompt, NEW)]
    assert llm.engine.lora.loaded == ["b"]


def test_phi3_fused_projections_and_partial_rotary(tmp_path):
    """Phi-4-mini's layout: PEFT adapts the fused qkv_proj and gate_up_proj, and 3/4 of
    each head rotates (q/k rows reordered at load: B's rows must follow)."""
    from transformers import Phi3Config

    cfg = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                     max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
                     partial_rotary_factor=0.75, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0, tie_word_embeddings=True)
    hf = save_random_model(cfg, str(tmp_path / "model"), 3)
    peft = save_peft_adapter(hf, str(tmp_path / "adapter"), 4,
                             targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    llm = _llm(str(tmp_path / "model"))
    req = LoRARequest("phi", 7, str(tmp_path / "adapter"))
    prompts = _prompts(cfg.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=req)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == greedy(peft, p, NEW), len(p)
