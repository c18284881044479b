"""Property-based tests: random workloads, invariants checked after every step.

Every step also goes through ``FakeRunner``, which checks the launch tensors against the
sequences' tokens (the KV each sequence reads back, the state of each sample)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_scheduler import Scheduler, SchedulerConfig
from deepinfer_scheduler.util import cdiv
from tests.scheduler.helpers import FakeRunner


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = 40
    min_blocks = cdiv(max_model_len, bs)
    cfg = dict(
        num_blocks=draw(st.integers(min_blocks, 3 * min_blocks)),
        block_size=bs,
        max_num_seqs=draw(st.integers(3, 8)),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 40, 64])),
        max_model_len=max_model_len,
        prefill_attempt_interval=draw(st.integers(1, 3)),
        prefill_any_attempt_interval=draw(st.integers(1, 4)),
        prefill_watermark=draw(st.sampled_from([0.5, 0.9, 1.0])),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=True,
    )
    base = draw(st.lists(st.integers(0, 9), min_size=24, max_size=24))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        shared = draw(st.integers(0, 24))
        tail = draw(st.lists(st.integers(0, 9), max_size=8))
        prompt = (base[:shared] + tail) or [1]
        reqs.append(dict(
            rid=f"r{i}", prompt=prompt,
            max_tokens=draw(st.integers(1, max(1, min(10, max_model_len - len(prompt))))),
            n=draw(st.integers(1, 3)),
            stop=draw(st.lists(st.integers(0, 9), max_size=2)),
            min_tokens=draw(st.integers(0, 2)),
            arrive=draw(st.integers(0, 12)),
            abort_at=draw(st.one_of(st.none(), st.integers(0, 30))),
        ))
    return cfg, reqs, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants(w):
    cfg, reqs, seed = w
    s = Scheduler(SchedulerConfig(**cfg))
    runner = FakeRunner(s, vocab=10, seed=seed)
    rng = np.random.default_rng(seed)
    sampled: dict[int, list[int]] = {}
    ended_early: set[int] = set()  # finished by the engine, not by a stop token
    finished = {}
    added = set()
    aborted = set()
    by_id = {r["rid"]: r for r in reqs}
    for step in range(2000):
        for r in reqs:
            if r["arrive"] == step:
                s.add_request(r["rid"], r["prompt"], r["max_tokens"], n=r["n"],
                              stop_token_ids=r["stop"], min_tokens=r["min_tokens"])
                added.add(r["rid"])
            if r["abort_at"] == step and r["rid"] in added:
                if s.abort(r["rid"]):
                    aborted.add(r["rid"])
        if len(added) == len(reqs) and not s.has_unfinished():
            break
        out = s.schedule()
        b = out.batch
        assert out.num_batched_tokens <= cfg["max_num_batched_tokens"]
        assert len(out.seqs) <= cfg["max_num_seqs"]
        assert len(set(out.seq_ids)) == len(out.seq_ids)
        assert len(set(b.sample_state_slots.tolist())) == out.num_samples
        toks = runner.execute(out)
        for seq, t in zip(out.sample_seqs, toks):
            sampled.setdefault(seq.seq_id, []).append(t)
        for seq in s.update(out, toks):
            finished[seq.seq_id] = seq
        if rng.random() < 0.02 and s.running:  # the engine ends a sequence early
            victim = s.running[int(rng.integers(len(s.running)))]
            assert s.finish_sequence(victim.seq_id, "stop") is victim
            finished[victim.seq_id] = victim
            ended_early.add(victim.seq_id)
        s.check_invariants()
        assert 0.0 <= s.cache_usage() <= 1.0
    else:
        raise AssertionError("did not finish: livelock")

    assert s.cache_usage() == 0.0
    assert s.state_manager.num_free == cfg["max_num_seqs"]
    per_req: dict[str, list] = {}
    for seq in finished.values():
        per_req.setdefault(seq.request_id, []).append(seq)
    for rid, r in by_id.items():
        seqs = per_req.get(rid, [])
        if rid not in aborted:
            assert len(seqs) == r["n"], rid
        for seq in seqs:
            out_toks = seq.output_token_ids
            assert out_toks == sampled.get(seq.seq_id, [])
            assert len(out_toks) <= r["max_tokens"]
            if seq.finish_reason == "length":
                assert len(out_toks) == r["max_tokens"]
            by_stop_token = seq.seq_id not in ended_early and seq.finish_reason == "stop"
            if by_stop_token and out_toks and out_toks[-1] in r["stop"]:
                assert len(out_toks) > r["min_tokens"]
            # No stop token before min_tokens-permitted positions ended the sequence early.
            for k, t in enumerate(out_toks[:-1]):
                assert t not in r["stop"] or k + 1 <= r["min_tokens"]
