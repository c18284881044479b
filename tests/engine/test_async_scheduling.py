"""Overlapped scheduling through the whole engine: with ``async_scheduling`` on, step k+1
is scheduled and launched before step k's sampled ids reach the host (placeholders in its
inputs resolved from the runner's ``last_sampled``; stop checks one step late, the extra
token dropped). The outputs must equal the plain loop's, token for token."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was a small engine",
    "hello world, hello engine",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "the quick brown fox jumps over the lazy dog and then",  # a prefix-cache hit
    "numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[17, 42, 99],
                       min_tokens=3),
        SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=35, repetition_penalty=1.3,
                       presence_penalty=0.5, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=33, min_tokens=5),
    ]


def _llm(path: str, async_scheduling: bool, dtype: str = "float32", **kw) -> LLM:
    # 24 KV blocks of 8 tokens for up to 8 sequences of ~50 tokens: preemption;
    # 32 tokens a prompt step: the long prompts are chunked.
    block_bytes = 4096 if dtype == "float32" else 2048
    return LLM(path, dtype=dtype, device="cpu", max_num_batched_tokens=32,
               max_num_seqs=8, block_size=8, kv_cache_memory=24 * block_bytes,
               async_scheduling=async_scheduling, **kw)


def _key(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlap_equals_plain_loop_tiny_model(tiny_checkpoints, dtype):
    """Also in bf16: the CPU default where the CPU has native bf16 (the C decode kernel
    reads a bf16 cache)."""
    path = tiny_checkpoints["llama_tied"].path
    plain = _llm(path, False, dtype)
    over = _llm(path, True, dtype)
    assert over.engine.async_scheduling and not plain.engine.async_scheduling
    want = plain.generate(PROMPTS, _params(), use_tqdm=False)
    got = over.generate(PROMPTS, _params(), use_tqdm=False)
    assert _key(got) == _key(want)
    for g, w in zip(got[4].outputs[0].logprobs, want[4].outputs[0].logprobs):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in g)
    for llm in (plain, over):
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0, "the small cache should force a preemption"
        assert stats.prefix_cache_hits > 0
        assert not llm.engine.has_unfinished() and llm.engine.scheduler.cache_usage() == 0
    # The stop-token request ended on a stop id, after min_tokens.
    out = want[2].outputs[0]
    assert out.finish_reason == "stop" or len(out.token_ids) == 30
    # Every generated token was counted once: dropped tokens are not.
    assert over.engine.stats.generated_tokens == plain.engine.stats.generated_tokens


def test_overlap_equals_plain_loop_smollm2(smollm2_path):
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three prime numbers.", "What is the capital of France? Answer briefly."]
    params = [SamplingParams(temperature=0.0, max_tokens=14),
              SamplingParams(temperature=0.0, max_tokens=14, stop=["."]),
              SamplingParams(temperature=0.7, seed=11, max_tokens=14),
              SamplingParams(temperature=0.0, max_tokens=14, n=2)]
    outs = []
    for on in (False, True):
        llm = LLM(smollm2_path, dtype="float32", device="cpu", max_num_batched_tokens=48,
                  max_num_seqs=4, kv_cache_memory=64 << 20, async_scheduling=on)
        outs.append(_key(llm.chat([[{"role": "user", "content": p}] for p in prompts],
                                  params, use_tqdm=False)))
    assert outs[1] == outs[0]


def test_closing_drain_mid_run_keeps_results(tiny_checkpoints):
    """A caller that stops iterating with a step in flight loses nothing: the step is
    landed and its finished requests come out of the next drain."""
    llm = _llm(tiny_checkpoints["llama_tied"].path, True)
    eng = llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, None, SamplingParams(temperature=0.0, max_tokens=4 + i,
                                                         ignore_eos=True))
    it = eng.drain()
    first = next(it)
    it.close()
    rest = list(eng.drain())
    ids = sorted([first.request_id] + [r.request_id for r in rest])
    assert ids == ["r0", "r1", "r2"]
    assert all(len(r.outputs[0].token_ids) == 4 + int(r.request_id[1]) for r in [first, *rest])


@pytest.mark.parametrize("value", [None, False])
def test_async_defaults_off_on_cpu(tiny_checkpoints, value):
    llm = _llm(tiny_checkpoints["llama_tied"].path, value)
    assert llm.engine.async_scheduling is False
