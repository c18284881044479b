"""Prefix-cache reuse beyond prompts, and the small contracts mutation testing
(`make mutate`) found untested: generated tokens' blocks are cached (a multi-turn prompt
that repeats an answer hits them), also in a decode step that raced an abort; an evicted
block is cached again once reused; a recomputed (preempted) sequence hits its own blocks."""

from __future__ import annotations

from tests.scheduler.helpers import (
    FakeRunner,
    checked_step,
    hits_of,
    make,
    run_to_completion,
    tokens_of,
)

BS = 4




def test_generated_blocks_are_cached_for_the_next_turn():
    s = make(block_size=BS)
    r = FakeRunner(s)
    s.add_request("turn1", [1, 2, 3], 10)  # outputs fill blocks 0..2 (block 0 mostly)
    seq = s.get_sequences("turn1")[0]
    run_to_completion(s, r)
    history = tokens_of(seq)  # 13 tokens; K/V of the first 12 was computed
    assert len(history) == 13
    # The next turn repeats the whole conversation: every computed full block hits.
    assert hits_of(s, r, "turn2", history + [9, 9]) == 12
    assert hits_of(s, r, "partial", history[:10]) == 8


def test_blocks_filled_in_a_decode_step_that_raced_an_abort_are_cached():
    s = make(block_size=BS)
    r = FakeRunner(s)
    s.add_request("keep", [1, 2, 3], 6)
    s.add_request("gone", [4, 5, 6], 6)
    checked_step(s, r)  # prompt step: 3 tokens each, first output sampled (4 tokens)
    out = s.schedule()  # decode at position 3: completes block 0 of both
    s.abort("gone")  # between schedule and update: update takes the per-sequence path
    s.update(out, r.execute(out))
    keep = s.get_sequences("keep")[0]
    assert len(keep.output_token_ids) == 2
    block0 = tokens_of(keep)[:BS]
    run_to_completion(s, r)
    assert hits_of(s, r, "again", block0 + [0]) == BS


def test_evicted_block_is_cached_again_when_reused():
    s = make(num_blocks=3, block_size=BS, max_model_len=12)
    r = FakeRunner(s)
    assert hits_of(s, r, "a", [1, 2, 3, 4, 5], 1) == 0  # caches block [1, 2, 3, 4]
    # 9 tokens need 3 blocks: the cached block is evicted (and reused for [14]).
    assert hits_of(s, r, "b", [6, 7, 8, 9, 10, 11, 12, 13, 14], 1) == 0
    assert s.block_pool.num_cached == 2
    assert hits_of(s, r, "b-again", [6, 7, 8, 9, 10, 11, 12, 13, 0], 1) == 8
    assert hits_of(s, r, "a-again", [1, 2, 3, 4, 0], 1) == 0  # evicted


def test_evicted_block_reused_for_a_full_block_is_cached_again():
    """The free list empty, an allocation evicts the LRU cached block; once that block is
    filled again it is registered under its new hash (an evicted block is not left
    marked as cached)."""
    s = make(num_blocks=3, block_size=BS, max_model_len=12)
    r = FakeRunner(s)
    assert hits_of(s, r, "a", [1, 2, 3, 4], 1) == 0  # block 0 cached
    assert hits_of(s, r, "x", list(range(20, 28)), 1) == 0  # blocks 1, 2 cached
    assert s.block_pool.num_free == 3 and s.block_pool.num_evictable == 3
    # Block 0 (least recently used) is evicted and refilled with [6..9].
    assert hits_of(s, r, "b", [6, 7, 8, 9, 10], 1) == 0
    assert hits_of(s, r, "b-again", [6, 7, 8, 9, 0], 1) == BS
    assert hits_of(s, r, "a-again", [1, 2, 3, 4, 0], 1) == 0  # evicted


def test_recomputed_sequence_hits_its_own_cached_blocks():
    """A preempted sequence frees its blocks tail first, so its prefix stays cached and
    its recompute step starts after it."""
    s = make(num_blocks=4, block_size=BS, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(7)), 3)
    s.add_request("c", list(range(20, 27)), 10)
    checked_step(s, r)  # both prompts: 2 blocks each, the cache is full
    checked_step(s, r)
    _, fin = checked_step(s, r)  # a needs a third block at position 8: c is preempted; a ends
    assert s.stats.num_preemptions == 1
    assert [q.request_id for q in fin] == ["a"] and not s.running
    (victim,) = s.waiting
    assert victim.request_id == "c" and victim.num_tokens == 9
    out, _ = checked_step(s, r)  # c recomputes: its first block [20..23] is still cached (its
    # second one, freed first, was evicted for a)
    assert out.is_prompt and out.seqs == [victim]
    assert out.batch.positions.tolist() == [4, 5, 6, 7, 8]
    assert out.batch.seq_lens.tolist() == [9]
    fin, _ = run_to_completion(s, r)
    assert fin == [victim] and len(victim.output_token_ids) == 10
    assert victim.num_cached_tokens == 0  # hits at its first admission only


def test_generated_blocks_cached_with_tiny_blocks():
    """Block sizes 1 and 2: a decode step registers exactly the blocks whose K/V it
    completed (never the block of the token it just sampled)."""
    for bs in (1, 2):
        s = make(block_size=bs)
        r = FakeRunner(s)
        s.add_request("turn1", [1, 2, 3], 6)
        seq = s.get_sequences("turn1")[0]
        run_to_completion(s, r)
        history = tokens_of(seq)  # 9 tokens; K/V of the first 8 was computed
        assert hits_of(s, r, "turn2", history + [9]) == 8


def test_forked_samples_share_the_prefix_hit_count():
    s = make(block_size=BS)
    r = FakeRunner(s)
    assert hits_of(s, r, "warm", [1, 2, 3, 4, 5]) == 0
    s.add_request("n2", [1, 2, 3, 4, 6], 2, n=2)
    checked_step(s, r)  # the prompt completes: the second sample is forked from the first
    samples = s.get_sequences("n2")
    assert [q.sample_index for q in samples] == [0, 1]
    assert [q.num_cached_tokens for q in samples] == [BS, BS]
    run_to_completion(s, r)


def test_recomputed_sequence_without_hits_registers_its_blocks_again():
    """A victim whose cached blocks were all evicted recomputes with no hits; its full
    blocks then enter the prefix cache again, the first one included."""
    s = make(num_blocks=4, block_size=BS, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s)
    s.add_request("a", list(range(7)), 9)  # grows to 4 blocks: evicts both of c's
    s.add_request("c", list(range(20, 27)), 3)
    checked_step(s, r)
    checked_step(s, r)
    checked_step(s, r)  # a needs a third block: c preempted
    (victim,) = s.waiting
    assert victim.request_id == "c"
    fin, _ = run_to_completion(s, r)
    assert victim.num_cached_tokens == 0 and victim.finish_reason == "length"
    assert hits_of(s, r, "c-prefix", list(range(20, 24)) + [0], 1) == BS


def test_no_prefix_cache_registers_nothing():
    s = make(block_size=BS, enable_prefix_caching=False)
    r = FakeRunner(s)
    assert hits_of(s, r, "a", list(range(9)), 6) == 0
    assert hits_of(s, r, "a-again", list(range(9)), 6) == 0
    assert s.block_pool.num_cached == 0 and s.block_pool.num_evictable == 0
