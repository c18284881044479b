"""Two edges end to end: the ``min_tokens`` ban on stop ids holds for exactly
``min_tokens`` tokens and lifts at the next one; under overlapped scheduling, ``n > 1``
samples with logprobs, one of them ended early by a stop id, give exactly one logprob
entry per token and the plain loop's outputs and logprobs."""

from __future__ import annotations

from deepinfer import LLM, SamplingParams


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", kv_cache_memory=8 << 20, **kw)


def test_min_tokens_ban_lifts_at_exactly_min_tokens(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["llama3"].path)
    prompt = "the quick brown fox jumps over the lazy dog"
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                 ignore_eos=True), use_tqdm=False)
    toks = free[0].outputs[0].token_ids
    # A token whose first greedy appearance is at j >= 1: banning it for j tokens changes
    # nothing before j (it was never the argmax there), and at j it is the argmax.
    j = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    stop = toks[j]

    def run(min_tokens: int):
        p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                           stop_token_ids=[stop], min_tokens=min_tokens)
        return llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]

    lifted = run(j)  # the ban covers tokens 0..j-1 and lifts at token j
    assert lifted.token_ids == toks[:j + 1]
    assert (lifted.finish_reason, lifted.stop_reason) == ("stop", stop)
    held = run(j + 1)  # one more token under the ban: token j cannot be the stop id
    assert held.token_ids[:j] == toks[:j] and held.token_ids[j] != stop
    assert len(held.token_ids) > j + 1


def test_overlapped_n_samples_with_logprobs_and_an_early_stop(tiny_checkpoints):
    path = tiny_checkpoints["llama_tied"].path
    prompt = "once upon a time there was a small engine"
    probe = _llm(path).generate([prompt], SamplingParams(
        temperature=1.0, seed=4, n=3, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0]
    first = probe.outputs[0].token_ids
    # A stop id sample 0 draws at its third token (and not before): it ends early.
    stop = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i])
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=12, ignore_eos=True,
                            stop_token_ids=[stop], logprobs=2)
    outs = {}
    for on in (False, True):
        llm = _llm(path, async_scheduling=on)
        assert llm.engine.async_scheduling is on
        outs[on] = llm.generate([prompt, "hello world"], [params, params], use_tqdm=False)
    lengths = [len(c.token_ids) for c in outs[True][0].outputs]
    assert min(lengths) < 12 and outs[True][0].outputs[0].finish_reason == "stop"
    for plain, over in zip(outs[False], outs[True]):
        for a, b in zip(plain.outputs, over.outputs):
            assert len(b.logprobs) == len(b.token_ids)
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys()
                assert all(abs(da[t] - db[t]) < 1e-4 for t in da)
