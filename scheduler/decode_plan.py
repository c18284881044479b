"""Planning a decode step: which running rows take part, the block each writes into,
and where in it (the launch batch is built from the plan).

Rows whose last token, still in flight, ends them (length) are left out. A row entering a
new block gets one, and a forked row its own copy of a shared block; when the pool runs
short the scheduler's ``reserve`` preempts (its policy), and the step runs over what is
left. A steady step, over the same rows as the last one, is derived by the rows'
``DecodeCursor`` instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from deepinfer_scheduler.decode_cursor import DecodeCursor, DecodeStep
from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.running_rows import RunningRows
from deepinfer_scheduler.sequence import Sequence
from deepinfer_scheduler.state_manager import StateManager

# reserve(seqs, rows, ending): give rows ``rows`` of ``seqs`` their next block, preempting
# when the pool is empty (``ending`` first, then the tail of ``seqs``); returns how many of
# ``seqs`` remain (a prefix).
Reserve = Callable[[list[Sequence], list[int], list[Sequence]], int]


class DecodePlanner:
    """Plans decode steps over the rows of ``kv`` and ``states``."""

    def __init__(self, kv: KVCache, states: StateManager) -> None:
        self._kv = kv
        self._states = states

    def plan(self, rows: RunningRows, reserve: Reserve
             ) -> tuple[RunningRows, np.ndarray, DecodeStep] | None:
        """The rows of this step (``rows`` or a subset), their lengths with the fed
        token (int64 [B]) and the step's slot mapping, longest length and registration
        rows; None when no row can run."""
        ntok = self._states.num_tokens[rows.slots]
        cursor = rows.cursor
        if cursor is not None:
            step = cursor.step(int(ntok[0]), rows.slots, self._kv)
            if step is not None:
                return rows, ntok, step
            rows.cursor = None
        return self._general(rows, ntok, reserve)

    def _general(self, rows: RunningRows, ntok: np.ndarray, reserve: Reserve
                 ) -> tuple[RunningRows, np.ndarray, DecodeStep] | None:
        kv = self._kv
        bs = kv.block_size
        whole = rows
        full = ntok >= rows.max_len
        ending: list[Sequence] = []
        if np.count_nonzero(full):
            # Their last token is still in flight and ends them (length): no step more.
            ending = [rows.seqs[i] for i in full.nonzero()[0].tolist()]
            keep = (~full).nonzero()[0]
            if not keep.shape[0]:
                return None
            rows, ntok = rows.take(keep.tolist()), ntok[keep]
        pos = ntok - 1
        bidx = pos // bs
        todo = kv.decode_todo(rows.slots, bidx)
        # Rows that need a new block or a copy-on-write first: all at once when the
        # pool has the blocks and none is shared, else row by row (may preempt).
        if todo and kv.grow(rows.slots, todo) is None:
            nb = reserve(rows.seqs, todo, ending)
            if nb == 0:
                return None
            if nb < len(rows):
                rows, ntok, pos, bidx = rows.head(nb), ntok[:nb], pos[:nb], bidx[:nb]
        slots = rows.slots
        offset = pos - bidx * bs
        step = DecodeStep(kv.slot_mapping(slots, bidx, offset), int(ntok.max()),
                          (offset == bs - 1).nonzero()[0].tolist(), True)
        if rows is whole and not kv.shared_tail:
            # From the second step over the same rows on, the next steps are derived.
            if rows.decode_steps and kv.holds_exactly(slots, bidx):
                rows.cursor = DecodeCursor(bs, ntok, rows.max_len, offset,
                                           step.slot_mapping)
            rows.decode_steps += 1
        return rows, ntok, step
