"""Test helpers: a fake model runner that checks every step's launch tensors against
the sequences' tokens, and driver loops (plain, and overlapped: step k+1 scheduled and
run before step k's tokens reach the scheduler)."""

from __future__ import annotations

import zlib

import numpy as np

from deepinfer_scheduler import Scheduler, SchedulerConfig, SchedulerOutputs


def make(num_blocks: int = 64, **kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, **kw))


def tokens_of(seq) -> list[int]:
    return list(seq.prompt_token_ids) + list(seq.output_token_ids)


class FakeRunner:
    """Plays the model runner on a fake KV cache holding token ids (one int per slot)
    and fake per-slot states holding the tokens the runner recorded (penalty state). It
    applies a step in the runner's order and asserts that:

    - every scheduled sequence reads back, through its block table, exactly its tokens
      ``0..seq_len-1`` (prefix-cache hits, chunks, forks and COW copies included);
    - every sample's state slot holds exactly that sequence's tokens;
    - decode rows feed each sequence's last token at its last position, and never one
      whose sample would exceed the sequence's length limit.

    Placeholder input ids (a token still in flight) are resolved from the runner's own
    ``last_sampled`` by state slot, as the device does; the checks then compare against
    the slot's recorded history (the sequence's tokens plus at most one in flight).
    ``by_history``: each sampled token is a hash of its sequence's tokens so far, so the
    outputs do not depend on how steps were batched or overlapped.
    """

    def __init__(self, sched: Scheduler, vocab: int = 50, seed: int = 0,
                 by_history: bool = False) -> None:
        c = sched.config
        self.bs = c.block_size
        self.kv = np.full(c.num_blocks * c.block_size, -1, dtype=np.int64)
        self.state: dict[int, list[int] | None] = {}
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.by_history = by_history
        self.last_sampled = np.full(c.max_num_seqs, -1, dtype=np.int64)

    def execute(self, out: SchedulerOutputs) -> list[int]:
        b = out.batch
        bs = self.bs
        t = out.num_batched_tokens
        nb = len(out.seqs)
        assert b.input_ids.shape == (t,) and b.positions.shape == (t,)
        assert b.slot_mapping.shape == (t,)
        assert b.seq_lens.shape == (nb,) and b.query_start_loc.shape == (nb + 1,)
        assert b.block_tables.shape[0] == nb and b.state_slots.shape == (nb,)
        assert b.logits_indices.shape == (out.num_samples,)
        assert b.sample_state_slots.shape == (out.num_samples,)
        assert len(out.sample_seqs) == out.num_samples and len(out.seq_ids) == nb
        assert [s.seq_id for s in out.seqs] == out.seq_ids
        for src, dst in out.clone_blocks.tolist():
            self.kv[dst * bs:(dst + 1) * bs] = self.kv[src * bs:(src + 1) * bs]
        fresh = set(out.zero_states.tolist())
        for s in fresh:
            self.state[s] = []
        ids = b.input_ids.numpy().copy()
        ph = np.flatnonzero(ids < 0)
        if ph.size:
            assert not out.is_prompt, "placeholders only in decode steps"
            ids[ph] = self.last_sampled[b.state_slots.numpy()[ph]]
        qsl = b.query_start_loc.tolist()
        slots = b.state_slots.tolist()
        # As the engine does: a new (or recomputed) sequence's state records its whole
        # prompt + earlier outputs, then every sampled token.
        for i, seq in enumerate(out.seqs):
            if slots[i] in fresh:
                self.state[slots[i]] = tokens_of(seq)
        for p, c in out.clone_states.tolist():
            self.state[c] = list(self.state[p])
        sm = b.slot_mapping.numpy()
        self.kv[sm] = ids
        tables = b.block_tables.numpy()
        lens = b.seq_lens.tolist()
        pos = b.positions.numpy()
        for i, seq in enumerate(out.seqs):
            toks = self.history(seq, slots[i])
            n = lens[i]
            q = qsl[i + 1] - qsl[i]
            assert pos[qsl[i]:qsl[i + 1]].tolist() == list(range(n - q, n))
            p = np.arange(n)
            got = self.kv[tables[i, p // bs].astype(np.int64) * bs + p % bs]
            assert got.tolist() == toks[:n], f"seq {seq.seq_id}: KV mismatch"
            if not out.is_prompt:
                assert n == len(toks) and ids[i] == toks[-1]
                # A row never samples past its length limit (its last token is in flight).
                assert n < len(seq.prompt_token_ids) + seq.max_tokens, \
                    f"seq {seq.seq_id}: decoded at its length limit"
        li = b.logits_indices.tolist()
        sample_slots = b.sample_state_slots.tolist()
        for k, seq in enumerate(out.sample_seqs):
            st = self.state[sample_slots[k]]
            assert st == self.history(seq, sample_slots[k]), f"seq {seq.seq_id}: state"
            # The sampled row is the last fed token of that sequence.
            assert ids[li[k]] == st[-1]
        if self.by_history:
            toks = [zlib.crc32(np.asarray(self.state[s], dtype=np.int64).tobytes())
                    % self.vocab for s in sample_slots]
        else:
            toks = self.sample(out.num_samples)
        for k, tok in enumerate(toks):
            self.state[sample_slots[k]].append(tok)
            self.last_sampled[sample_slots[k]] = tok
        return toks

    def history(self, seq, slot: int) -> list[int]:
        """The tokens ``seq`` has on the device: its own, plus the one still in flight
        (recorded in its slot's state when sampled) if its step was not updated yet."""
        toks = tokens_of(seq)
        st = self.state.get(slot)
        if st is not None and len(st) == len(toks) + 1 and st[:-1] == toks:
            return st
        return toks


    def sample(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()


def check_named_sequences(out: SchedulerOutputs) -> None:
    """The sequences a step names agree with its launch tensors: ``admitted`` with
    ``zero_states`` and ``forked`` with ``clone_states`` (children, and their parents'
    slots), same order. Call right after ``schedule()``: an abort since frees slots."""
    assert isinstance(out.admitted, tuple) and isinstance(out.forked, tuple)
    assert [s.slot for s in out.admitted] == out.zero_states.tolist()
    pairs = out.clone_states.tolist()
    assert [s.slot for s in out.forked] == [c for _, c in pairs]
    if not out.is_prompt:
        assert not out.admitted and not out.forked, "decode steps admit and fork nothing"
    batch = {s.seq_id for s in out.seqs}
    assert all(s.seq_id in batch for s in out.admitted)
    parents = {s.request_id: s for s in out.sample_seqs if s.sample_index == 0}
    samples = {s.seq_id for s in out.sample_seqs}
    for child, (p, _) in zip(out.forked, pairs):
        assert child.sample_index > 0 and child.seq_id in samples
        assert parents[child.request_id].slot == p


def run_to_completion(sched: Scheduler, runner: FakeRunner | None = None,
                      max_steps: int = 10_000, check: bool = True):
    """Drive schedule/execute/update until nothing is left; returns (finished, steps)."""
    runner = runner or FakeRunner(sched)
    finished = []
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished, steps
        out = sched.schedule()
        check_named_sequences(out)
        steps.append(out.is_prompt)
        toks = runner.execute(out)
        finished += sched.update(out, toks)
        if check:
            sched.check_invariants()
    raise AssertionError("scheduler did not finish (livelock?)")


def run_overlapped(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000,
                   check: bool = True):
    """As ``run_to_completion``, but step k+1 is scheduled and executed before step k's
    tokens are applied (the engine's overlapped loop). Returns (finished, steps)."""
    finished = []
    steps = []
    inflight = None
    for _ in range(max_steps):
        more = sched.has_unfinished()
        if not more and inflight is None:
            return finished, steps
        nxt = None
        if more:
            out = sched.schedule()
            check_named_sequences(out)
            steps.append(out.is_prompt)
            nxt = (out, runner.execute(out))
        if inflight is not None:
            finished += sched.update(*inflight)
            if check:
                sched.check_invariants()
        inflight = nxt
    raise AssertionError("scheduler did not finish (livelock?)")


def checked_step(sched: Scheduler, runner: FakeRunner):
    """One schedule -> execute -> update, then the scheduler's invariants; returns
    ``(outputs, finished)``."""
    out = sched.schedule()
    check_named_sequences(out)
    fin = sched.update(out, runner.execute(out))
    sched.check_invariants()
    return out, fin


def hits_of(sched: Scheduler, runner: FakeRunner, rid: str, prompt: list[int],
            max_tokens: int = 2) -> int:
    """Run ``prompt`` (and everything else still live) to completion; its prefix-cache
    hit tokens at admission. It must end by length (``max_tokens`` generated)."""
    sched.add_request(rid, prompt, max_tokens)
    seq = sched.get_sequences(rid)[0]
    run_to_completion(sched, runner)
    assert seq.finish_reason == "length"
    return seq.num_cached_tokens
