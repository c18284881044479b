"""Overlapped scheduling at the scheduler level: step k+1 is scheduled (and run by the
fake runner, placeholders resolved from its own sampled ids) before step k's tokens are
applied. Outputs must equal the plain loop's token for token, with stop tokens,
min_tokens, n > 1, prefix-cache hits, chunked prefill and preemption."""

from __future__ import annotations

import numpy as np
import pytest

from tests.scheduler.helpers import FakeRunner, make, run_overlapped, run_to_completion


def workload(sched, seed: int) -> None:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50, 12).tolist()  # a common prefix: prefix-cache hits
    for i in range(14):
        tail = rng.integers(0, 50, int(rng.integers(1, 20))).tolist()
        prompt = (shared if i % 2 else []) + tail
        sched.add_request(f"r{i}", prompt, int(rng.integers(1, 14)),
                          n=int(rng.choice([1, 1, 2, 3])),
                          stop_token_ids=[int(rng.integers(0, 50))],
                          min_tokens=int(rng.integers(0, 3)))


def outputs(finished) -> dict:
    return {(s.request_id, s.sample_index): (list(s.output_token_ids), s.finish_reason)
            for s in finished}


@pytest.mark.parametrize("num_blocks,batched", [(200, 64), (40, 64), (24, 16)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_equals_plain(num_blocks, batched, seed):
    kw = dict(max_num_seqs=8, max_num_batched_tokens=batched, block_size=4,
              max_model_len=64, enable_prefix_caching=True)
    plain = make(num_blocks, **kw)
    workload(plain, seed)
    done_plain, _ = run_to_completion(plain, FakeRunner(plain, by_history=True))
    over = make(num_blocks, **kw)
    workload(over, seed)
    done_over, _ = run_overlapped(over, FakeRunner(over, by_history=True))
    assert outputs(done_over) == outputs(done_plain)
    assert len(done_plain) == sum(1 for _ in done_plain)
    assert over.cache_usage() == 0.0 and not over.has_unfinished()
    if num_blocks == 24:
        assert over.stats.num_preemptions > 0  # the small cache did preempt
    assert over.stats.prefix_cache_hits > 0


def test_stop_token_lands_one_step_late_and_is_dropped():
    """A stop token sampled in step k ends its sequence at update(k); step k+1 already
    computed one more token for it: that token is dropped, never appended."""
    s = make()
    runner = FakeRunner(s, by_history=True)
    s.add_request("a", [1, 2, 3], 10)
    out1 = s.schedule()
    t1 = runner.execute(out1)
    out2 = s.schedule()
    t2 = runner.execute(out2)
    seq = s.get_sequences("a")[0]
    s.finish_sequence(seq.seq_id, "stop")  # as a stop string found in t1 would
    s.update(out1, t1)
    assert s.dropped == [seq]
    s.update(out2, t2)
    assert s.dropped == [seq]
    assert seq.output_token_ids == [] and s.cache_usage() == 0.0
    s.check_invariants()


def test_length_limit_known_at_schedule_time():
    """A sequence whose in-flight token is its last (max_tokens) is not scheduled again."""
    s = make()
    runner = FakeRunner(s, by_history=True)
    s.add_request("a", [1, 2, 3], 1)
    s.add_request("b", [4, 5], 3)
    out1 = s.schedule()
    t1 = runner.execute(out1)
    out2 = s.schedule()
    assert [q.request_id for q in out2.seqs] == ["b"]
    t2 = runner.execute(out2)
    fin = s.update(out1, t1)
    assert [q.request_id for q in fin] == ["a"] and fin[0].finish_reason == "length"
    s.update(out2, t2)
    assert s.dropped == []
    s.check_invariants()


def test_out_of_blocks_takes_a_sequence_whose_last_token_is_in_flight_first():
    """Overlap, no free block: the sequence left out of the step because its in-flight
    token ends it (admitted last) gives up its blocks before any sequence of the step;
    it still finishes with that token, and nothing is recomputed (as the plain loop)."""
    def run(overlapped: bool):
        s = make(num_blocks=3, block_size=2, max_num_seqs=3, max_num_batched_tokens=16,
                 max_model_len=8, enable_prefix_caching=False)
        s.add_request("old", [1, 2], 5)  # its first decode needs a second block
        s.add_request("new", [3, 4, 5, 6], 1)  # 2 blocks; its prompt-step token is its last
        runner = FakeRunner(s, by_history=True)
        if overlapped:
            out0 = s.schedule()
            t0 = runner.execute(out0)
            out1 = s.schedule()  # before update(out0): "new"'s token is in flight
            assert [q.request_id for q in out1.seqs] == ["old"]
            fin = s.update(out0, t0)
            assert [(q.request_id, q.finish_reason) for q in fin] == [("new", "length")]
            s.update(out1, runner.execute(out1))
            done, _ = run_overlapped(s, runner)
        else:
            done, _ = run_to_completion(s, runner)
        s.check_invariants()
        return s.stats, done
    plain_stats, _ = run(False)
    stats, done = run(True)
    assert plain_stats.num_preemptions == 0
    # "new" gave up its blocks (one preemption, counted) and was never run again.
    assert stats.num_preemptions == 1 and stats.num_prompt_steps == 1
    assert [(q.request_id, len(q.output_token_ids)) for q in done] == [("old", 5)]


@pytest.mark.parametrize("kind", ["list", "tensor", "ndarray", "tuple"])
def test_update_takes_ids_as_list_tensor_array_or_iterable(kind):
    """The runner hands ``update()`` a list; a tensor (any shape with S ids), an array or
    any iterable of ints must apply the same tokens."""
    import torch

    s = make()
    s.add_request("a", [1, 2, 3], 4, n=2)
    out = s.schedule()
    ids = [7, 9]
    given = {"list": ids, "tensor": torch.tensor([ids]), "ndarray": np.array(ids),
             "tuple": tuple(ids)}[kind]
    s.update(out, given)
    got = sorted((q.sample_index, q.output_token_ids) for q in s.get_sequences("a"))
    assert got == [(0, [7]), (1, [9])]
    assert all(isinstance(t, int) for q in s.get_sequences("a") for t in q.output_token_ids)
    s.check_invariants()
