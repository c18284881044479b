"""Steady decode: a decode step over the same running rows as the step before derives its
launch values from that step instead of recomputing them.

Between two decode steps over the same rows, every row advanced by exactly one token. So
each position and length grew by one, each KV slot moved one place along its block, and a
row needs a new block (or fills one) every ``block_size`` steps, at a phase fixed per row.
The cursor keeps the last step's slot mapping and each row's offset in its block then;
a step costs one add over the rows plus scalar work for the rows at a block boundary,
where the general path costs a dozen gathers and reductions.

The cursor is only valid while nothing but decode steps over these rows touched them; the
scheduler drops it whenever the running list changes, and ``step`` refuses (returns
None) whenever its assumptions do not hold, so that the general path runs instead.
"""

from __future__ import annotations

import numpy as np

from deepinfer_scheduler.kv_cache import KVCache


class DecodeStep:
    """What a cursor derives for one decode step over its rows.

    slot_mapping  int64 [B]  KV slot each row writes (the cursor's own array: valid
                  until its next step)
    max_len       longest row length with the fed token (``max_seq_len``)
    filled        rows whose block this step's token fills (registered when it lands)
    may_end       whether some row may reach its length limit with this step's token
    """

    __slots__ = ("slot_mapping", "max_len", "filled", "may_end")

    def __init__(self, slot_mapping: np.ndarray, max_len: int, filled: list[int],
                 may_end: bool) -> None:
        self.slot_mapping = slot_mapping
        self.max_len = max_len
        self.filled = filled
        self.may_end = may_end


class DecodeCursor:
    """Built from a decode step that ran over rows ``slots`` (int64 [B]) with lengths
    ``ntok`` (int64 [B], the fed token counted), length limits ``max_len`` (int64 [B]),
    in-block offsets ``offset`` (int64 [B], ``(ntok - 1) % block_size``) and slot
    mapping ``slot_mapping`` (int64 [B]; copied)."""

    __slots__ = ("_bs", "_steps", "_next_first", "_room", "_max_ntok", "_offset",
                 "_by_offset", "_slot_mapping")

    def __init__(self, block_size: int, ntok: np.ndarray, max_len: np.ndarray,
                 offset: np.ndarray, slot_mapping: np.ndarray) -> None:
        self._bs = block_size
        self._steps = 0
        self._next_first = int(ntok[0]) + 1  # row 0's length at the next step
        # Steps until the first row reaches its length limit (that step is not steady).
        self._room = int((max_len - ntok).min())
        self._max_ntok = int(ntok.max())
        self._offset = offset
        self._by_offset: dict[int, list[int]] = {}
        self._slot_mapping = slot_mapping.copy()

    def _rows_at(self, offset: int) -> list[int]:
        """Rows whose in-block offset was ``offset`` when the cursor was built."""
        rows = self._by_offset.get(offset)
        if rows is None:
            rows = self._by_offset[offset] = (self._offset == offset).nonzero()[0].tolist()
        return rows

    def step(self, first_ntok: int, slots: np.ndarray, kv: KVCache) -> DecodeStep | None:
        """The next decode step over the rows ``slots``, whose row 0 now has
        ``first_ntok`` tokens: rows entering a new block get it (``KVCache.grow``).
        None, with nothing changed, when the step is not a steady one: the rows moved
        otherwise, a row reaches its length limit, or a block cannot simply be added."""
        if first_ntok != self._next_first:
            return None
        t = self._steps + 1
        if t >= self._room:
            return None
        bs = self._bs
        # Row i is at offset (offset_i + t) % bs now: 0 means its first write in a block.
        entering = self._rows_at(-t % bs)
        sm = self._slot_mapping
        if entering:
            blocks = kv.grow(slots, entering)
            if blocks is None:
                return None
            sm += 1
            for i, b in zip(entering, blocks):
                sm[i] = b * bs
        else:
            sm += 1
        self._steps = t
        self._next_first += 1
        return DecodeStep(sm, self._max_ntok + t, self._rows_at((bs - 1 - t) % bs),
                          t + 1 >= self._room)
