"""Prefix-cache registration and preemption details that mutation testing (`make mutate`)
showed no test pinned:

- ``KVCache.register`` chains a block to its parent *in the sequence's own row*: blocks
  registered one chunk (or one hit) after their parent must still be found by a later
  prompt with the same prefix, also when the sequence is not in state slot 0 (the
  block-table row of slot 0 is not its row);
- a sequence's hash chain, already partly computed, is extended from its last hashed
  block (a preempted sequence whose in-flight token landed after the preemption);
- preempting the cut prompt of chunked prefill (``Scheduler._preempt_partial``): the
  counter, the released slot/blocks/progress, and the outputs once it is recomputed;
- ``Sequence.fork``: a child carries the parent's prefix-cache progress and first-admission
  hit count, also through its own preemption.
"""

from __future__ import annotations

import threading

from deepinfer_scheduler import Sequence, SequenceStatus
from tests.scheduler.helpers import (
    FakeRunner,
    checked_step,
    hits_of,
    make,
    run_to_completion,
    tokens_of,
)

BS = 4




def schedule_within(s, seconds: float = 10.0):
    """``s.schedule()``, failing (instead of hanging the run) if it never returns."""
    box: list = []

    def target():
        try:
            box.append(s.schedule())
        except BaseException as e:  # re-raised in the test's thread
            box.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"schedule() did not return within {seconds} s (preemption loop?)"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def start_holder(s, r):
    """A long request that holds state slot 0 (and block 0) for the rest of the test, so
    that the sequences under test get another slot and other blocks."""
    s.add_request("holder", [90, 91], 40)
    checked_step(s, r)
    (holder,) = s.get_sequences("holder")
    assert holder.slot == 0 and holder.blocks == [0]
    return holder


# --------------------------------------------------------------------------- register
def test_chunked_prompt_chains_each_block_to_its_parent_in_its_own_row():
    """One block per prompt step: blocks 1 and 2 are registered by later ``register``
    calls than their parents; their recorded parent must be the previous block of the
    sequence's own row."""
    s = make(block_size=BS, max_num_batched_tokens=BS)
    r = FakeRunner(s)
    start_holder(s, r)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks, then the last token
    s.add_request("x", prompt, 1)
    (x,) = s.get_sequences("x")
    chunks = []
    parents: list[int] = []
    while x.status is SequenceStatus.WAITING:
        out, _ = checked_step(s, r)
        if x in out.seqs:
            chunks.append(out.batch.positions.tolist())
            assert x.slot != 0
            parents = x.blocks
    assert chunks == [list(range(0, 4)), list(range(4, 8)), list(range(8, 12)), [12]]
    assert 0 not in parents[:3]  # a stale or padding id (0) cannot pass for the parent
    # Same three blocks, another last token: every block verifies against its parent.
    assert hits_of(s, r, "y", prompt[:12] + [99], max_tokens=1) == 3 * BS
    assert hits_of(s, r, "y1", prompt[:8] + [99], max_tokens=1) == 2 * BS


def test_blocks_registered_after_a_hit_chain_to_the_hit_block():
    """A prompt that hits its first block registers its next two in one call: the first
    one's parent is the hit block (its row's entry), the second one's the first one."""
    s = make(block_size=BS)
    r = FakeRunner(s)
    start_holder(s, r)
    a, b, c = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    s.add_request("warm", a + [1], 1)  # caches block a
    checked_step(s, r)
    s.add_request("x", a + b + c + [2], 1)
    (x,) = s.get_sequences("x")
    out = s.schedule()
    assert out.is_prompt and out.seqs == [x] and x.num_cached_tokens == BS
    assert out.batch.positions.tolist() == list(range(BS, 13))  # b, c and the last token
    assert x.slot != 0 and 0 not in x.blocks
    s.update(out, r.execute(out))
    s.check_invariants()
    assert x.finish_reason == "length"
    assert hits_of(s, r, "y", a + b + c + [3], max_tokens=1) == 3 * BS
    assert hits_of(s, r, "y1", a + b + [3], max_tokens=1) == 2 * BS


def test_decode_registers_one_block_per_step_chained_from_the_last():
    """Blocks filled by generated tokens are registered one decode step at a time, each
    chained from the block registered the step before (the hash and the parent)."""
    s = make(block_size=BS)
    r = FakeRunner(s)
    start_holder(s, r)
    s.add_request("x", [1, 2, 3], 18)  # 21 tokens: K/V of 20 computed, 5 full blocks
    (x,) = s.get_sequences("x")
    checked_step(s, r)
    assert x.slot != 0
    while x.status is SequenceStatus.RUNNING:
        checked_step(s, r)
    history = tokens_of(x)
    assert len(history) == 21 and x.finish_reason == "length"
    assert hits_of(s, r, "all", history[:20] + [0], max_tokens=1) == 20
    assert hits_of(s, r, "three", history[:12] + [0], max_tokens=1) == 12


# ------------------------------------------------------------- hash-chain extension
def test_preempted_sequence_extends_its_hash_chain_from_the_last_hashed_block():
    """Overlapped steps: ``v`` is preempted while its token of the step before is still in
    flight; that token lands afterwards, completing a block no one registered for ``v``.
    At its readmission ``v`` has more full blocks than chain hashes: the missing hash
    continues from its last one, so it hits its twin's identical block too."""
    s = make(num_blocks=6, block_size=BS, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s, by_history=True)  # same history, same tokens: t and v stay twins
    prompt = list(range(10, 17))
    s.add_request("t", prompt, 12)
    s.add_request("v", prompt, 12)
    (t,) = s.get_sequences("t")
    (v,) = s.get_sequences("v")
    inflight = None
    preempted_at = hashed = readmission = None
    for _ in range(100):
        if not s.has_unfinished() and inflight is None:
            break
        nxt = None
        if s.has_unfinished():
            out = s.schedule()
            if preempted_at is None and v.status is SequenceStatus.WAITING:
                preempted_at = v.num_tokens  # its in-flight token has not landed yet
                assert s.stats.num_preemptions == 1
            if readmission is None and preempted_at is not None and v in out.seqs:
                assert out.is_prompt
                readmission = (len(v.block_hashes), v.num_tokens,
                               out.batch.positions.tolist())
            nxt = (out, r.execute(out))
        if inflight is not None:
            s.update(*inflight)
            s.check_invariants()
        if preempted_at is not None and readmission is None:
            # Before it is admitted again: fewer chain hashes than computed full blocks.
            hashed = len(v.block_hashes)
        inflight = nxt
    assert preempted_at == 12 and hashed == 2
    assert readmission is not None
    nhash, ntok, positions = readmission
    assert ntok == 13 and nhash == 3
    # Blocks 0..2 hit (block 2 through the extended hash); only the last token computes.
    assert positions == [12]
    assert t.output_token_ids == v.output_token_ids and len(v.output_token_ids) == 12


# ------------------------------------------------------------------ partial preemption
def test_decode_preempts_the_cut_prompt_first():
    """``a`` decodes while ``b``'s prompt is cut (chunked prefill) and cannot continue:
    when ``a`` needs a block and none is free, the cut prompt is preempted (not ``a``):
    counted, its slot and blocks freed, its progress reset; it stays first in waiting,
    is recomputed later and ends with the outputs of a run without memory pressure.
    Two rounds on one scheduler, so the counter must add up."""
    cfg = dict(num_blocks=4, block_size=BS, max_model_len=24, max_num_seqs=4,
               max_num_batched_tokens=8)

    def prompts(k):
        return [100 * k + 1, 100 * k + 2, 100 * k + 3], list(range(100 * k + 20, 100 * k + 33))

    # Reference outputs: the same requests with room to spare (no preemption).
    ref = make(**{**cfg, "num_blocks": 64})
    rr = FakeRunner(ref, by_history=True)
    want = {}
    for k in range(2):
        pa, pb = prompts(k)
        ref.add_request(f"a{k}", pa, 10)
        ref.add_request(f"b{k}", pb, 2)
        fin, _ = run_to_completion(ref, rr)
        want.update({q.request_id: q.output_token_ids for q in fin})
    assert ref.stats.num_preemptions == 0

    s = make(**cfg)
    r = FakeRunner(s, by_history=True)
    for k in range(2):
        pa, pb = prompts(k)
        s.add_request(f"a{k}", pa, 10)
        s.add_request(f"b{k}", pb, 2)
        (a,) = s.get_sequences(f"a{k}")
        (b,) = s.get_sequences(f"b{k}")
        out = schedule_within(s)
        # a whole, b cut after 5 tokens (budget 8): b holds 2 blocks, a 1, one is free.
        assert out.is_prompt and out.seqs == [a, b] and b.status is SequenceStatus.WAITING
        assert b.slot >= 0 and b.num_computed == 5 and len(b.blocks) == 2
        s.update(out, r.execute(out))
        s.check_invariants()
        hits_before = s.stats.prefix_cache_hits
        for _ in range(20):
            held = b.slot >= 0
            out = schedule_within(s)
            if s.stats.num_preemptions > k:
                break
            # b cannot continue (it needs 2 more blocks): a decodes alone.
            assert not out.is_prompt and out.seqs == [a]
            s.update(out, r.execute(out))
            s.check_invariants()
        else:
            raise AssertionError("expected a preemption")
        assert held, "the cut prompt held its slot until it was preempted"
        assert s.stats.num_preemptions == k + 1
        # a got b's block and writes its position 8 (third block) in this very step.
        assert not out.is_prompt and out.seqs == [a] and a.status is SequenceStatus.RUNNING
        assert out.batch.positions.tolist() == [8] and len(a.blocks) == 3
        assert s.waiting[0] is b and b.status is SequenceStatus.WAITING
        assert b.slot == -1 and b.blocks == [] and b.num_computed_tokens == 0
        s.update(out, r.execute(out))
        s.check_invariants()
        # b comes back after a: its first block (registered by its cut step) still hits.
        readmit = None
        for _ in range(40):
            if not s.has_unfinished():
                break
            out = schedule_within(s)
            if readmit is None and b in out.seqs:
                readmit = out.batch.positions.tolist()
            s.update(out, r.execute(out))
            s.check_invariants()
        assert not s.has_unfinished() and s.stats.num_preemptions == k + 1
        assert readmit is not None and readmit[0] == BS
        assert s.stats.prefix_cache_hits - hits_before == BS
        assert b.num_cached_tokens == 0  # hits at its first admission only
        for q, n in ((a, 10), (b, 2)):
            assert q.finish_reason == "length" and len(q.output_token_ids) == n
            assert q.output_token_ids == want[q.request_id]


def test_after_the_cut_prompt_is_preempted_the_next_shortage_preempts_a_running_one():
    """Once preempted, the cut prompt is no longer the cut prompt: the next decode step
    short of blocks (before it is admitted again) preempts the most recent running
    sequence, counted on top of the first preemption."""
    cfg = dict(num_blocks=4, block_size=BS, max_model_len=24, max_num_seqs=4,
               max_num_batched_tokens=8)
    reqs = (("a1", [1, 2, 3], 8), ("a2", [4, 5, 6], 8), ("b", list(range(20, 30)), 2))
    ref = make(**{**cfg, "num_blocks": 64})
    for rid, prompt, n in reqs:
        ref.add_request(rid, prompt, n)
    fin, _ = run_to_completion(ref, FakeRunner(ref, by_history=True))
    want = {q.request_id: q.output_token_ids for q in fin}

    s = make(**cfg)
    r = FakeRunner(s, by_history=True)
    for rid, prompt, n in reqs:
        s.add_request(rid, prompt, n)
    (a1,), (a2,), (b,) = (s.get_sequences(rid) for rid, _, _ in reqs)
    out = schedule_within(s)
    # 3 + 3 tokens, then 2 of b's 10 (cut): one block each, one left.
    assert out.is_prompt and out.seqs == [a1, a2, b] and b.slot >= 0 and len(b.blocks) == 1
    s.update(out, r.execute(out))
    s.check_invariants()
    events = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        before = s.stats.num_preemptions
        out = schedule_within(s)
        if s.stats.num_preemptions != before:
            events.append((s.stats.num_preemptions, [q.request_id for q in out.seqs],
                           [q.request_id for q in s.waiting], b.slot))
        s.update(out, r.execute(out))
        s.check_invariants()
    assert not s.has_unfinished()
    # Position 4: a1 takes the free block, a2 the cut prompt's. Position 8: none is
    # free and nothing is cut any more: a2 (admitted last) gives way to a1.
    assert events == [(1, ["a1", "a2"], ["b"], -1), (2, ["a1"], ["a2", "b"], -1)]
    for q in (a1, a2, b):
        assert q.finish_reason == "length" and q.output_token_ids == want[q.request_id]


# ------------------------------------------------------------------------------ fork
class _Rows:
    def blocks_of(self, slot):
        return [slot]


def test_fork_copies_the_prefix_cache_progress():
    rows = _Rows()
    parent = Sequence(3, "req", 0, [1, 2, 3, 4, 5, 6, 7, 8, 9], 7, min_tokens=2,
                      stop_token_ids=(5, 6), num_forks=2, kv_cache=rows)
    parent.status = SequenceStatus.RUNNING
    parent.admitted = True
    parent.num_cached_tokens = 8
    parent.num_computed = 9
    parent.block_hashes = [111, 222]
    parent.num_registered = 2
    parent.slot = 4
    parent.reserved_slots = [5, 6]
    child = parent.fork(11, 2)
    assert (child.seq_id, child.request_id, child.sample_index) == (11, "req", 2)
    assert child.prompt_token_ids == parent.prompt_token_ids
    assert child.output_token_ids == []
    assert (child.max_tokens, child.min_tokens) == (7, 2)
    assert child.stop_token_ids == frozenset({5, 6})
    assert child.kv_cache is rows
    assert child.status is SequenceStatus.RUNNING and child.finish_reason is None
    assert child.admitted is True
    assert child.num_cached_tokens == 8
    assert child.num_computed == 9
    assert child.num_registered == 2
    assert child.block_hashes == [111, 222]
    assert child.block_hashes is not parent.block_hashes  # its chain grows on its own
    # The slot and the fork bookkeeping are the caller's, not copied.
    assert child.slot == -1 and child.num_forks == 0 and child.reserved_slots == []
    child.block_hashes.append(333)
    assert parent.block_hashes == [111, 222]


def test_forked_child_keeps_its_hit_count_and_its_chain_through_preemption():
    """Both samples of an n = 2 request report the prompt's prefix hit; the child, later
    preempted and readmitted with many more hits, still reports its first admission's.
    The blocks it registered itself (chained from the parent's progress) are what its
    recompute hits."""
    s = make(num_blocks=6, block_size=BS, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s)
    assert hits_of(s, r, "warm", [1, 2, 3, 4, 5], max_tokens=1) == 0
    s.add_request("n2", [1, 2, 3, 4, 6], 12, n=2)
    out, _ = checked_step(s, r)
    parent, child = s.get_sequences("n2")
    assert out.is_prompt and out.sample_seqs == [parent, child]
    assert [q.num_cached_tokens for q in (parent, child)] == [BS, BS]
    readmit = None
    for _ in range(60):
        if not s.has_unfinished():
            break
        before = child.status
        out, _ = checked_step(s, r)
        if before is SequenceStatus.WAITING and child in out.seqs:
            readmit = (out.is_prompt, out.batch.positions.tolist())
    assert s.stats.num_preemptions == 1
    # Preempted at 13 tokens: its 3 full blocks (one shared hit, two it registered) hit,
    # only its last token is recomputed.
    assert readmit == (True, [12])
    assert child.num_cached_tokens == BS and parent.num_cached_tokens == BS
    assert [len(q.output_token_ids) for q in (parent, child)] == [12, 12]
