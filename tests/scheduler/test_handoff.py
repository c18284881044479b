"""Disaggregated prefill/decode scheduler API: PROMPT-side hand-off (take_handoffs /
release_handoff) and COMPLETION-side admission of prefilled sequences (add_prefilled,
handoff_capacity / can_accept back-pressure)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_scheduler import EngineType, SequenceStatus
from tests.scheduler.helpers import FakeRunner, make, tokens_of


def step(s, runner):
    out = s.schedule()
    fin = s.update(out, runner.execute(out))
    s.check_invariants()
    return out, fin


def test_prompt_engine_hands_off_instead_of_decoding():
    s = make(engine_type=EngineType.PROMPT)
    r = FakeRunner(s)
    s.add_request("a", list(range(1, 10)), 5)  # 9 tokens: 3 blocks of 4
    s.add_request("b", [1, 2, 3], 1)  # max_tokens=1: finishes on the prompt side
    out, fin = step(s, r)
    assert out.is_prompt and out.num_samples == 2
    assert [q.request_id for q in fin] == ["b"] and fin[0].finish_reason == "length"
    assert s.num_running == 0 and s.num_handoffs == 1 and s.has_unfinished()
    (h,) = s.take_handoffs()
    assert h.request_id == "a" and h.status is SequenceStatus.TRANSFERRING
    assert len(h.output_token_ids) == 1 and h.num_computed_tokens == 9
    assert len(h.blocks) == 3 and h.slot >= 0
    assert s.take_handoffs() == []  # returned once
    assert step(s, r)[0].num_samples == 0  # never decoded here
    free_before = s.block_pool.num_free
    s.release_handoff(h.seq_id)
    s.check_invariants()
    assert h.status is SequenceStatus.FINISHED and h.finish_reason == "handoff"
    assert s.block_pool.num_free == free_before + 3 and not s.has_unfinished()
    with pytest.raises(ValueError, match="not handed off"):
        s.release_handoff(h.seq_id)


def test_handoff_blocks_stay_in_prefix_cache():
    s = make(engine_type=EngineType.PROMPT)
    r = FakeRunner(s)
    prompt = list(range(1, 14))
    s.add_request("a", prompt, 4)
    step(s, r)
    s.release_handoff(s.take_handoffs()[0].seq_id)
    s.add_request("b", prompt, 4)
    step(s, r)
    (h,) = s.take_handoffs()
    assert h.num_cached_tokens == 12  # three full blocks reused
    s.release_handoff(h.seq_id)
    s.check_invariants()


def test_stop_or_abort_while_handed_off():
    s = make(engine_type=EngineType.PROMPT)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3, 4, 5], 4)
    s.add_request("b", [6, 7, 8], 4)
    step(s, r)
    # A stop string matched by the first token: the engine finishes it before taking.
    a = s.get_sequences("a")[0]
    assert s.finish_sequence(a.seq_id, "stop") is a
    assert s.abort("b")
    s.check_invariants()
    assert s.take_handoffs() == [] and not s.has_unfinished()


def test_prompt_engine_rejects_n_gt_1():
    s = make(engine_type=EngineType.PROMPT)
    with pytest.raises(ValueError, match="disaggregated"):
        s.add_request("a", [1, 2, 3], 4, n=2)


def test_add_prefilled_decodes_to_the_end():
    s = make(engine_type=EngineType.COMPLETION)
    r = FakeRunner(s)
    prompt = list(range(1, 10))
    seq = s.add_prefilled("a", prompt, [42], 6, stop_token_ids=[99])
    assert seq is not None and seq.status is SequenceStatus.RUNNING
    assert len(seq.blocks) == 3 and seq.num_computed_tokens == 9
    # Play the transfer: K/V of the 9 computed tokens and the state row.
    toks = tokens_of(seq)
    for p in range(9):
        r.kv[seq.blocks[p // 4] * 4 + p % 4] = toks[p]
    r.state[seq.slot] = list(toks)
    done = []
    for _ in range(10):
        out, fin = step(s, r)
        assert not out.is_prompt and out.zero_states.numel() == 0
        done += fin
        if not s.has_unfinished():
            break
    assert done == [seq] and len(seq.output_token_ids) == 6
    assert seq.finish_reason == "length" and s.cache_usage() == 0.0


def test_add_prefilled_back_pressure_and_reservation():
    # 8 blocks of 4: a prompt of 6 + max_tokens 7 may grow to 12 tokens = 3 blocks.
    s = make(num_blocks=8, max_num_seqs=3, engine_type=EngineType.COMPLETION)
    r = FakeRunner(s)
    assert s.prefilled_blocks(6, 7) == 3 and s.handoff_capacity() == (3, 8)
    a = s.add_prefilled("a", [1] * 6, [5], 7)
    assert a is not None and len(a.blocks) == 2
    assert s.handoff_capacity() == (2, 5)  # 6 free minus the 1 "a" may still claim
    b = s.add_prefilled("b", [2] * 6, [5], 7)
    assert b is not None and s.handoff_capacity() == (1, 2)
    assert not s.can_accept(6, 7)
    assert s.add_prefilled("c", [3] * 6, [5], 7) is None  # no credits: nothing changed
    s.check_invariants()
    assert s.can_accept(2, 7)  # 8 tokens = 2 blocks still fit
    for q in (a, b):
        toks = tokens_of(q)
        for p in range(q.num_tokens - 1):
            r.kv[q.blocks[p // 4] * 4 + p % 4] = toks[p]
        r.state[q.slot] = list(toks)
    while s.has_unfinished():
        step(s, r)
    assert s.stats.num_preemptions == 0
    assert s.add_prefilled("c", [3] * 6, [5], 7) is not None


def test_add_prefilled_validation():
    s = make(num_blocks=4, engine_type=EngineType.COMPLETION)
    with pytest.raises(ValueError, match="at least one output"):
        s.add_prefilled("a", [1, 2], [], 3)
    with pytest.raises(ValueError, match="must exceed"):
        s.add_prefilled("a", [1, 2], [3, 4], 2)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_prefilled("a", [1] * 60, [3], 10)
    with pytest.raises(ValueError, match="whole cache"):
        s.add_prefilled("a", [1] * 20, [3], 10)
    assert s.add_prefilled("a", [1, 2], [3], 3) is not None
    with pytest.raises(ValueError, match="duplicate"):
        s.add_prefilled("a", [1, 2], [3], 3)
    s.check_invariants()


def test_handoff_round_trip_matches_normal_tokens():
    """PROMPT -> (copy blocks + state) -> COMPLETION reproduces a NORMAL run's KV reads
    (the fake runner asserts every step reads exactly the sequence's tokens)."""
    p = make(engine_type=EngineType.PROMPT)
    d = make(engine_type=EngineType.COMPLETION)
    rp, rd = FakeRunner(p, seed=1), FakeRunner(d, seed=2)
    for i, n in enumerate((3, 4, 5, 9, 13)):
        p.add_request(f"r{i}", [(i * 7 + k) % 50 for k in range(n)], 6)
    finished = []
    for _ in range(50):
        if not (p.has_unfinished() or d.has_unfinished()):
            break
        if p.waiting:
            step(p, rp)
        for h in p.take_handoffs():
            q = d.add_prefilled(h.request_id, h.prompt_token_ids, h.output_token_ids,
                                h.max_tokens, stop_token_ids=h.stop_token_ids,
                                min_tokens=h.min_tokens)
            assert q is not None
            nb = len(q.blocks)
            assert len(h.blocks) == nb
            for src, dst in zip(h.blocks, q.blocks):
                rd.kv[dst * 4:(dst + 1) * 4] = rp.kv[src * 4:(src + 1) * 4]
            rd.state[q.slot] = list(rp.state[h.slot])
            p.release_handoff(h.seq_id)
        if d.has_unfinished():
            finished += step(d, rd)[1]
    assert sorted(len(q.output_token_ids) for q in finished) == [6] * 5
    assert np.all(p.block_pool.ref == 0) and d.cache_usage() == 0.0
