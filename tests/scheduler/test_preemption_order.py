"""Preemption while other requests wait: the victim goes back to the *front* of the
waiting queue (it was admitted before them), is the next sequence admitted, and its
output is the same as in a run without preemption."""

from __future__ import annotations

import zlib

from tests.scheduler.helpers import FakeRunner, make, run_to_completion, tokens_of


class Deterministic(FakeRunner):
    """Samples a function of the sequence's tokens, so a recomputed sequence continues
    exactly as it would have without preemption."""

    def execute(self, out):
        self._out = out
        return super().execute(out)

    def sample(self, n):
        assert n == len(self._out.sample_seqs)
        return [zlib.crc32(repr(tokens_of(s)).encode()) % self.vocab
                for s in self._out.sample_seqs]


# a and c fill the 4-block cache after their prompt step; d then waits. At position 8 a
# needs a third block: c (admitted last) is preempted.
PROMPTS = {"a": list(range(7)), "c": list(range(20, 27)), "d": [30, 31]}
CONFIG = dict(num_blocks=4, block_size=4, max_model_len=24, max_num_seqs=4)


def outputs_without_preemption():
    s = make(**{**CONFIG, "num_blocks": 64})
    r = Deterministic(s)
    for rid, prompt in PROMPTS.items():
        s.add_request(rid, prompt, 10)
    fin, _ = run_to_completion(s, r)
    assert s.stats.num_preemptions == 0
    return {q.request_id: list(q.output_token_ids) for q in fin}


def test_victim_requeued_before_waiting_requests():
    s = make(**CONFIG)
    r = Deterministic(s)
    for rid in "ac":
        s.add_request(rid, PROMPTS[rid], 10)
    out = s.schedule()
    s.update(out, r.execute(out))
    assert out.is_prompt and [q.request_id for q in out.seqs] == ["a", "c"]
    s.add_request("d", PROMPTS["d"], 10)  # waits: the cache is full (usage > watermark)
    a, d = s.get_sequences("a")[0], s.get_sequences("d")[0]
    victim = None
    for _ in range(5):
        out = s.schedule()
        assert not out.is_prompt
        before = list(s.get_sequences("c")[0].output_token_ids)
        s.update(out, r.execute(out))
        s.check_invariants()
        if s.stats.num_preemptions:
            victim = s.get_sequences("c")[0]
            break
    assert victim is not None, "expected a preemption once a needs a new block"
    assert [q.request_id for q in s.waiting] == ["c", "d"], "victim must be requeued first"
    assert victim.output_token_ids == before  # kept: recomputed, not restarted
    # The next admission (whatever step it comes in) is the victim.
    for _ in range(50):
        out = s.schedule()
        s.update(out, r.execute(out))
        s.check_invariants()
        if out.is_prompt and out.seqs:
            assert out.seqs[0].request_id == "c", "the victim must be admitted first"
            break
    else:
        raise AssertionError("nothing was admitted after the preemption")
    run_to_completion(s, r)  # (c and d may preempt each other later: outputs still hold)
    want = outputs_without_preemption()
    assert victim.finish_reason == "length"
    assert victim.output_token_ids == want["c"], "recompute changed the victim's output"
    for q in (a, d):
        assert q.output_token_ids == want[q.request_id]


def test_victim_is_the_most_recently_admitted_of_several():
    """Three running, the cache full: the first sequence needing a block preempts the
    last admitted one, not its neighbour; the next one then preempts itself; each
    preemption is counted; a victim reports no computed tokens while it waits."""
    s = make(num_blocks=5, block_size=4, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s)
    for rid, prompt in (("a", list(range(7))), ("b", list(range(10, 17))), ("c", [1, 2, 3])):
        s.add_request(rid, prompt, 6)
    out = s.schedule()
    s.update(out, r.execute(out))
    assert [q.request_id for q in out.seqs] == ["a", "b", "c"]  # 2 + 2 + 1 blocks: full
    out = s.schedule()  # fills the last block of each
    s.update(out, r.execute(out))
    out = s.schedule()  # a, b, c each need a new block; none is free
    s.check_invariants()
    assert [q.request_id for q in out.seqs] == ["a"]  # c's block went to a
    assert [q.request_id for q in s.waiting] == ["b", "c"]
    assert s.stats.num_preemptions == 2
    assert all(q.num_computed_tokens == 0 and q.slot == -1 for q in s.waiting)
    s.update(out, r.execute(out))
    run_to_completion(s, r)


def test_copy_on_write_with_one_free_block_preempts_nobody():
    """Two samples (n = 2) share their partial last block; the first decode write copies
    it for one of them. One free block is enough: no preemption."""
    s = make(num_blocks=3, block_size=4, max_model_len=12, max_num_seqs=2)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3, 4, 5, 6], 2, n=2)  # 2 blocks, the second shared
    out = s.schedule()
    s.update(out, r.execute(out))
    assert s.block_pool.num_free == 1
    out = s.schedule()  # position 6 of both: a copy of the shared block
    assert not out.is_prompt and len(out.seqs) == 2
    assert s.stats.num_preemptions == 0 and out.clone_blocks.numel() == 2
    s.update(out, r.execute(out))
    s.check_invariants()


def test_copy_on_write_without_a_free_block_preempts():
    s = make(num_blocks=2, block_size=4, max_model_len=8, max_num_seqs=2)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3, 4, 5, 6], 2, n=2)  # both blocks, the second shared
    out = s.schedule()
    s.update(out, r.execute(out))
    samples = s.get_sequences("a")
    assert len(samples) == 2 and s.block_pool.num_free == 0
    out = s.schedule()  # one sample must give way before the other may write
    assert s.stats.num_preemptions == 1 and len(out.seqs) == 1
    assert out.clone_blocks.numel() == 0  # the survivor owns the block now: no copy
    s.update(out, r.execute(out))
    s.check_invariants()
    run_to_completion(s, r)
    assert [len(q.output_token_ids) for q in samples] == [2, 2]
    assert all(q.finish_reason == "length" for q in samples)
