"""Scheduler rules: validation, slots, forks, chunked prefill, preemption, tensors."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer_scheduler import EngineType, Scheduler, SchedulerConfig, SequenceStatus
from tests.scheduler.helpers import FakeRunner, make, run_to_completion


def step(s, runner):
    out = s.schedule()
    fin = s.update(out, runner.execute(out))
    s.check_invariants()
    return out, fin


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, rule", [
    (dict(prompt_token_ids=[], max_tokens=4), "empty prompt"),
    (dict(prompt_token_ids=[1, 2], max_tokens=0), "max_tokens"),
    (dict(prompt_token_ids=[1] * 60, max_tokens=5), "max_model_len"),
    (dict(prompt_token_ids=[1, 2], max_tokens=4, n=0), "n=0"),
])
def test_bad_requests_raise_and_leave_state_unchanged(kwargs, rule):
    s = make()
    s.add_request("ok", [1, 2, 3], 2)
    with pytest.raises(ValueError, match=rule) as ei:
        s.add_request("bad", **kwargs)
    assert "'bad'" in str(ei.value)
    assert s.get_sequences("bad") == [] and s.num_waiting == 1
    s.check_invariants()


def test_prompt_larger_than_cache_rejected():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"'big'.*prompt needs 5 KV blocks"):
        s.add_request("big", list(range(17)), 1)
    with pytest.raises(ValueError, match=r"'long'.*could never finish"):
        s.add_request("long", list(range(16)), 3)  # 18 tokens of K/V > 16
    s.add_request("fits", list(range(16)), 1)
    assert not s.get_sequences("big") and s.num_waiting == 1


def test_duplicate_request_id():
    s = make()
    s.add_request("a", [1, 2], 2)
    with pytest.raises(ValueError, match=r"'a'.*duplicate"):
        s.add_request("a", [3, 4], 2)
    assert [q.prompt_token_ids for q in s.get_sequences("a")] == [[1, 2]]


@pytest.mark.parametrize("field, value", [
    ("num_blocks", 0), ("block_size", 0), ("max_num_seqs", -1),
    ("max_num_batched_tokens", 0), ("max_model_len", 0), ("prefill_attempt_interval", 0),
    ("prefill_any_attempt_interval", 0), ("prefill_watermark", 1.5),
    ("engine_type", "sideways"),
])
def test_config_validation_names_field(field, value):
    kw = dict(num_blocks=8)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)


def test_config_defaults_and_no_chunking_needs_budget():
    c = SchedulerConfig(num_blocks=10)
    assert c.block_size == 16 and c.engine_type is EngineType.NORMAL and c.device == "cpu"
    assert c.enable_chunked_prefill and c.enable_prefix_caching
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_blocks=10, max_num_batched_tokens=100, enable_chunked_prefill=False)


def test_abort():
    s = make()
    r = FakeRunner(s)
    assert s.abort("nope") is False
    s.add_request("a", [1, 2, 3], 8, n=2)
    s.add_request("b", list(range(40)), 8)  # cut by the 32-token budget
    step(s, r)
    assert s._partial is not None
    assert s.abort("a") is True and s.abort("b") is True
    assert s.abort("a") is False
    assert not s.has_unfinished() and s.cache_usage() == 0
    s.check_invariants()


def test_abort_between_schedule_and_update():
    s = make()
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(f"r{i}", [1, 2, 3, i], 5)
    step(s, r)
    out = s.schedule()
    toks = r.execute(out)
    s.abort("r1")
    fin = s.update(out, toks)
    assert fin == [] and s.num_running == 2
    assert [len(q.output_token_ids) for q in s.running] == [2, 2]
    s.check_invariants()


def test_finish_sequence_and_stats():
    s = make()
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 8, n=2)
    step(s, r)
    a0, a1 = s.get_sequences("a")
    assert (a0.sample_index, a1.sample_index) == (0, 1)
    got = s.finish_sequence(a1.seq_id)
    assert got is a1 and a1.finish_reason == "stop" and a1.status is SequenceStatus.FINISHED
    assert s.finish_sequence(a1.seq_id) is None
    assert s.get_sequences("a") == [a0]
    s.check_invariants()
    assert s.stats.num_prompt_steps == 1 and s.stats.prefix_cache_queries == 3


# ---------------------------------------------------------------- tensors
def test_launch_tensor_dtypes_and_shapes():
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(10)), 3)
    s.add_request("b", list(range(5)), 3)
    for is_prompt in (True, False):
        out = s.schedule()
        assert out.is_prompt is is_prompt
        b = out.batch
        for name, dt in [("input_ids", torch.int64), ("positions", torch.int64),
                         ("slot_mapping", torch.int64), ("block_tables", torch.int32),
                         ("seq_lens", torch.int32), ("query_start_loc", torch.int32),
                         ("logits_indices", torch.int64), ("state_slots", torch.int64),
                         ("sample_state_slots", torch.int64)]:
            t = getattr(b, name)
            assert t.dtype == dt and t.is_contiguous() and t.device.type == "cpu", name
        assert b.block_tables.shape == (2, 3)
        assert out.clone_blocks.shape[1] == 2 and out.clone_states.shape[1] == 2
        if is_prompt:
            assert b.query_start_loc.tolist() == [0, 10, 15] and b.seq_lens.tolist() == [10, 5]
            assert b.logits_indices.tolist() == [9, 14] and b.max_query_len == 10
            assert out.zero_states.tolist() == b.state_slots.tolist()
            assert b.block_tables.tolist()[1][2] == 0  # padding
        else:
            assert b.query_start_loc.tolist() == [0, 1, 2] and b.seq_lens.tolist() == [11, 6]
            assert b.positions.tolist() == [10, 5] and b.logits_indices.tolist() == [0, 1]
            assert b.input_ids.tolist() == [q.output_token_ids[-1] for q in out.seqs]
            assert b.max_query_len == 1 and b.max_seq_len == 11 and b.num_tokens == 2
        s.update(out, r.execute(out))


# ---------------------------------------------------------------- state slots
def test_state_slots_limit_admission():
    s = make(max_num_seqs=2)
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(f"r{i}", [1, 2, i], 2)
    out, _ = step(s, r)
    assert out.seq_ids == [0, 1] and sorted(out.zero_states.tolist()) == [0, 1]
    assert s.num_waiting == 1
    out, fin = step(s, r)  # decode: both finish (max_tokens 2)
    assert len(fin) == 2
    out, _ = step(s, r)
    assert out.is_prompt and out.seq_ids == [2] and out.zero_states.numel() == 1


# ---------------------------------------------------------------- forks
def test_fork_shares_blocks_and_copies_on_write():
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(6)), 4, n=3)
    out, _ = step(s, r)
    assert out.is_prompt and len(out.seqs) == 1 and out.num_samples == 3
    assert out.batch.logits_indices.tolist() == [5, 5, 5]
    parent = out.seqs[0]
    kids = out.sample_seqs[1:]
    assert [k.sample_index for k in kids] == [1, 2]
    assert out.clone_states.tolist() == [[parent.slot, k.slot] for k in kids]
    assert out.zero_states.tolist() == [parent.slot]
    assert out.batch.sample_state_slots.tolist() == [parent.slot] + [k.slot for k in kids]
    assert all(k.blocks == parent.blocks for k in kids)
    assert s.block_pool.ref[parent.blocks].tolist() == [3, 3]
    shared = parent.blocks[1]
    out, _ = step(s, r)  # each writes position 6 into the shared partial block
    pairs = out.clone_blocks.tolist()
    assert len(pairs) == 2 and all(src == shared for src, _ in pairs)
    assert len({q.blocks[1] for q in out.seqs}) == 3
    assert s.block_pool.ref[parent.blocks[0]] == 3
    fin, _ = run_to_completion(s, r)
    assert sorted(len(q.output_token_ids) for q in fin) == [4, 4, 4]
    assert s.cache_usage() == 0


def test_fork_full_blocks_need_no_copy():
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(8)), 3, n=2)
    step(s, r)
    out, _ = step(s, r)
    assert out.clone_blocks.numel() == 0
    assert len({q.blocks[2] for q in out.seqs}) == 2


def test_fork_group_needs_n_slots():
    s = make(max_num_seqs=3)
    r = FakeRunner(s)
    s.add_request("x", [1, 2], 5)
    s.add_request("g", [3, 4], 2, n=3)
    out, _ = step(s, r)
    assert out.seq_ids == [0]  # g needs 3 free slots, only 2 left
    run_to_completion(s, r)


# ---------------------------------------------------------------- chunked prefill
def test_chunked_prefill_cuts_last_and_continues_first():
    s = make(max_num_batched_tokens=8, block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(5)), 2)
    s.add_request("b", list(range(10, 16)), 2)
    s.add_request("c", [7], 2)
    out, _ = step(s, r)
    assert out.is_prompt and out.seq_ids == [0, 1] and out.num_batched_tokens == 8
    assert out.batch.seq_lens.tolist() == [5, 3] and out.num_samples == 1
    assert out.batch.logits_indices.tolist() == [4]
    assert s.waiting[0].request_id == "b"
    out, _ = step(s, r)  # ALL point right after a prompt step: b continues first
    assert out.is_prompt and out.seq_ids == [1, 2]
    assert out.batch.positions.tolist() == [3, 4, 5, 0]
    assert out.batch.seq_lens.tolist() == [6, 1] and out.batch.query_start_loc.tolist() == [0, 3, 4]
    assert out.batch.logits_indices.tolist() == [2, 3] and out.zero_states.numel() == 1
    fin, _ = run_to_completion(s, r)
    assert sorted(q.request_id for q in fin) == ["a", "b", "c"]


def test_chunked_prefill_disabled_waits_for_whole_prompt():
    s = make(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    r = FakeRunner(s)
    s.add_request("a", list(range(40)), 2)
    s.add_request("b", list(range(100, 130)), 2)
    out, _ = step(s, r)
    assert out.seq_ids == [0]
    out, _ = step(s, r)
    assert out.seq_ids == [1] and out.num_batched_tokens == 30


def test_long_prompt_chunks_over_several_steps():
    s = make(max_num_batched_tokens=8, max_model_len=64)
    r = FakeRunner(s)
    s.add_request("a", list(range(30)), 3)
    lens = []
    while s.num_running == 0:
        out, _ = step(s, r)
        lens.append(out.num_batched_tokens)
    assert lens == [8, 8, 8, 6]


# ---------------------------------------------------------------- prefix cache
def test_prefix_cache_hits_and_last_token_is_computed():
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(12)), 2)
    run_to_completion(s, r)
    assert s.cache_usage() == 0 and s.block_pool.num_cached == 3  # 3 full blocks
    s.add_request("b", list(range(12)), 2)  # fully cached: recompute the last block
    out, _ = step(s, r)
    assert out.num_batched_tokens == 4 and out.batch.seq_lens.tolist() == [12]
    assert out.batch.positions.tolist() == [8, 9, 10, 11]
    assert s.get_sequences("b")[0].num_cached_tokens == 8
    s.add_request("c", list(range(9)), 2)  # 2 cached blocks, computes token 8 only
    out, _ = step(s, r)
    assert out.num_batched_tokens == 1 and out.batch.positions.tolist() == [8]
    run_to_completion(s, r)
    assert s.stats.prefix_cache_hits == 16 and s.stats.prefix_cache_queries == 33


def test_prefix_cache_shared_while_running():
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(9)), 6)
    step(s, r)
    s.add_request("b", list(range(8)) + [99, 98], 3)
    out, _ = step(s, r)
    assert out.is_prompt and out.batch.seq_lens.tolist() == [10]
    b = s.get_sequences("b")[0]
    a = s.get_sequences("a")[0]
    assert b.blocks[:2] == a.blocks[:2] and b.num_cached_tokens == 8
    assert s.block_pool.ref[a.blocks[0]] == 2
    run_to_completion(s, r)


def test_prefix_cache_verifies_tokens_on_hash_collision(monkeypatch):
    import deepinfer_scheduler.kv_cache as mod

    monkeypatch.setattr(mod, "chain_hash", lambda parent, toks: 12345)
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(12)), 2)
    run_to_completion(s, r)
    s.add_request("b", list(range(100, 112)), 2)  # same (colliding) hashes, other tokens
    out, _ = step(s, r)
    assert out.num_batched_tokens == 12  # no false hit; FakeRunner checked the KV
    run_to_completion(s, r)
    s.add_request("c", list(range(12)), 2)
    out, _ = step(s, r)
    # Only one block per hash can be registered: a hit on block 0, the chain stops.
    assert s.get_sequences("c")[0].num_cached_tokens in (0, 4)
    run_to_completion(s, r)


def test_evictable_blocks_free_and_lru_eviction():
    s = make(num_blocks=6, block_size=4, max_model_len=24)
    r = FakeRunner(s)
    s.add_request("a", list(range(8)), 1)
    run_to_completion(s, r)
    s.add_request("b", list(range(50, 58)), 1)
    run_to_completion(s, r)
    assert s.cache_usage() == 0 and s.block_pool.num_evictable == 4
    # 16 tokens of K/V need 4 blocks: 2 free + evict 2 (a's, the least recently used).
    s.add_request("c", list(range(20, 36)), 1)
    run_to_completion(s, r)
    s.add_request("b2", list(range(50, 58)) + [1], 2)
    out, _ = step(s, r)
    assert s.get_sequences("b2")[0].num_cached_tokens == 8  # b survived
    run_to_completion(s, r)
    s.add_request("a2", list(range(8)) + [1], 2)
    out, _ = step(s, r)
    assert s.get_sequences("a2")[0].num_cached_tokens == 0  # a was evicted
    run_to_completion(s, r)


def test_prefix_caching_disabled():
    s = make(enable_prefix_caching=False)
    r = FakeRunner(s)
    for rid in ("a", "b"):
        s.add_request(rid, list(range(12)), 2)
        run_to_completion(s, r)
    assert s.stats.prefix_cache_hits == 0 and s.block_pool.num_cached == 0


# ---------------------------------------------------------------- preemption
def test_preemption_recomputes_most_recent():
    s = make(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(7)), 10)
    s.add_request("b", list(range(10, 17)), 10)
    s.add_request("c", list(range(20, 27)), 10)
    out, _ = step(s, r)
    assert out.seq_ids == [0, 1, 2]  # 6 blocks, all used
    step(s, r)
    out, _ = step(s, r)  # each needs a new block at position 8: c then b preempted
    assert s.stats.num_preemptions >= 1
    assert out.seq_ids[0] == 0 and 2 not in out.seq_ids
    assert s.waiting[0].request_id in ("b", "c")
    assert s.waiting[0].status is SequenceStatus.WAITING and s.waiting[0].slot == -1
    fin, _ = run_to_completion(s, r)
    assert sorted(len(q.output_token_ids) for q in fin) == [10, 10, 10]
    assert all(q.finish_reason == "length" for q in fin)
    assert s.cache_usage() == 0


def test_single_sequence_that_fills_cache_finishes():
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    r = FakeRunner(s)
    s.add_request("a", list(range(5)), 12)  # 16 tokens of K/V: exactly the cache
    s.add_request("b", list(range(5)), 12)
    fin, _ = run_to_completion(s, r)
    assert sorted(len(q.output_token_ids) for q in fin) == [12, 12]


# ---------------------------------------------------------------- stop tokens
class Scripted(FakeRunner):
    def __init__(self, s, tokens):
        super().__init__(s)
        self.tokens = list(tokens)

    def sample(self, n):
        return [self.tokens.pop(0) for _ in range(n)]


def test_stop_tokens_and_min_tokens():
    s = make()
    s.add_request("a", [1, 2], 10, stop_token_ids=[7], min_tokens=2)
    r = Scripted(s, [7, 7, 3, 7, 9])
    fin, _ = run_to_completion(s, r)
    (q,) = fin
    assert q.output_token_ids == [7, 7, 3, 7] and q.finish_reason == "stop"


def test_max_tokens_one_finishes_in_prompt_step():
    s = make()
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 1, n=2)
    out, fin = step(s, r)
    assert out.is_prompt and len(fin) == 2 and all(q.finish_reason == "length" for q in fin)
    assert not s.has_unfinished() and s.cache_usage() == 0


def test_update_validates_sample_count():
    s = make()
    s.add_request("a", [1, 2, 3], 3)
    out = s.schedule()
    with pytest.raises(ValueError, match="sampled token ids"):
        s.update(out, [1, 2])
    s.update(out, torch.tensor([5]))
    with pytest.raises(ValueError, match="oldest schedule"):
        s.update(out, [5])


def test_update_order_with_one_step_in_flight():
    """Overlap: step k+1 is scheduled before step k is updated; updates go in order, and
    a third schedule() before any update is refused."""
    s = make()
    s.add_request("a", [1, 2, 3], 5)
    out1 = s.schedule()
    out2 = s.schedule()  # decode over the placeholder of out1's sample
    assert not out2.is_prompt and out2.batch.positions.tolist() == [3]
    assert out2.batch.input_ids.tolist() == [-1]
    with pytest.raises(RuntimeError, match="two steps"):
        s.schedule()
    with pytest.raises(ValueError, match="oldest schedule"):
        s.update(out2, [6])
    s.update(out1, [5])
    s.check_invariants()
    s.update(out2, [6])
    s.check_invariants()
    assert s.get_sequences("a")[0].output_token_ids == [5, 6]


# ---------------------------------------------------------------- threads
def test_add_and_abort_from_another_thread():
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=16,
                                  max_num_batched_tokens=64, max_model_len=64))
    r = FakeRunner(s)
    stop = threading.Event()
    errors = []

    def client():
        try:
            i = 0
            while not stop.is_set():
                s.add_request(f"t{i}", [1, 2, 3, i % 7], 4)
                if i % 3 == 0:
                    s.abort(f"t{i - 1}")
                i += 1
                if i > 300:
                    break
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=client)
    th.start()
    for _ in range(200):
        out = s.schedule()
        s.update(out, r.execute(out))
    stop.set()
    th.join()
    assert not errors
    run_to_completion(s, r)
    s.check_invariants()
    assert s.cache_usage() == 0


def test_a_buffer_set_waits_for_its_last_copies_before_being_rewritten():
    """Launch buffers alternate between two sets; a set whose consumer recorded a copy
    event is not rewritten until that event completed (CUDA events where a GPU runs; the
    same protocol through any object with ``synchronize()``)."""

    class Copies:
        def __init__(self) -> None:
            self.waited = 0

        def synchronize(self) -> None:
            self.waited += 1

    s = make()
    s.add_request("a", [1, 2, 3, 4, 5], 6)
    r = FakeRunner(s)
    out = s.schedule()
    first = out.batch.buffers
    copies = Copies()
    first.copied = copies  # what LaunchBatch.mark_copied records on CUDA
    s.update(out, r.execute(out))
    out = s.schedule()  # the other set: nothing to wait for
    assert out.batch.buffers is not first and copies.waited == 0
    s.update(out, r.execute(out))
    out = s.schedule()  # back to the first set: its copies are waited for, once
    assert out.batch.buffers is first and copies.waited == 1 and first.copied is None
    s.update(out, r.execute(out))
