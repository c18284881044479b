"""Disaggregated prefill/decode: a prefilled sequence leaves a PROMPT engine and enters
a COMPLETION engine (``docs/scheduling.md``, "Prefill/decode hand-off").

Export (PROMPT side): ``update()`` moves a sequence whose prompt completed and whose
first token was sampled to TRANSFERRING instead of running (a PROMPT engine never
decodes). The engine takes it (``take``), ships its tokens, KV blocks and state row, and
releases it; until then it keeps its blocks and slot.

Import (COMPLETION side): ``admit`` gives such a sequence a slot and fresh blocks for
its computed tokens and makes it running, within the credits of ``capacity``: blocks
running sequences may still claim are held back, so an imported sequence never forces
a preemption (a COMPLETION engine could not recompute the victim's prompt).
"""

from __future__ import annotations

from collections.abc import Sequence as _Seq

import numpy as np

from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.registry import SequenceRegistry
from deepinfer_scheduler.sequence import Sequence, SequenceStatus
from deepinfer_scheduler.state_manager import StateManager
from deepinfer_scheduler.util import cdiv

_RUNNING = SequenceStatus.RUNNING
_TRANSFERRING = SequenceStatus.TRANSFERRING


class Handoffs:
    """Both ends of a hand-off for one scheduler (guarded by its lock). ``pending``:
    handed-off sequences not released yet, in hand-off order."""

    def __init__(self, states: StateManager, kv: KVCache,
                 registry: SequenceRegistry) -> None:
        self._states = states
        self._kv = kv
        self._registry = registry
        self.pending: dict[int, Sequence] = {}
        self._new: list[Sequence] = []  # handed off since the last take()

    def __len__(self) -> int:
        return len(self.pending)

    # ------------------------------------------------------------------ export
    def export(self, seqs: list[Sequence]) -> bool:
        """Hand off the running ones among ``seqs`` (a prompt step's samples); whether
        any was."""
        handed = False
        for seq in seqs:
            if seq.status is _RUNNING:
                seq.status = _TRANSFERRING
                self.pending[seq.seq_id] = seq
                self._new.append(seq)
                handed = True
        return handed

    def take(self) -> list[Sequence]:
        """Sequences that entered TRANSFERRING since the last call, in order. Each keeps
        its ``blocks`` (the first ``ceil(num_computed_tokens / block_size)`` hold its
        K/V) and ``slot`` until it is released; those finished meanwhile (a stop string
        in the first token, an abort) are left out."""
        out = [s for s in self._new if s.status is _TRANSFERRING]
        self._new.clear()
        return out

    def get(self, seq_id: int) -> Sequence:
        """The pending sequence ``seq_id`` (to release once its transfer completed: its
        full blocks stay in the prefix cache, it ends with finish_reason "handoff");
        ``ValueError`` if there is none."""
        seq = self.pending.get(seq_id)
        if seq is None:
            raise ValueError(f"release_handoff: sequence {seq_id} is not handed off")
        return seq

    def discard(self, seq: Sequence) -> None:
        """Forget a pending sequence that is ending (released, stopped or aborted)."""
        del self.pending[seq.seq_id]

    # ------------------------------------------------------------------ import
    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """KV blocks a prefilled sequence may hold at most (its last sampled token is
        never fed back)."""
        return cdiv(prompt_len + max_tokens - 1, self._kv.block_size)

    def capacity(self, running_slots: np.ndarray) -> tuple[int, int]:
        """``(slots, blocks)`` an import may use: free state slots, and free blocks minus
        those the sequences in ``running_slots`` (int64 [B]) may still claim until they
        reach their length limit. Admitting only within this budget means a running
        sequence never has to be preempted."""
        owed = self._kv.owed_blocks(running_slots, self._states.max_len)
        return max(self._states.room, 0), max(self._kv.num_free - owed, 0)

    def can_accept(self, running_slots: np.ndarray, prompt_len: int,
                   max_tokens: int) -> bool:
        slots, blocks = self.capacity(running_slots)
        return slots >= 1 and blocks >= self.blocks_needed(prompt_len, max_tokens)

    def admit(self, request_id: str, prompt: list[int], outputs: list[int],
              max_tokens: int, stop_token_ids: _Seq[int], min_tokens: int) -> Sequence:
        """A running sequence for a validated import within ``capacity``: a state slot
        (not zeroed) and fresh blocks for its ``num_tokens - 1`` computed tokens, which
        the caller fills with the K/V and state row shipped from the PROMPT engine
        before the next ``schedule()``."""
        seq = Sequence(self._registry.new_id(), request_id, 0, prompt, max_tokens,
                       min_tokens=min_tokens,
                       stop_token_ids=tuple(int(t) for t in stop_token_ids),
                       kv_cache=self._kv)
        seq.output_token_ids = outputs
        computed = seq.num_tokens - 1
        slot = self._states.bind(seq)
        self._kv.allocate(slot, cdiv(computed, self._kv.block_size))
        seq.num_computed = computed
        seq.admitted = True
        seq.status = _RUNNING
        self._registry.add(seq)
        return seq
