"""The rows of a decode step: per-sequence values that stay fixed while the running list
does, gathered once and reused by every decode step until the list changes.

A decode step over B sequences needs their state slots, who holds each slot, their length
limits and the lists their tokens are appended to. Gathering those by slot costs a few
numpy calls and a walk over the sequences; at small batch those fixed costs are most of
the step. The scheduler keeps one ``RunningRows`` for its running list and builds a new
one only when the list changes (admission, finish, preemption, import).
"""

from __future__ import annotations

import numpy as np

from deepinfer_scheduler.decode_cursor import DecodeCursor
from deepinfer_scheduler.sequence import Sequence
from deepinfer_scheduler.state_manager import StateManager


class RunningRows:
    """Row i is ``seqs[i]``. Immutable once built (a subset is a new object), so that a
    step's outputs may keep it while the next step is scheduled.

    seqs      list[Sequence] (the object's own list: never mutated)
    slots     int64 [B]  state slot of each row
    owners    int64 [B]  seq id holding each slot when built (``StateManager.owner``)
    max_len   int64 [B]  length limit of each row (``StateManager.max_len``)
    outputs   list[list[int]]  each row's ``output_token_ids`` (appended to in place)

    Two fields change, for the scheduler's decode path: ``decode_steps`` (general-path
    decode steps over exactly these rows) and ``cursor`` (a ``DecodeCursor`` for the
    next step, or None).
    """

    __slots__ = ("seqs", "slots", "owners", "max_len", "outputs", "decode_steps", "cursor")

    def __init__(self, seqs: list[Sequence], slots: np.ndarray, owners: np.ndarray,
                 max_len: np.ndarray, outputs: list[list[int]]) -> None:
        self.seqs = seqs
        self.slots = slots
        self.owners = owners
        self.max_len = max_len
        self.outputs = outputs
        self.decode_steps = 0
        self.cursor: DecodeCursor | None = None

    @classmethod
    def of(cls, seqs: list[Sequence], states: StateManager) -> RunningRows:
        """Rows of ``seqs`` (each holding a slot), in order."""
        seqs = list(seqs)
        slots = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=len(seqs))
        return cls(seqs, slots, states.owner[slots], states.max_len[slots],
                   [s.output_token_ids for s in seqs])

    def __len__(self) -> int:
        return len(self.seqs)

    def take(self, rows: list[int]) -> RunningRows:
        """The rows ``rows`` (ascending indices), in that order."""
        idx = np.array(rows, dtype=np.int64)
        seqs, outputs = self.seqs, self.outputs
        return RunningRows([seqs[i] for i in rows], self.slots[idx], self.owners[idx],
                           self.max_len[idx], [outputs[i] for i in rows])

    def head(self, n: int) -> RunningRows:
        """The first ``n`` rows."""
        return RunningRows(self.seqs[:n], self.slots[:n], self.owners[:n],
                           self.max_len[:n], self.outputs[:n])
