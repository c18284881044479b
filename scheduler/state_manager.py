"""State slots: ``max_num_seqs`` rows of per-sequence device state (sampler penalties,
recurrent state, ...). A sequence holds one slot from admission to finish or preemption.

The host side of a slot is three numpy rows the decode step gathers by slot instead of
walking the sequences: the holder's token count, last token and length limit.
"""

from __future__ import annotations

import numpy as np

from scheduler.sequence import Sequence


class StateManager:
    """Free list of slot indices ``0..num_slots-1`` plus the per-slot host rows.
    Guarded by the scheduler's lock.

    ``max_live``: cap on slots held at once (the scheduler passes
    ``min(max_num_seqs, max_num_batched_tokens)`` so that every live sequence fits in
    one decode step); defaults to ``num_slots``.

    num_tokens  int64 [num_slots]  prompt + outputs of the sequence holding the slot
    last_token  int64 [num_slots]  its last token (the next decode input)
    max_len     int64 [num_slots]  prompt + max_tokens (its length limit)
    """

    def __init__(self, num_slots: int, max_live: int | None = None) -> None:
        self.num_slots = num_slots
        self.max_live = num_slots if max_live is None else min(max_live, num_slots)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots
        self.num_tokens = np.zeros(num_slots, dtype=np.int64)
        self.last_token = np.zeros(num_slots, dtype=np.int64)
        self.max_len = np.zeros(num_slots, dtype=np.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def room(self) -> int:
        """Slots a new sequence (or fork group) may still take: free ones, within
        ``max_live``."""
        return min(len(self._free), self.max_live - (self.num_slots - len(self._free)))

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("StateManager.allocate: no free slot (caller must check)")
        s = self._free.pop()
        self._used[s] = True
        return s

    def free(self, slot: int) -> None:
        if not self._used[slot]:
            raise RuntimeError(f"state slot {slot} freed twice")
        self._used[slot] = False
        self._free.append(slot)

    def is_used(self, slot: int) -> bool:
        return self._used[slot]

    # ------------------------------------------------------------------ sequences
    def bind(self, seq: Sequence) -> int:
        """Give ``seq`` a fresh slot and fill the slot's rows from it; returns the slot."""
        slot = self.allocate()
        ntok = seq.num_tokens
        seq.slot = slot
        self.num_tokens[slot] = ntok
        self.last_token[slot] = seq.token_slice(ntok - 1, ntok)[0]
        self.max_len[slot] = len(seq.prompt_token_ids) + seq.max_tokens
        return slot

    def bind_fork(self, child: Sequence, slot: int, parent_slot: int) -> None:
        """Give a forked ``child`` its reserved ``slot`` with a copy of its parent's rows."""
        child.slot = slot
        self.num_tokens[slot] = self.num_tokens[parent_slot]
        self.last_token[slot] = self.last_token[parent_slot]
        self.max_len[slot] = self.max_len[parent_slot]

    def unbind(self, seq: Sequence) -> None:
        """Free ``seq``'s slot and its reserved fork slots (rows are refilled on reuse)."""
        if seq.slot >= 0:
            self.free(seq.slot)
            seq.slot = -1
        for s in seq.reserved_slots:
            self.free(s)
        seq.reserved_slots = []

    # ------------------------------------------------------------------ checks
    def check(self, seqs: list[Sequence]) -> None:
        """Assert that the slots in use are exactly those ``seqs`` (every live sequence)
        hold, each once, and that a held slot's ``num_tokens`` row matches its holder."""
        held: set[int] = set()
        for seq in seqs:
            for s in ([seq.slot] if seq.slot >= 0 else []) + seq.reserved_slots:
                assert s not in held, f"slot {s} held twice"
                held.add(s)
            if seq.slot >= 0:
                assert self.num_tokens[seq.slot] == seq.num_tokens
        assert self.num_free == self.num_slots - len(held)
        for s in held:
            assert self.is_used(s)
