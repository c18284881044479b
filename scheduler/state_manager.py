"""State slots: ``max_num_seqs`` rows of per-sequence device state (sampler penalties,
recurrent state, ...). A sequence holds one slot from admission to finish or preemption."""

from __future__ import annotations


class StateManager:
    """Free list of slot indices ``0..num_slots-1``. Guarded by the scheduler's lock."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

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
