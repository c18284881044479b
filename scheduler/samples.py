"""Applying one step's sampled tokens: each sampled sequence grows by its token (the
``Sequence`` and its slot rows), blocks that became full and computed enter the prefix
cache, and stop tokens and length limits end sequences.

Decode steps take the vectorized path: one numpy update of the slot rows for the whole
batch, then Python work only for sequences at a block boundary or a stop candidate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from scheduler.kv_cache import KVCache
from scheduler.registry import SequenceRegistry
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.state_manager import StateManager

_RUNNING = SequenceStatus.RUNNING
_FINISHED = SequenceStatus.FINISHED


def token_list(sampled_token_ids: object) -> list[int]:
    """Sampled ids as Python ints: a list (the runner's ``.tolist()``: taken as is) or a
    1-D tensor / array, or any iterable of ints."""
    if isinstance(sampled_token_ids, list):
        return sampled_token_ids
    if isinstance(sampled_token_ids, (torch.Tensor, np.ndarray)):
        return sampled_token_ids.reshape(-1).tolist()
    return [int(t) for t in sampled_token_ids]  # type: ignore[attr-defined]


class SampleApplier:
    """``finish(seq, reason)`` ends a sequence; the caller of every method rebuilds
    ``running`` afterwards when something finished. Guarded by the scheduler's lock."""

    def __init__(self, states: StateManager, kv: KVCache, registry: SequenceRegistry,
                 caching: bool, finish: Callable[[Sequence, str], None]) -> None:
        self._states = states
        self._kv = kv
        self._registry = registry
        self._caching = caching
        self._finish = finish

    def prompt(self, seqs: list[Sequence], sample_seqs: list[Sequence],
               tokens: list[int]) -> list[Sequence]:
        """A prompt step: register the full blocks the step computed for ``seqs`` (cut
        prompts too), then append ``tokens`` to ``sample_seqs``. Returns the finished."""
        if self._caching:
            register = self._kv.register
            for seq in seqs:
                if seq.status is not _FINISHED:
                    register(seq, seq.num_computed)
        return self.each(sample_seqs, tokens, register=False)

    def each(self, seqs: list[Sequence], tokens: list[int],
             register: bool) -> list[Sequence]:
        """Per-sequence path (prompt samples, or a decode step after a concurrent abort):
        skips sequences no longer running."""
        bs = self._kv.block_size
        caching = register and self._caching
        num_tokens, last_token = self._states.num_tokens, self._states.last_token
        finished = []
        for seq, t in zip(seqs, tokens):
            if seq.status is not _RUNNING:
                continue  # aborted / finished since schedule()
            slot = seq.slot
            seq.output_token_ids.append(t)
            num_tokens[slot] += 1
            last_token[slot] = t
            if caching:
                computed = seq.num_tokens - 1
                if computed % bs == 0:
                    self._kv.register(seq, computed)
            reason = seq.stop_reason(t)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def decode(self, seqs: list[Sequence], slots: np.ndarray,
               tokens: list[int]) -> list[Sequence]:
        """Vectorized decode path: every sequence of ``seqs`` (state slots ``slots``,
        int64 [B]) is still running and gets ``tokens[i]``."""
        states = self._states
        toks = np.asarray(tokens, dtype=np.int64)
        states.num_tokens[slots] += 1
        states.last_token[slots] = toks
        for seq, t in zip(seqs, tokens):
            seq.output_token_ids.append(t)
        newlen = states.num_tokens[slots]
        if self._caching:
            register = self._kv.register
            for i in np.flatnonzero((newlen - 1) % self._kv.block_size == 0).tolist():
                register(seqs[i], int(newlen[i]) - 1)
        done = np.flatnonzero(newlen >= states.max_len[slots])
        union = self._registry.stop_ids()
        if union.size:
            cand = np.flatnonzero(np.isin(toks, union))
            if cand.size:
                done = np.union1d(done, cand)
        finished = []
        for i in done.tolist():
            seq = seqs[i]
            reason = seq.stop_reason(tokens[i])
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished
