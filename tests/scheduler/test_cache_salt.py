"""Prefix-cache salts: a request's blocks are shared only with requests of the same
``cache_salt`` (the engine gives each LoRA adapter its own: the same tokens hold other
K/V under another adapter), while within one salt the cache works as unsalted."""

from __future__ import annotations

from tests.scheduler.helpers import FakeRunner, make, run_to_completion

BS = 4
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks, then the last token


def run_salted(s, r, rid, salt, prompt=PROMPT):
    """Run one request alone to completion; returns its prefix-cache hit tokens."""
    s.add_request(rid, prompt, 2, cache_salt=salt)
    seq = s.get_sequences(rid)[0]
    run_to_completion(s, r)
    assert seq.finish_reason == "length"
    return seq.num_cached_tokens


def test_salts_do_not_share_blocks():
    s = make(block_size=BS)
    r = FakeRunner(s)
    assert run_salted(s, r, "plain", 0) == 0
    assert run_salted(s, r, "salt-7", 7) == 0, "a salted prompt hit the unsalted blocks"
    assert run_salted(s, r, "salt-9", 9) == 0, "one salt hit another's blocks"
    # Each salt cached its own two blocks, and each now hits only its own.
    assert s.block_pool.num_cached == 3 * 2
    assert run_salted(s, r, "plain-again", 0) == 8
    assert run_salted(s, r, "salt-7-again", 7) == 8
    assert run_salted(s, r, "salt-9-again", 9) == 8
    s.check_invariants()


def test_salted_chain_hits_block_by_block():
    """Within a salt the chain keys work as unsalted ones: a shared first block hits,
    the differing second does not."""
    s = make(block_size=BS)
    r = FakeRunner(s)
    run_salted(s, r, "first", 3)
    assert run_salted(s, r, "half", 3, PROMPT[:4] + [0, 0, 0, 0, 1]) == 4
    assert run_salted(s, r, "unsalted-half", 0, PROMPT[:4] + [0, 0, 0, 0, 1]) == 0


def test_forked_samples_keep_the_salt():
    s = make(block_size=BS)
    r = FakeRunner(s)
    s.add_request("n2", PROMPT, 3, n=2, cache_salt=5)
    out = s.schedule()
    s.update(out, r.execute(out))
    seqs = s.get_sequences("n2")
    assert len(seqs) == 2 and {q.cache_salt for q in seqs} == {5}
    run_to_completion(s, r)
    assert run_salted(s, r, "same-salt", 5) == 8
