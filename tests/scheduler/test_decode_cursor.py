"""Steady decode steps (``decode_cursor``): derived from the step before, they must equal
the general path's, tensor for tensor, and refuse whenever their assumptions fail."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_scheduler.block_manager import BlockPool
from deepinfer_scheduler.decode_cursor import DecodeCursor
from deepinfer_scheduler.kv_cache import KVCache
from tests.scheduler.helpers import FakeRunner, make, run_overlapped, run_to_completion

_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
           "query_start_loc", "logits_indices", "state_slots", "sample_state_slots")


def _rows_kv(bs: int, lengths: list[int], num_blocks: int = 64):
    """A KV cache whose slot i holds exactly the blocks for ``lengths[i]`` tokens (the
    fed one included, as a decode step leaves them)."""
    kv = KVCache(BlockPool(num_blocks, bs, enable_caching=False), len(lengths), 128)
    for slot, n in enumerate(lengths):
        kv.allocate(slot, -(-n // bs))
    slots = np.arange(len(lengths), dtype=np.int64)
    return kv, slots


def _expected_mapping(kv: KVCache, slots: np.ndarray, ntok: np.ndarray) -> np.ndarray:
    pos = ntok - 1
    return kv.tables[slots, pos // kv.block_size].astype(np.int64) * kv.block_size \
        + pos % kv.block_size


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_steps_follow_the_rows_block_by_block(bs):
    rng = np.random.default_rng(bs)
    lengths = rng.integers(1, 40, 9)
    max_len = lengths + rng.integers(3 * bs + 2, 5 * bs + 4, 9)
    kv, slots = _rows_kv(bs, lengths.tolist(), num_blocks=2000)
    ntok = lengths.astype(np.int64)
    pos = ntok - 1
    cursor = DecodeCursor(bs, ntok, max_len, pos % bs, _expected_mapping(kv, slots, ntok))
    room = int((max_len - ntok).min())
    for t in range(1, room):
        ntok = ntok + 1
        step = cursor.step(int(ntok[0]), slots, kv)
        assert step is not None, f"t={t}"
        # Rows entering a block got exactly one new one, and nothing was allocated ahead.
        assert kv.nblocks[slots].tolist() == (-(-ntok // bs)).tolist()
        assert step.slot_mapping.tolist() == _expected_mapping(kv, slots, ntok).tolist()
        assert step.max_len == int(ntok.max())
        assert step.filled == np.flatnonzero((ntok - 1) % bs == bs - 1).tolist()
        assert step.may_end == bool((ntok + 1 >= max_len).any())
    # The step where a row would reach its limit is the general path's.
    assert cursor.step(int(ntok[0]) + 1, slots, kv) is None


def test_refuses_without_changing_anything():
    bs = 4
    ntok = np.array([4, 7, 12], dtype=np.int64)

    def cursor_on(num_blocks):
        kv, slots = _rows_kv(bs, ntok.tolist(), num_blocks=num_blocks)
        return kv, slots, DecodeCursor(bs, ntok, ntok + 50, (ntok - 1) % bs,
                                       _expected_mapping(kv, slots, ntok))

    kv, slots, cursor = cursor_on(6)  # 1 + 2 + 3 blocks: the pool is empty
    before = (kv.tables.copy(), kv.nblocks.copy(), kv.num_free)
    # Rows 0 and 2 enter a new block; the pool has none left.
    assert cursor.step(int(ntok[0]) + 1, slots, kv) is None
    assert (kv.tables == before[0]).all() and (kv.nblocks == before[1]).all()
    assert kv.num_free == before[2] == 0
    # A fork's shared block would need a copy first: not a steady step either.
    kv, slots, cursor = cursor_on(20)
    # Row 0 did not advance as a decode step would have: the rows moved otherwise.
    assert cursor.step(int(ntok[0]) + 2, slots, kv) is None
    assert kv.num_free == 14
    kv.shared_tail.add(1)
    assert cursor.step(int(ntok[0]) + 1, slots, kv) is None
    assert kv.num_free == 14
    kv.shared_tail.clear()
    step = cursor.step(int(ntok[0]) + 1, slots, kv)
    assert step is not None and kv.num_free == 12
    assert step.slot_mapping.tolist() == _expected_mapping(kv, slots, ntok + 1).tolist()


def _launches(sched, overlapped: bool, monkeypatch=None, seed: int = 0):
    """Every step's launch tensors (copied) and the finished outputs of a workload with
    long decodes, forks, stop tokens and prefix-cache hits."""
    steps = []
    orig = sched.schedule

    def schedule():
        out = orig()
        steps.append((out.is_prompt, {f: getattr(out.batch, f).clone() for f in _FIELDS},
                      out.batch.max_seq_len))
        return out

    sched.schedule = schedule
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50, 9).tolist()
    for i in range(10):
        prompt = (shared if i % 3 else []) + rng.integers(0, 50, int(rng.integers(1, 12))).tolist()
        sched.add_request(f"r{i}", prompt, int(rng.integers(5, 40)),
                          n=int(rng.choice([1, 1, 2])), stop_token_ids=[int(rng.integers(0, 50))])
    runner = FakeRunner(sched, by_history=True)
    drive = run_overlapped if overlapped else run_to_completion
    finished, _ = drive(sched, runner)
    outs = {(s.request_id, s.sample_index): (list(s.output_token_ids), s.finish_reason)
            for s in finished}
    return steps, outs


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("num_blocks", [400, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_steady_steps_equal_the_general_path(monkeypatch, overlapped, num_blocks, seed):
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, max_model_len=64,
              enable_prefix_caching=True)
    fast = make(num_blocks, **kw)
    fast_steps, fast_out = _launches(fast, overlapped, seed=seed)
    steady = fast.stats.num_decode_steps
    with monkeypatch.context() as m:
        m.setattr(DecodeCursor, "step", lambda self, *a: None)
        ref = make(num_blocks, **kw)
        ref_steps, ref_out = _launches(ref, overlapped, seed=seed)
    assert fast_out == ref_out
    assert len(fast_steps) == len(ref_steps) and steady > 20
    for k, ((p1, t1, m1), (p2, t2, m2)) in enumerate(zip(fast_steps, ref_steps)):
        assert p1 == p2 and m1 == m2, f"step {k}"
        for f in _FIELDS:
            assert t1[f].tolist() == t2[f].tolist(), f"step {k}: {f}"
    assert fast.stats.num_preemptions == ref.stats.num_preemptions
    assert fast.stats.prefix_cache_hits == ref.stats.prefix_cache_hits


def test_most_steady_decode_steps_take_the_cursor(monkeypatch):
    """Without churn the cursor serves every decode step but the first two of a
    running list (it is built on the second)."""
    calls = {"derived": 0}
    orig = DecodeCursor.step

    def counted(self, *a):
        out = orig(self, *a)
        calls["derived"] += out is not None
        return out

    monkeypatch.setattr(DecodeCursor, "step", counted)
    s = make(400, max_num_seqs=4, block_size=4, max_model_len=128)
    for i in range(4):
        s.add_request(f"r{i}", list(range(1, 6 + i)), 60)
    runner = FakeRunner(s)
    run_to_completion(s, runner)
    assert s.stats.num_decode_steps >= 59
    assert calls["derived"] == s.stats.num_decode_steps - 2
