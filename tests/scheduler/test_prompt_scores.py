"""Prompt scoring in the scheduler (``prompt_scores``): every prompt position of a
``score_prompt`` sequence is scored exactly once, in order, with the right row and target,
under chunked prefill, preemption (recompute) and n > 1; the prefix cache never serves an
unscored position."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tests.scheduler.helpers import FakeRunner, make


def _drive(sched, runner: FakeRunner) -> dict[str, list[int]]:
    """Run to completion, checking each step's scored rows against its launch batch;
    returns the positions scored per request, in scoring order."""
    scored: dict[str, list[int]] = defaultdict(list)
    for _ in range(10_000):
        if not sched.has_unfinished():
            return scored
        out = sched.schedule()
        b = out.batch
        if not out.is_prompt:
            assert out.scores is None and b.score_rows.numel() == 0
            assert b.score_targets.numel() == 0
        elif out.scores is None:
            assert b.score_rows.numel() == 0
        else:
            rows = out.scores.rows.tolist()
            assert b.score_rows.tolist() == rows
            targets = out.scores.targets.tolist()
            assert b.score_targets.tolist() == targets
            ids, pos = b.input_ids.numpy(), b.positions.numpy()
            r = 0
            for seq, first, count in out.scores.owners:
                assert seq in out.seqs
                prompt = seq.prompt_token_ids
                for j in range(count):
                    p = first + j
                    assert pos[rows[r]] == p and ids[rows[r]] == prompt[p]
                    assert targets[r] == prompt[p + 1]
                    r += 1
                scored[seq.request_id] += range(first, first + count)
            assert r == len(rows)
        sched.update(out, runner.execute(out))
        sched.check_invariants()
    raise AssertionError("scheduler did not finish")


def test_chunks_score_each_position_once():
    sched = make(max_num_batched_tokens=8)
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(0, 50, 13 + 7 * i).tolist() for i in range(3)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, 3, score_prompt=rid != "r1")
    scored = _drive(sched, FakeRunner(sched))
    assert set(scored) == {"r0", "r2"}
    for rid in scored:
        assert scored[rid] == list(range(len(prompts[rid]) - 1))


def test_the_prefix_cache_serves_no_unscored_position():
    sched = make(num_blocks=64, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    prompt = list(range(1, 30))
    sched.add_request("warm", prompt, 2)
    _drive(sched, runner)
    hits = sched.stats.prefix_cache_hits
    sched.add_request("scored", prompt, 2, score_prompt=True)
    scored = _drive(sched, runner)
    assert sched.stats.prefix_cache_hits == hits
    assert scored["scored"] == list(range(len(prompt) - 1))
    sched.add_request("again", prompt, 2)
    _drive(sched, runner)
    assert sched.stats.prefix_cache_hits > hits  # blocks of a scored prompt are cached


def test_preempted_sequences_are_not_scored_twice():
    # 14 blocks of 4 tokens for 4 sequences of 10-16 prompt tokens and 20 outputs each.
    sched = make(num_blocks=14, max_num_batched_tokens=16)
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": rng.integers(0, 50, 10 + 2 * i).tolist() for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, 20, score_prompt=True)
    scored = _drive(sched, FakeRunner(sched))
    assert sched.stats.num_preemptions > 0
    for rid, p in prompts.items():
        assert scored[rid] == list(range(len(p) - 1))


def test_forked_samples_score_the_prompt_once():
    sched = make()
    prompt = list(range(3, 20))
    sched.add_request("n3", prompt, 4, n=3, score_prompt=True)
    scored = _drive(sched, FakeRunner(sched))
    assert scored["n3"] == list(range(len(prompt) - 1))


def test_a_one_token_prompt_has_nothing_to_score():
    sched = make()
    sched.add_request("one", [7], 2, score_prompt=True)
    assert _drive(sched, FakeRunner(sched)) == {}
