"""The overlapped CUDA loop enqueues each step without waiting for the device: no host
sync (CUDA sync-debug mode set to "error" around every launch) and no stall behind the
work already queued (a launch made while the device sleeps returns before it wakes; a
pageable non_blocking copy, which the driver may stage synchronously, would not).

Covered: logprobs, penalties (prompt and output tokens recorded on the device), admission
(new sequences' state zeroed), forks (state rows cloned) and the KV hand-off of
disaggregated prefill/decode. GPU only."""

from __future__ import annotations

import gc

import pytest
import torch

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64], [9, 8, 7], [200, 100, 4, 4]]
# About 20 ms of device time at 1.5-2 GHz: far longer than a launch's host work.
SLEEP_CYCLES = 40_000_000


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _llm(tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints["llama3"].path, dtype="float32", device="cuda",
               max_num_seqs=8, max_num_batched_tokens=64, gpu_memory_utilization=0.3,
               async_scheduling=True)


def _while_busy(fn, *args, **kwargs):
    """Call ``fn`` with the device asleep and sync-debug mode "error"; returns its result
    and whether the device was still asleep when it returned."""
    torch.cuda._sleep(SLEEP_CYCLES)
    asleep = torch.cuda.Event()
    asleep.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out, not asleep.query()


def _watch_launches(llm: LLM) -> list[bool]:
    """Every launch of ``llm``'s runner from now on goes through ``_while_busy``; the
    list gets, per launch, whether it returned before the device woke."""
    runner = llm.engine.runner
    launch = runner.launch
    returned_early: list[bool] = []

    def watched(*args, **kwargs):
        out, early = _while_busy(launch, *args, **kwargs)
        returned_early.append(early)
        return out

    runner.launch = watched
    return returned_early


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True,
                   repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2),
    SamplingParams(temperature=0.8, n=2, max_tokens=12, ignore_eos=True, logprobs=1),
], ids=["logprobs", "penalties", "forks"])
def test_launches_neither_sync_nor_wait(tiny_checkpoints, params):
    llm = _llm(tiny_checkpoints)
    assert llm.engine.async_scheduling
    llm.generate(PROMPTS, params, use_tqdm=False)  # warm: graphs, pinned host blocks
    early = _watch_launches(llm)
    # Staggered: admissions land while other sequences decode.
    outs = llm.generate(PROMPTS + [[1, 2, 3]] * 5, params, use_tqdm=False)
    assert all(len(c.token_ids) == 12 for o in outs for c in o.outputs)
    if params.logprobs is not None:
        assert all(len(c.logprobs) == 12 for o in outs for c in o.outputs)
    assert len(early) > 12 and all(early), early


def test_logprobs_do_not_change_the_overlapped_tokens(tiny_checkpoints):
    """Overlap with logprobs off (the path that never reads them) gives the tokens of the
    same run with them on: same engine, same batches."""
    llm = _llm(tiny_checkpoints)
    runs = []
    for logprobs in (None, 2):
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            logprobs=logprobs)
        runs.append(llm.generate(PROMPTS, sp, use_tqdm=False))
    for off, on in zip(*runs):
        assert off.outputs[0].token_ids == on.outputs[0].token_ids
        assert off.outputs[0].logprobs is None
        lps = on.outputs[0].logprobs
        assert len(lps) == 16 and all(tok in d for tok, d in zip(on.outputs[0].token_ids,
                                                                  lps))


def test_kv_handoff_copies_neither_sync_nor_wait(tiny_checkpoints):
    """The prefill side's export and the decode side's import (block and slot lists to
    device indices): enqueued while the device is busy; the bytes round-trip."""
    runner = _llm(tiny_checkpoints).engine.runner
    runner.kv_cache.normal_()
    for t in runner.states:
        t.copy_(torch.rand(t.shape, device=t.device) > 0.5)  # 0/1 in its own dtype
    blocks, slots = [3, 1, 4], [2, 5]
    runner.export_kv(blocks, slots)  # warm the pinned host blocks
    payload, early = _while_busy(runner.export_kv, blocks, slots)
    assert early
    want = runner.kv_cache[:, :, blocks].clone()
    rows = [t[slots].clone() for t in runner.states]
    runner.kv_cache[:, :, blocks] = float("nan")
    for t in runner.states:
        t[slots] = 0
    _, early = _while_busy(runner.import_kv, payload, blocks, slots)
    assert early
    torch.testing.assert_close(runner.kv_cache[:, :, blocks], want, rtol=0, atol=0)
    for t, r in zip(runner.states, rows):
        assert torch.equal(t[slots], r)
