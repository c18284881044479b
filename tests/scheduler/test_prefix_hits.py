"""Prefix-cache hits block by block when identical token blocks repeat at different
positions, within one prompt and across prompts.

A block's cache key chains its parent's key, so equal tokens at different positions (or
after different prefixes) are different cache entries: every full block of a prompt is
registered, and a later prompt hits exactly the blocks of its longest shared prefix.
(A key of the tokens alone still gives correct outputs, since a hit is verified against
the parent, but repeated blocks then collide and hits are lost.)
"""

from __future__ import annotations

import pytest

from tests.scheduler.helpers import FakeRunner, make, run_to_completion

BS = 4
A = [1, 2, 3, 4]
B = [5, 6, 7, 8]


def run_prompt(s, r, rid, prompt):
    """Run one request alone to completion; returns its prefix-cache hit tokens."""
    s.add_request(rid, prompt, 2)
    seq = s.get_sequences(rid)[0]
    before = s.stats.prefix_cache_hits
    run_to_completion(s, r)
    assert seq.finish_reason == "length"
    assert s.stats.prefix_cache_hits - before == seq.num_cached_tokens
    return seq.num_cached_tokens


def test_repeated_blocks_in_one_prompt_all_cached():
    s = make(block_size=BS)
    r = FakeRunner(s)
    prompt = A * 3 + [5]
    assert run_prompt(s, r, "first", prompt) == 0
    assert run_prompt(s, r, "again", prompt) == 12, "repeated blocks lost their hits"
    # Three full blocks with equal tokens at positions 0, 1, 2: three cache entries.
    assert s.block_pool.num_cached == 3


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_hits_stop_at_the_first_differing_block(k):
    """After A A A 5 is cached, a prompt of k blocks of A then a new token hits k blocks."""
    s = make(block_size=BS)
    r = FakeRunner(s)
    run_prompt(s, r, "first", A * 3 + [5])
    assert run_prompt(s, r, "probe", A * k + [9]) == BS * k


def test_same_block_after_other_prefixes():
    s = make(block_size=BS)
    r = FakeRunner(s)
    run_prompt(s, r, "aaa", A * 3 + [5])
    # A at position 1 after B: not the cached "A at position 0", nor "A after A".
    assert run_prompt(s, r, "ba", B + A + [0]) == 0
    assert s.block_pool.num_cached == 3 + 2
    # Both chains now hit in full, block by block.
    assert run_prompt(s, r, "ba-again", B + A + [1]) == 8
    assert run_prompt(s, r, "baa", B + A + A + [1]) == 8
    assert run_prompt(s, r, "baab", B + A + A + B + [1]) == 12
    assert run_prompt(s, r, "aa", A * 2 + [1]) == 8
    assert run_prompt(s, r, "b", B + [1]) == 4
    assert run_prompt(s, r, "ab", A + B + [1]) == 4


def test_repeated_blocks_shared_while_running():
    """The second copy of the prompt arrives while the first still runs: it shares all
    three blocks (one reference each) instead of recomputing them."""
    s = make(block_size=BS)
    r = FakeRunner(s)
    prompt = A * 3 + [5]
    s.add_request("first", prompt, 6)
    out = s.schedule()
    s.update(out, r.execute(out))
    s.add_request("second", prompt, 6)
    out = s.schedule()
    s.update(out, r.execute(out))
    assert out.is_prompt and out.num_batched_tokens == 1  # only the last token
    first, second = s.get_sequences("first")[0], s.get_sequences("second")[0]
    assert second.num_cached_tokens == 12
    assert second.blocks[:3] == first.blocks[:3]
    assert len(set(first.blocks[:3])) == 3
    run_to_completion(s, r)


def test_prefix_computed_twice_in_one_step_stays_reachable():
    """Two prompts sharing a system prompt, admitted in one step, each compute it: the
    second's blocks after the shared part chain on from the first's cached blocks, so a
    rerun of the second hits all of its full blocks (not only the shared ones), every
    time."""
    s = make(num_blocks=64, block_size=BS, max_num_batched_tokens=64)
    r = FakeRunner(s)
    system = A + B
    t, u = system + [9, 9, 9, 9, 0], system + [7, 7, 7, 7, 0]
    s.add_request("t", t, 1)
    s.add_request("u", u, 1)
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["t", "u"]  # one step computes both
    s.update(out, r.execute(out))
    run_to_completion(s, r)
    for i in range(3):
        assert run_prompt(s, r, f"u{i}", u) == 12, i
    assert run_prompt(s, r, "t2", t) == 12
    s.check_invariants()


def test_blocks_registered_steps_after_a_shared_one_stay_reachable():
    """A sequence whose block another sequence cached first (same prefix, same step)
    registers its later blocks in later steps (the next chunk of its prompt, its
    generated tokens): they chain on from the cached copy, so a prompt extending it hits
    all of them, with or without the neighbour."""
    def cached(with_neighbour: bool) -> int:
        s = make(num_blocks=64, block_size=BS, max_num_batched_tokens=16)
        r = FakeRunner(s)
        if with_neighbour:
            s.add_request("a", A + B + [20, 21, 22, 23], 1)
        s.add_request("b", A + B + [30, 31, 32, 33, 34, 35, 36, 37], 1)  # cut by the budget
        run_to_completion(s, r)
        hits = run_prompt(s, r, "c", A + B + [30, 31, 32, 33, 34, 35, 36, 37, 99])
        s.check_invariants()
        return hits

    assert cached(False) == 16
    assert cached(True) == 16
