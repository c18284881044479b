"""State slots: ``max_num_seqs`` rows of per-sequence device state (sampler penalties,
recurrent state, ...). A sequence holds one slot from admission to finish or preemption.

The host side of a slot is a few numpy rows the decode step gathers by slot instead of
walking the sequences: the holder's token count, last token and length limit, how many of
its tokens are still in flight, and who holds it.

A scheduled sample's token is counted when the step is scheduled (``advance``: its length
and the position it writes are known then) and lands in ``update`` (``land``). Until it
lands the slot's last token is ``PLACEHOLDER``: the next step's input for that sequence is
read on the device from the sampled ids (overlapped scheduling, docs/scheduling.md).
"""

from __future__ import annotations

import numpy as np

from deepinfer_scheduler.sequence import Sequence

# Input id of a sequence whose last token is still being sampled (resolved on the device).
PLACEHOLDER = -1


class StateManager:
    """Free list of slot indices ``0..num_slots-1`` plus the per-slot host rows.
    Guarded by the scheduler's lock.

    ``max_live``: cap on slots held at once (the scheduler passes
    ``min(max_num_seqs, max_num_batched_tokens)`` so that every live sequence fits in
    one decode step); defaults to ``num_slots``.

    num_tokens  int64 [num_slots]  prompt + outputs of the sequence holding the slot,
                                   tokens still in flight included
    last_token  int64 [num_slots]  its last token (the next decode input), or PLACEHOLDER
    max_len     int64 [num_slots]  prompt + max_tokens (its length limit)
    pending     int64 [num_slots]  its sampled tokens not yet landed (0, 1 or 2)
    owner       int64 [num_slots]  seq_id of the holder, -1 when free: a step's rows whose
                                   owner changed since it was scheduled lost their sequence
    """

    def __init__(self, num_slots: int, max_live: int | None = None) -> None:
        self.num_slots = num_slots
        self.max_live = num_slots if max_live is None else min(max_live, num_slots)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots
        self.num_tokens = np.zeros(num_slots, dtype=np.int64)
        self.last_token = np.zeros(num_slots, dtype=np.int64)
        self.max_len = np.zeros(num_slots, dtype=np.int64)
        self.pending = np.zeros(num_slots, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)
        # Slots unbound so far: a step's rows cannot have changed hands while it is equal.
        self.num_unbinds = 0

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
        self.pending[slot] = 0
        self.owner[slot] = seq.seq_id
        return slot

    def bind_fork(self, child: Sequence, slot: int, parent_slot: int) -> None:
        """Give a forked ``child`` its reserved ``slot`` with a copy of its parent's rows."""
        child.slot = slot
        self.num_tokens[slot] = self.num_tokens[parent_slot]
        self.last_token[slot] = self.last_token[parent_slot]
        self.max_len[slot] = self.max_len[parent_slot]
        self.pending[slot] = self.pending[parent_slot]
        self.owner[slot] = child.seq_id

    def unbind(self, seq: Sequence) -> None:
        """Free ``seq``'s slot and its reserved fork slots (rows are refilled on reuse)."""
        if seq.slot >= 0:
            self.free(seq.slot)
            self.owner[seq.slot] = -1
            self.num_unbinds += 1
            seq.slot = -1
        for s in seq.reserved_slots:
            self.free(s)
        seq.reserved_slots = []

    # ------------------------------------------------------------------ tokens
    def advance(self, slots: np.ndarray, settled: bool = False) -> None:
        """A step samples one token for each of ``slots`` (int64 [S], distinct): count it
        now; its id is unknown until ``land``. ``settled``: no other step is in flight,
        so none of these slots has a token pending (one write instead of an add)."""
        self.num_tokens[slots] += 1
        if settled:
            self.pending[slots] = 1
        else:
            self.pending[slots] += 1
        self.last_token[slots] = PLACEHOLDER

    def land(self, slots: np.ndarray, tokens: np.ndarray | list[int], settled: bool = False
             ) -> np.ndarray:
        """The sampled ``tokens`` (int64 [S], or a list of S ints) of ``slots``
        arrived. Returns the holders' lengths with them (int64 [S]; tokens of a later
        step still in flight excluded). ``settled``: no later step is in flight, so each
        slot had exactly this token pending."""
        if settled:
            self.pending[slots] = 0
            self.last_token[slots] = tokens
            return self.num_tokens[slots]
        tokens = np.asarray(tokens, dtype=np.int64)
        pend = self.pending[slots] - 1
        self.pending[slots] = pend
        last = pend == 0
        if last.all():
            self.last_token[slots] = tokens
        else:  # a later step already took these as placeholders
            self.last_token[slots[last]] = tokens[last]
        return self.num_tokens[slots] - pend

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
                s = seq.slot
                assert self.num_tokens[s] - self.pending[s] == seq.num_tokens
                assert self.owner[s] == seq.seq_id
        assert self.num_free == self.num_slots - len(held)
        for s in held:
            assert self.is_used(s)
