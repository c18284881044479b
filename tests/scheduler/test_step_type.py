"""Step type: PROMPT / COMPLETION / NORMAL logic, votes and decode_step
(docs/scheduling.md, "Step type")."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from deepinfer_scheduler import EngineType
from tests.scheduler.helpers import FakeRunner, make


class FakeVoter:
    """Stands in for the other ranks: each all-reduce returns min(mine, theirs.pop(0))."""

    def __init__(self, theirs: list[int]) -> None:
        self.theirs = list(theirs)
        self.mine: list[int] = []

    def allreduce_min(self, v: int) -> int:
        self.mine.append(v)
        return min(v, self.theirs.pop(0))


def step(s, runner):
    out = s.schedule()
    s.update(out, runner.execute(out))
    return out


def test_prompt_engine_always_prefills():
    s = make(engine_type=EngineType.PROMPT)
    r = FakeRunner(s)
    out = step(s, r)
    assert out.is_prompt and out.seqs == [] and out.num_batched_tokens == 0
    s.add_request("a", [1, 2, 3], 1)
    out = step(s, r)
    assert out.is_prompt and out.seq_ids == [0] and out.num_samples == 1
    assert step(s, r).is_prompt
    assert s.decode_step == 0 and s.stats.num_decode_steps == 0
    # A prefilled sequence would never be decoded (a PROMPT engine never decodes): refused.
    with pytest.raises(ValueError, match="request 'x': a PROMPT engine only prefills"):
        s.add_prefilled("x", [1, 2, 3], [4], 5)
    assert not s.get_sequences("x")


def test_completion_engine_always_decodes():
    s = make(engine_type=EngineType.COMPLETION)
    # A new request would wait forever (a COMPLETION engine never prefills): refused.
    with pytest.raises(ValueError, match="request 'a': a COMPLETION engine only decodes"):
        s.add_request("a", [1, 2, 3], 4)
    r = FakeRunner(s)
    for i in range(3):
        out = step(s, r)
        assert not out.is_prompt and out.seqs == []
        assert s.decode_step == i + 1
    assert s.num_waiting == 0 and not s.has_unfinished()


def test_normal_points_single_rank():
    """ALL points every 4 decode steps, ANY every 6 (not at 0); prefill waits for one."""
    s = make(prefill_attempt_interval=4, prefill_any_attempt_interval=6)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 40)
    out = step(s, r)
    assert out.is_prompt and s.decode_step == 0
    kinds = []
    for i in range(1, 14):
        if s.decode_step == 1 or s.decode_step == 5:
            s.add_request(f"r{i}", [4, 5], 30)
        d = s.decode_step
        kinds.append((d, step(s, r).is_prompt))
    # Requests arrive at decode_step 1: prefill at the next ALL point (4). Then decode
    # again from 0; the request added at decode_step 1 again waits for 4.
    assert kinds[:5] == [(0, False), (1, False), (2, False), (3, False), (4, True)]
    assert kinds[5:10] == [(0, False), (1, False), (2, False), (3, False), (4, True)]


def test_prompt_step_resets_and_decode_increments_decode_step():
    s = make()
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 5)
    step(s, r)
    assert s.decode_step == 0
    for i in range(1, 4):
        step(s, r)
        assert s.decode_step == i
    assert s.stats.num_prompt_steps == 1 and s.stats.num_decode_steps == 3


def test_all_point_needs_every_rank():
    s = make(prefill_attempt_interval=2, prefill_any_attempt_interval=3)
    s.add_request("a", [1, 2, 3], 5)
    s.voter = FakeVoter([0])  # another rank does not want: ALL vote fails
    out = s.schedule()
    assert not out.is_prompt and s.voter.mine == [1]
    s.update(out, [])
    assert s.decode_step == 1


def test_any_point_one_rank_is_enough_and_idle_rank_steps_empty():
    s = make(prefill_attempt_interval=4, prefill_any_attempt_interval=2)
    s.add_request("a", [1, 2, 3], 5)
    r = FakeRunner(s)
    step(s, r)  # decode_step 0 ALL point: single-rank voter, prefill
    step(s, r)  # decode_step 0 -> decode (no waiting)
    assert s.decode_step == 1
    step(s, r)
    assert s.decode_step == 2
    # decode_step 2: ANY point. This rank has nothing waiting, another rank wants and
    # schedules: both votes return 0, this rank takes an empty prompt step.
    s.voter = FakeVoter([0, 0])
    out = s.schedule()
    assert out.is_prompt and out.seqs == [] and s.voter.mine == [1, 1]
    assert out.batch.input_ids.shape == (0,) and out.batch.block_tables.shape == (0, 0)
    assert out.batch.query_start_loc.tolist() == [0]
    s.update(out, [])
    assert s.decode_step == 0


def test_any_wins_over_all_where_both_hold():
    s = make(prefill_attempt_interval=2, prefill_any_attempt_interval=2)
    s.add_request("a", [1, 2, 3], 9)
    r = FakeRunner(s)
    step(s, r)
    step(s, r)
    step(s, r)
    assert s.decode_step == 2
    s.add_request("b", [1, 2], 3)
    # ANY vote: this rank wants (sends 0); an ALL vote would have sent 1.
    s.voter = FakeVoter([1, 1])
    out = s.schedule()
    assert out.is_prompt and s.voter.mine == [0, 0]


def test_second_vote_falls_back_to_decode_no_livelock():
    """Running full and waiting non-empty: prefill is voted but schedules nothing."""
    s = make(max_num_seqs=2, prefill_attempt_interval=1)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 6)
    s.add_request("b", [1, 2, 3], 6)
    s.add_request("c", [7, 8], 2)
    out = step(s, r)
    assert out.is_prompt and len(out.seqs) == 2
    for i in range(1, 5):
        out = step(s, r)
        assert not out.is_prompt and len(out.seqs) == 2
        assert s.decode_step == i  # not reset by an empty prompt step
    while s.num_running == 2:
        step(s, r)
    assert step(s, r).is_prompt  # "c" gets a slot once "a"/"b" finish


def test_second_vote_other_rank_scheduled():
    s = make(max_num_seqs=1)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 6)
    s.add_request("b", [1, 2], 6)
    step(s, r)
    s.voter = FakeVoter([1, 0])  # all want; this rank gets nothing, another does
    out = s.schedule()
    assert out.is_prompt and out.seqs == [] and s.voter.mine == [1, 1]


def test_watermark_blocks_prefill():
    s = make(num_blocks=8, block_size=4, prefill_watermark=0.3)
    r = FakeRunner(s)
    s.add_request("a", list(range(12)), 4)  # 3 of 8 blocks + 1
    step(s, r)
    assert s.cache_usage() > 0.3
    s.add_request("b", [1, 2], 2)
    for _ in range(2):
        assert not step(s, r).is_prompt
    while s.num_running:
        step(s, r)
    assert step(s, r).is_prompt


def test_no_collective_without_group(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("collective called with dp_group=None")

    monkeypatch.setattr(dist, "all_reduce", boom)
    s = make()
    s.add_request("a", [1, 2, 3], 3)
    r = FakeRunner(s)
    for _ in range(4):
        step(s, r)


@pytest.mark.parametrize("et", ["prompt", "COMPLETION", EngineType.NORMAL])
def test_engine_type_accepts_names(et):
    assert make(engine_type=et).config.engine_type in EngineType
