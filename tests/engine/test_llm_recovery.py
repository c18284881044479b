"""An ``LLM`` after a ``generate`` that failed or was interrupted mid-run takes new work as
if fresh (nothing of the failed call runs first, the scheduler's open steps are closed),
and a request whose prompt leaves less room than ``max_tokens`` is cut at
``max_model_len`` with ``"length"`` (as vLLM), not refused."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 8, 250, 12], [9, 8, 7], [11, 13, 150, 160, 170]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(tiny_checkpoints, **kw) -> LLM:
    return LLM(tiny_checkpoints["llama3"].path, device="cpu", dtype="float32",
               kv_cache_memory=8 << 20, max_model_len=64, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("error", [RuntimeError("device lost"), KeyboardInterrupt()])
def test_a_failed_generate_leaves_the_llm_usable(tiny_checkpoints, overlap, error):
    llm = _llm(tiny_checkpoints, async_scheduling=overlap)
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    runner = llm.engine.runner
    launch, calls = runner.launch, []

    def failing_launch(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # mid-run: a prefill done, decodes under way
            raise error
        return launch(*a, **k)

    runner.launch = failing_launch
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del runner.launch  # back to the class's method
    assert len(calls) == 3
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


def test_max_tokens_is_cut_at_the_model_length(tiny_checkpoints):
    llm = _llm(tiny_checkpoints)
    prompt = [(7 * i) % 250 + 3 for i in range(60)]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompt \(64 tokens\) \+ one generated token "
                                         r"exceeds max_model_len=64"):
        llm.generate([prompt + [1, 2, 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"min_tokens \(10\) exceeds max_model_len=64"):
        llm.generate([prompt], SamplingParams(max_tokens=20, min_tokens=10), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_failed_generate_under_tensor_parallelism_leaves_the_llm_usable(tiny_checkpoints):
    """The same with two TP ranks (gloo): the leader aborts the failed call's requests
    (its followers keep no scheduler state) and the next call matches a fresh run."""
    with _llm(tiny_checkpoints, tensor_parallel_size=2) as llm:
        want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        runner = llm.engine.runner
        launch, calls = runner.launch, []

        def failing_launch(*a, **k):
            calls.append(1)
            if len(calls) == 3:  # before the step reaches the followers
                raise KeyboardInterrupt
            return launch(*a, **k)

        runner.launch = failing_launch
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        del runner.launch
        assert not llm.engine.requests and not llm.engine.has_unfinished()
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
