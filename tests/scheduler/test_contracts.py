"""Small public contracts that mutation testing (`make mutate`) showed no test pinned:
config type checks and boundaries, request limits at equality, default field values,
finish reasons, counters, the empty step's launch sizes, double frees."""

from __future__ import annotations

import pytest

from deepinfer_scheduler import BlockPool, EngineType, SchedulerConfig, StateManager
from tests.scheduler.helpers import FakeRunner, make, run_to_completion, tokens_of
from tests.scheduler.test_step_type import FakeVoter


@pytest.mark.parametrize("field, value", [
    ("num_blocks", True), ("num_blocks", 8.0), ("block_size", 2.5),
    ("prefill_watermark", True), ("prefill_watermark", "0.5"), ("prefill_watermark", -0.1),
    ("engine_type", 7), ("device", ""), ("device", 0),
])
def test_config_rejects_wrong_types(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{"num_blocks": 8, field: value})


def test_config_boundaries_and_engine_type_from_int():
    assert SchedulerConfig(num_blocks=1, prefill_watermark=0.0).prefill_watermark == 0.0
    assert SchedulerConfig(num_blocks=1, prefill_watermark=1).prefill_watermark == 1
    c = SchedulerConfig(num_blocks=8, engine_type=0)
    assert c.engine_type is EngineType.PROMPT
    c.engine_type = 1  # validate() also normalises a field set later
    c.validate()
    assert c.engine_type is EngineType.COMPLETION


def test_request_limits_at_equality():
    s = make(num_blocks=2, block_size=4, max_model_len=12)
    s.add_request("fits", [1] * 4, 5)  # 8 tokens of K/V: exactly the cache
    with pytest.raises(ValueError, match="could never finish"):
        s.add_request("big", [1] * 4, 6)  # 9 tokens of K/V: one more than the cache
    with pytest.raises(ValueError, match="min_tokens"):
        s.add_request("neg", [1], 2, min_tokens=-1)
    s = make(num_blocks=8, block_size=4, max_model_len=12)
    s.add_request("model-len", [1], 11)  # prompt + max_tokens == max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request("long", [1] * 2, 11)


def test_waiting_sequence_defaults_and_abort_reason():
    s = make()
    s.add_request("a", [1, 2, 3], 4)
    (seq,) = s.get_sequences("a")
    assert seq.finish_reason is None and seq.num_cached_tokens == 0
    assert seq.num_computed_tokens == 0 and seq.slot == -1
    assert s.abort("a")
    assert seq.finish_reason == "abort"


def test_stop_token_counts_from_the_first_output_by_default():
    s = make()
    s.add_request("a", [1, 2], 10, stop_token_ids=[7])  # min_tokens defaults to 0

    class First7(FakeRunner):
        def sample(self, n):
            return [7] * n

    fin, _ = run_to_completion(s, First7(s))
    assert fin[0].output_token_ids == [7] and fin[0].finish_reason == "stop"


def test_step_counters():
    s = make(max_num_batched_tokens=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(7)), 2)  # two prompt chunks (4 + 3 tokens)
    run_to_completion(s, r)
    assert s.stats.num_prompt_steps == 2 and s.stats.num_decode_steps == 1


def test_empty_step_launch_sizes():
    s = make(engine_type="completion")
    out = s.schedule()
    b = out.batch
    assert not out.is_prompt and out.num_batched_tokens == 0
    assert b.max_query_len == 0 and b.max_seq_len == 0
    assert b.query_start_loc.tolist() == [0]
    s.update(out, [])
    s = make()
    s.add_request("a", [1, 2, 3], 2)
    s.add_request("b", list(range(9)), 2)
    out = s.schedule()
    assert out.batch.max_seq_len == 9 and out.batch.max_query_len == 9


def test_double_free_raises_and_fresh_slots_are_unused():
    sm = StateManager(3)
    assert not any(sm.is_used(i) for i in range(3))
    slot = sm.allocate()
    assert sm.is_used(slot)
    sm.free(slot)
    assert not sm.is_used(slot)
    with pytest.raises(RuntimeError, match="freed twice"):
        sm.free(slot)
    with pytest.raises(RuntimeError, match="freed twice"):
        sm.free(2)  # never allocated
    pool = BlockPool(2, 4, enable_caching=True)
    b = pool.allocate()
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_rank_that_does_not_want_votes_no_at_an_all_point():
    """Nothing waits here: at an ALL point this rank sends 0, so the group decodes even
    though the other rank wants to prefill."""
    s = make(prefill_attempt_interval=2, prefill_any_attempt_interval=3)
    s.voter = FakeVoter([1])  # the other rank wants
    out = s.schedule()  # decode_step 0: an ALL point
    assert not out.is_prompt and s.voter.mine == [0]


def test_rank_over_the_watermark_admits_nothing_when_another_rank_prefills():
    """At an ANY point another rank's wish starts a prompt step everywhere, but a rank
    that did not want one (its cache is over the watermark) schedules no prompt of its
    own: it takes an empty prompt step and its request keeps waiting."""
    s = make(num_blocks=8, block_size=4, prefill_watermark=0.3,
             prefill_attempt_interval=4, prefill_any_attempt_interval=2)
    r = FakeRunner(s)
    s.add_request("a", list(range(12)), 8)  # 4 of 8 blocks after the prompt step
    out = s.schedule()
    s.update(out, r.execute(out))
    s.add_request("b", [1, 2], 2)
    for _ in range(2):  # decode_step 0 (ALL point: over the watermark) and 1
        out = s.schedule()
        assert not out.is_prompt
        s.update(out, r.execute(out))
    assert s.decode_step == 2 and s.cache_usage() > 0.3
    s.voter = FakeVoter([0, 0])  # decode_step 2: ANY point; the other rank prefills
    out = s.schedule()
    assert out.is_prompt and out.seqs == [] and s.voter.mine == [1, 1]
    assert s.num_waiting == 1


# ---------------------------------------------------------------- PD import (COMPLETION)
def _play_transfer(r, seq):
    """Write what the PROMPT engine would ship: the K/V of the computed tokens and the
    state row."""
    toks = tokens_of(seq)
    for p in range(seq.num_tokens - 1):
        r.kv[seq.blocks[p // r.bs] * r.bs + p % r.bs] = toks[p]
    r.state[seq.slot] = list(toks)


def test_import_credits_at_their_boundaries():
    s = make(num_blocks=8, max_num_seqs=2, engine_type="completion")
    # 6 + 4 - 1 = 9 tokens of K/V at most: 3 blocks (the last sampled token never is).
    assert s.prefilled_blocks(6, 4) == 3 and s.prefilled_blocks(6, 3) == 2
    a = s.add_prefilled("a", [1] * 6, [5], 4)  # 2 blocks now, may claim 1 more
    assert s.handoff_capacity() == (1, 8 - 2 - 1)
    b = s.add_prefilled("b", [2] * 7, [5], 2)  # 2 blocks: all it will ever hold
    assert s.handoff_capacity() == (0, 8 - 4 - 1)  # b owes nothing; no slot left
    assert not s.can_accept(1, 2)  # no slot, although blocks remain
    assert s.add_prefilled("c", [3], [5], 2) is None
    s.abort("b")
    c = s.add_prefilled("c", [3] * 8, [5], 10)  # 17 tokens: 5 blocks, 2 now: owes 3
    assert c is not None and s.handoff_capacity() == (0, 0)  # 4 free, 4 owed
    assert a is not None and b is not None


def test_imported_sequence_keeps_its_request_fields():
    s = make(engine_type="completion")

    class Always7(FakeRunner):
        def sample(self, n):
            return [7] * n

    r = Always7(s)
    seq = s.add_prefilled("a", [1, 2, 3], [5], 10, stop_token_ids=[7], min_tokens=2)
    assert seq.sample_index == 0 and seq.min_tokens == 2 and seq.stop_token_ids == {7}
    _play_transfer(r, seq)
    fin, _ = run_to_completion(s, r)
    # 7 only stops once more than min_tokens outputs exist (the imported one counts).
    assert fin == [seq] and seq.output_token_ids == [5, 7, 7]
    assert seq.finish_reason == "stop"


def test_import_validation_names_the_request():
    s = make(engine_type="completion")
    with pytest.raises(ValueError, match="request 'neg': min_tokens=-1"):
        s.add_prefilled("neg", [1, 2], [3], 4, min_tokens=-1)


# ---------------------------------------------------------------- DP: unfinished work
def test_has_unfinished_dp_asks_every_rank():
    s = make()
    s.voter = FakeVoter([1])  # no rank has work
    assert not s.has_unfinished_dp() and s.voter.mine == [1]
    s.voter = FakeVoter([0])  # another rank has work
    assert s.has_unfinished_dp() and s.voter.mine == [1]
    s.add_request("a", [1, 2], 2)
    s.voter = FakeVoter([1])  # only this rank has work
    assert s.has_unfinished_dp() and s.voter.mine == [0]


# ---------------------------------------------------------------- cut prompts and aborts
def test_abort_while_a_prompt_is_cut():
    """A prompt cut by the token budget holds its slot while waiting; aborting another
    waiting request leaves it the cut one, aborting the cut one frees everything."""
    s = make(max_num_batched_tokens=4)
    r = FakeRunner(s)
    s.add_request("long", list(range(10)), 2, n=2)  # 10 tokens: three chunks of <= 4
    s.add_request("other", [1, 2], 2)
    out = s.schedule()
    s.update(out, r.execute(out))
    long = s.get_sequences("long")[0]
    assert out.is_prompt and out.seqs == [long] and long.slot >= 0
    assert len(long.reserved_slots) == 1  # n = 2: the fork's slot is held from admission
    s.abort("other")
    s.check_invariants()  # the cut prompt is still the one waiting sequence with a slot
    free = s.state_manager.num_free
    s.abort("long")
    s.check_invariants()
    assert s.state_manager.num_free == free + 2 and s.block_pool.usage() == 0.0
    assert long.num_computed_tokens == 0


def test_last_token_of_the_budget_is_used():
    s = make(max_num_batched_tokens=4)
    s.add_request("a", [1, 2, 3], 2)
    s.add_request("b", [4], 2)  # exactly the one token of budget left
    out = s.schedule()
    assert out.is_prompt and out.num_batched_tokens == 4 and len(out.seqs) == 2


def test_without_chunked_prefill_a_prefix_hit_prompt_is_admitted_whole():
    s = make(max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False)
    r = FakeRunner(s)
    s.add_request("a", list(range(6)), 2)
    run_to_completion(s, r, max_steps=20)
    s.add_request("hit", list(range(6)), 2)  # 4 cached: 2 tokens to compute
    s.add_request("big", list(range(10, 17)), 1)  # 7 more do not fit the budget
    out = s.schedule()
    s.check_invariants()
    hit = s.get_sequences("hit")[0]
    assert out.is_prompt and out.seqs == [hit] and hit.num_cached_tokens == 4
    assert out.num_batched_tokens == 2 and s.get_sequences("big")[0].slot == -1
    s.update(out, r.execute(out))
    fin, _ = run_to_completion(s, r, max_steps=20)
    assert {q.request_id for q in fin} == {"hit", "big"}


def test_abort_between_schedule_and_update_of_a_prompt_step():
    """The first sample's sequence is aborted before its token lands: the token is
    dropped and the later samples of the step still get theirs."""
    s = make()
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 4)
    s.add_request("b", [4, 5, 6], 4)
    out = s.schedule()
    s.abort("a")
    s.update(out, r.execute(out))
    b = s.get_sequences("b")[0]
    assert len(b.output_token_ids) == 1 and [q.request_id for q in s.dropped] == ["a"]
    s.check_invariants()


def test_overlapped_step_with_every_sequence_ending_is_an_empty_decode():
    s = make()
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 2)
    out = s.schedule()
    s.update(out, r.execute(out))
    last = s.schedule()  # samples a's last token
    nxt = s.schedule()  # before it lands: nothing left to decode
    assert nxt.is_prompt is False and nxt.seqs == [] and nxt.num_batched_tokens == 0
    s.update(last, r.execute(last))
    s.update(nxt, r.execute(nxt))
    assert not s.has_unfinished()


def test_live_sequences_capped_by_the_token_budget():
    """Every live sequence must fit one decode step: at most max_num_batched_tokens of
    them hold a slot, however large max_num_seqs is; a request whose n exceeds that can
    never run."""
    s = make(max_num_seqs=8, max_num_batched_tokens=3)
    assert s.state_manager.max_live == 3
    with pytest.raises(ValueError, match="n=4"):
        s.add_request("wide", [1], 2, n=4)
    for i in range(4):
        s.add_request(f"r{i}", [i + 1], 3)
    out = s.schedule()
    assert out.is_prompt and len(out.seqs) == 3 and s.num_waiting == 1
