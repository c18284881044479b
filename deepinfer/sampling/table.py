"""Sampling parameters as per-slot rows, written once when a sequence gets its state slot.

vLLM's input-batch idea: rather than turning every sample's ``SamplingParams`` into
tensors at every step, each state slot holds its sequence's parameters in host numpy rows
(written at admission, copied at a fork). A step gathers the rows of its samples with one
vectorised ``take``; the fast-path flags come from those host rows, never from the device.

Seeded rows draw from a counter-based generator: the uniform of a sample at output index
``step`` is a hash of ``(seed key, step)``, computed on the host for the whole batch. The
stream depends only on the seed, the sample index and the step, so a seeded sample is the
same whatever else is in the batch, whatever the engine (a disaggregated hand-off carries
no generator state), and however steps are overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.sampling.params import GREEDY_EPS, SamplingParams

NO_SEED = -1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def seed_key(seed: int, sample_index: int) -> int:
    """The key of sample ``sample_index`` of a request seeded with ``seed``: distinct,
    reproducible streams for the ``n`` samples of one seed."""
    return (seed * 1_000_003 + sample_index) % (1 << 63)


def seeded_uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float32 ``[N]`` uniforms in (0, 1), one per ``(keys[i], steps[i])`` (int64 ``[N]``).
    24 random bits: exact in float32, never 0 or 1."""
    with np.errstate(over="ignore"):
        h = _mix64(_mix64(keys.astype(np.uint64) + _GOLDEN) + steps.astype(np.uint64))
    return ((h >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)


@dataclass
class SamplingRows:
    """The sampling parameters of N rows as host arrays (one row per sample).

    floats    float32 [6, N]  temperature (1 for greedy rows), top_p, min_p, repetition,
                              presence, frequency penalty
    top_k     int64 [N]       ``vocab`` where off
    greedy    bool [N]
    seed_key  int64 [N]       ``NO_SEED`` for unseeded rows
    logprobs  int64 [N]       -1 where not requested
    """

    floats: np.ndarray
    top_k: np.ndarray
    greedy: np.ndarray
    seed_key: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def empty(cls, n: int) -> SamplingRows:
        return cls(np.zeros((6, n), np.float32), np.zeros(n, np.int64), np.zeros(n, bool),
                   np.full(n, NO_SEED, np.int64), np.full(n, -1, np.int64))

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int,
                    sample_indices: list[int] | None = None) -> SamplingRows:
        """Rows of ``params`` (one per sample; ``sample_indices`` default 0)."""
        rows = cls.empty(len(params))
        for i, p in enumerate(params):
            rows.write(i, p, vocab_size, 0 if sample_indices is None else sample_indices[i])
        return rows

    def write(self, i: int, p: SamplingParams, vocab_size: int, sample_index: int) -> None:
        """Row ``i`` := ``p`` for sample ``sample_index`` of its request."""
        greedy = p.temperature < GREEDY_EPS
        # Greedy rows never use their temperature; 1.0 keeps the division harmless.
        self.floats[:, i] = (1.0 if greedy else p.temperature, p.top_p, p.min_p,
                             p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        self.top_k[i] = p.top_k if 0 < p.top_k < vocab_size else vocab_size
        self.greedy[i] = greedy
        self.seed_key[i] = NO_SEED if p.seed is None else seed_key(p.seed, sample_index)
        self.logprobs[i] = -1 if p.logprobs is None else p.logprobs

    def take(self, idx: np.ndarray) -> SamplingRows:
        """The rows ``idx`` (int64 ``[M]``), as a new ``SamplingRows``."""
        return SamplingRows(self.floats[:, idx], self.top_k[idx], self.greedy[idx],
                            self.seed_key[idx], self.logprobs[idx])

    def copy_row(self, src: int, dst: int) -> None:
        self.floats[:, dst] = self.floats[:, src]
        for a in (self.top_k, self.greedy, self.seed_key, self.logprobs):
            a[dst] = a[src]


class SamplingTable:
    """Per-slot ``SamplingRows`` (``num_slots`` rows) plus what ``min_tokens`` needs: the
    stop ids a slot may not sample before its ``min_tokens``-th output token."""

    def __init__(self, num_slots: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows = SamplingRows.empty(num_slots)
        self.prompt_len = np.zeros(num_slots, np.int64)
        self.min_tokens = np.zeros(num_slots, np.int64)
        self.banned: dict[int, tuple[int, ...]] = {}  # slot -> ids, while min_tokens > 0
        self.version = 0  # bumped by every write: gathered rows of an older version are stale

    def write(self, slot: int, params: SamplingParams, sample_index: int, prompt_len: int,
              stop_token_ids: tuple[int, ...]) -> None:
        """Give ``slot`` the parameters of sample ``sample_index`` of a request whose
        prompt has ``prompt_len`` tokens; ``stop_token_ids`` are banned below
        ``params.min_tokens`` outputs."""
        self.version += 1
        self.rows.write(slot, params, self.vocab_size, sample_index)
        self.prompt_len[slot] = prompt_len
        self.min_tokens[slot] = params.min_tokens
        if params.min_tokens > 0 and stop_token_ids:
            self.banned[slot] = tuple(stop_token_ids)
        else:
            self.banned.pop(slot, None)

    def gather(self, slots: np.ndarray, positions: np.ndarray
               ) -> tuple[SamplingRows, np.ndarray, list[tuple[int, ...]] | None]:
        """Rows of the samples in ``slots`` (int64 ``[N]``) whose last token sits at
        ``positions`` (int64 ``[N]``). Returns the rows, each sample's output index
        (int64 ``[N]``: the step of its seeded stream) and, when some sample is still
        below its ``min_tokens``, the banned ids per row (else None)."""
        rows = self.rows.take(slots)
        steps = positions + 1 - self.prompt_len[slots]
        banned = None
        if self.banned:
            early = self.min_tokens[slots] > steps
            if early.any():
                banned = [self.banned.get(int(s), ()) if e else ()
                          for s, e in zip(slots.tolist(), early.tolist())]
        return rows, steps, banned
