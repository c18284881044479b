"""``SamplingParams.prompt_logprobs`` end to end against transformers' ``log_softmax`` over
the same prompt (float32, weights as transformers loads them): the default model
dequantized, tiny random Llama and Qwen3 checkpoints; prompts split over several prefill
chunks, a prefix-cache hit that must not hide scored positions, preempted requests, n > 1,
scoring without generating (``max_tokens=0``), and the bad values."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.models.test_models import hf_logits

TOL = 1e-4


def _expected(hf, ids: list[int]) -> torch.Tensor:
    """``[len - 1, V]`` transformers' logprobs of each position's next token."""
    return torch.log_softmax(hf_logits(hf, ids), dim=-1)[:-1]


def _check(out, hf, k: int) -> None:
    """``out.prompt_logprobs`` holds None, then per prompt token its logprob and the top
    ``k`` of its position, as transformers computes them."""
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None
    want = _expected(hf, ids)
    for p, entry in enumerate(entries[1:]):
        target = ids[p + 1]
        assert abs(entry[target] - want[p, target].item()) <= TOL, (p, target)
        top_lp, top_ids = want[p].topk(k)
        assert set(entry) == {target, *top_ids.tolist()}
        for t, lp in zip(top_ids.tolist(), top_lp.tolist()):
            assert abs(entry[t] - lp) <= TOL


@pytest.fixture(scope="module")
def smol_llm(smollm2_path):
    # Dequantized: the weights transformers computes with. 16 tokens a prompt step: the
    # prompts below take three to four chunks.
    return LLM(smollm2_path, dtype="float32", quantization="none", device="cpu",
               max_num_batched_tokens=16, kv_cache_memory=64 << 20)


PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away "
           "into the dark green forest, where the tall old trees whisper to each other "
           "about the long winter that is coming.",
           "List three prime numbers and explain why each is prime, briefly."]


def test_default_model_matches_transformers_over_chunks(smol_llm, hf_smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outs = smol_llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.prompt_token_ids) > 32 for o in outs[:1])  # several chunks
    for o in outs:
        _check(o, hf_smollm2, 3)
        assert len(o.outputs[0].token_ids) == 4


def test_a_prefix_cache_hit_hides_no_scored_position(smol_llm, hf_smollm2):
    prompt = PROMPTS[0] + " Once more."
    stats = smol_llm.engine.scheduler.stats
    smol_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2),
                      use_tqdm=False)  # its blocks are cached now
    hits = stats.prefix_cache_hits
    plain = smol_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2),
                              use_tqdm=False)
    assert stats.prefix_cache_hits > hits  # unscored: served from the cache
    hits = stats.prefix_cache_hits
    out = smol_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                      prompt_logprobs=1), use_tqdm=False)[0]
    assert stats.prefix_cache_hits == hits  # scored: every position computed
    _check(out, hf_smollm2, 1)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_n_samples_share_one_prompt_score(smol_llm, hf_smollm2):
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=3, prompt_logprobs=2)
    out = smol_llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _check(out, hf_smollm2, 2)


def test_scoring_without_generating(smol_llm, hf_smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0, logprobs=1)
    outs = smol_llm.generate(PROMPTS, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert (c.token_ids, c.text, c.logprobs, c.finish_reason) == ([], "", [], "length")
        _check(o, hf_smollm2, 0)
    assert not smol_llm.engine.has_unfinished()
    assert smol_llm.engine.scheduler.cache_usage() == 0
    record = outs[0].to_dict()
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) > 1


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_tiny_checkpoints_with_preemption(tiny_checkpoints, name):
    ck = tiny_checkpoints[name]
    # 24 KV blocks of 8 tokens for 6 sequences of ~40-60 tokens: preemption (recompute);
    # 32 tokens a prompt step: chunked prompts.
    llm = LLM(ck.path, dtype="float32", device="cpu", max_num_batched_tokens=32,
              max_num_seqs=6, block_size=8, kv_cache_memory=24 * 8 * 4096 // 8)
    g = torch.Generator().manual_seed(3)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (30 + 5 * i,), generator=g).tolist() for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             prompt_logprobs=i % 3) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for i, o in enumerate(outs):
        _check(o, ck.hf_model, i % 3)
        assert len(o.outputs[0].token_ids) == 20


def test_requests_without_prompt_logprobs_have_none(smol_llm):
    out = smol_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert out.to_dict()["prompt_logprobs"] is None


@pytest.mark.parametrize("kwargs,match", [
    ({"prompt_logprobs": 21}, r"prompt_logprobs=21: must be an integer in \[0, 20\]"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs=-1"),
    ({"prompt_logprobs": 1.5}, r"prompt_logprobs=1.5"),
    ({"max_tokens": 0}, r"max_tokens=0: must be at least 1 \(0 only with prompt_logprobs"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
