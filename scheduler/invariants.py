"""The scheduler's internal consistency, asserted (tests call
``Scheduler.check_invariants()`` after every step)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.sequence import Sequence, SequenceStatus
from deepinfer_scheduler.state_manager import StateManager

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_FINISHED = SequenceStatus.FINISHED
_TRANSFERRING = SequenceStatus.TRANSFERRING


def check_scheduler(seqs: list[Sequence], running: list[Sequence],
                    waiting: Iterable[Sequence], handoffs: Mapping[int, Sequence],
                    partial: Sequence | None, kv: KVCache, states: StateManager) -> None:
    """``seqs``: every live sequence. Block ref counts equal block-table references, free
    and referenced blocks are disjoint, slots are held exactly by the live sequences and
    their rows match them (in-flight tokens counted), queues match statuses, and only the
    cut prompt (``partial``) holds a slot while waiting."""
    waiting = list(waiting)
    for seq in seqs:
        assert seq.status is not _FINISHED
        assert seq.slot < 0 or seq.kv_cache is kv
        if seq.status in (_RUNNING, _TRANSFERRING):
            assert seq.slot >= 0
            # Blocks cover every token whose KV a scheduled step writes.
            assert len(seq.blocks) * kv.block_size >= states.num_tokens[seq.slot] - 1
        if seq.status is _RUNNING and seq.slot not in kv.shared_tail:
            # Only a fork shares the block the next decode writes into (decode_todo).
            blocks = seq.blocks
            bi = (int(states.num_tokens[seq.slot]) - 1) // kv.block_size
            assert bi >= len(blocks) or kv.pool.ref[blocks[bi]] == 1, \
                f"seq {seq.seq_id}: shared write block outside shared_tail"
    kv.check(seqs)
    states.check(seqs)
    assert len(running) + len(waiting) + len(handoffs) == len(seqs)
    assert all(s.status is _TRANSFERRING for s in handoffs.values())
    assert all(s.status is _RUNNING for s in running)
    assert all(s.status is _WAITING for s in waiting)
    held = [s for s in waiting if s.slot >= 0]
    assert len(held) <= 1 and (not held or held[0] is partial)
