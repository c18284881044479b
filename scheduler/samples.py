"""Applying one step's sampled tokens: each sampled sequence grows by its token (the
``Sequence`` and its slot rows), blocks that became full and computed enter the prefix
cache, and stop tokens and length limits end sequences.

Decode steps take the vectorized path: one numpy update of the slot rows for the whole
batch, then Python work only for sequences at a block boundary or a stop candidate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.registry import SequenceRegistry
from deepinfer_scheduler.running_rows import RunningRows
from deepinfer_scheduler.sequence import Sequence, SequenceStatus
from deepinfer_scheduler.state_manager import StateManager

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
    ``running`` afterwards when something finished. Guarded by the scheduler's lock.

    A step's tokens may land after the next step was scheduled (overlapped scheduling).
    By then a sequence of the step may have finished (abort, stop string, a stop token of
    the step before): its token is dropped and listed in ``dropped``; or it may have been
    preempted: the token is kept (it was sampled from valid state) and recomputed with
    the rest when the sequence is admitted again."""

    def __init__(self, states: StateManager, kv: KVCache, registry: SequenceRegistry,
                 caching: bool, finish: Callable[[Sequence, str], None]) -> None:
        self._states = states
        self._kv = kv
        self._registry = registry
        self._caching = caching
        self._finish = finish
        self.dropped: list[Sequence] = []  # of the last call: tokens not applied

    def prompt(self, seqs: list[Sequence], sample_seqs: list[Sequence],
               tokens: list[int]) -> list[Sequence]:
        """A prompt step: register the full blocks the step computed for ``seqs`` (cut
        prompts too), then append ``tokens`` to ``sample_seqs``. Returns the finished."""
        self.dropped = []
        if self._caching:
            live = [seq for seq in seqs if seq.status is not _FINISHED]
            self._kv.register(live, [seq.num_computed for seq in live])
        return self._each(sample_seqs, tokens)

    def _each(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Per-sequence path (prompt samples, or decode rows whose sequence ended or was
        preempted after the step was scheduled): running rows land in one ``land``; the
        tokens of finished sequences go to ``dropped``. (The blocks a prompt step filled
        are registered by ``prompt``; the other rows hold no slot.)"""
        live = [i for i, seq in enumerate(seqs) if seq.status is _RUNNING]
        if live:
            self._states.land(np.fromiter((seqs[i].slot for i in live), np.int64, len(live)),
                              np.fromiter((tokens[i] for i in live), np.int64, len(live)))
        finished = []
        for seq, t in zip(seqs, tokens):
            if seq.status is _FINISHED:
                self.dropped.append(seq)
                continue
            seq.output_token_ids.append(t)
            reason = seq.stop_reason(t)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def decode(self, rows: RunningRows, tokens: list[int], *, moved: bool = True,
               settled: bool = False, filled: list[int] | None = None,
               may_end: bool = True) -> list[Sequence]:
        """Vectorized decode path: row i of ``rows`` gets ``tokens[i]``. ``moved``: some
        row's slot may have changed hands since the step was scheduled (those rows go
        through ``_each``); ``settled``: no later step is in flight
        (``StateManager.land``); ``filled``: the rows whose block the token fills (None:
        found from the new lengths); ``may_end``: False when no row can reach its length
        limit with this token."""
        self.dropped = []
        states = self._states
        finished: list[Sequence] = []
        if moved:
            gone = (states.owner[rows.slots] != rows.owners).nonzero()[0].tolist()
            if gone:
                seqs = rows.seqs
                finished = self._each([seqs[i] for i in gone], [tokens[i] for i in gone])
                keep = sorted(set(range(len(seqs))).difference(gone))
                if not keep:
                    return finished
                rows, tokens = rows.take(keep), [tokens[i] for i in keep]
                filled, may_end = None, True  # row indices moved
        newlen = states.land(rows.slots, tokens, settled)
        # One C-level loop over the rows' output lists.
        deque(map(list.append, rows.outputs, tokens), 0)
        seqs = rows.seqs
        if self._caching:
            if filled is None:  # rows whose block is full and computed once it lands
                filled = ((newlen - 1) % self._kv.block_size == 0).nonzero()[0].tolist()
            if filled:
                self._kv.register([seqs[i] for i in filled],
                                  [int(newlen[i]) - 1 for i in filled])
        ends = (newlen >= rows.max_len).nonzero()[0].tolist() if may_end else []
        stops = self._registry.stop_set()
        # A C-level scan of the ids first: most steps sample no stop token.
        if stops and (next(iter(stops)) in tokens if len(stops) == 1
                      else not stops.isdisjoint(tokens)):
            ends = sorted(set(ends).union(i for i, t in enumerate(tokens) if t in stops))
        for i in ends:
            seq = seqs[i]
            reason = seq.stop_reason(tokens[i])
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished
