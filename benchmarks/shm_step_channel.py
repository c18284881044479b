"""A leader -> followers step channel over shared memory (``ShmStepChannel``, the
prototype ``bench_step_broadcast.py`` measures against gloo's ``StepChannel``) and
``AckFence``, its ack protocol without the data.

``ShmStepChannel`` works over one ``multiprocessing.shared_memory`` segment.
Synchronization: the leader waits until every follower's ack counter equals the
step counter (the previous step has been copied out: the buffer is free), writes the
header and the payload (the same int64 layout as StepChannel's, concatenated straight
into the segment), then stores step counter + 1. Each follower spin-polls the step
counter (``os.sched_yield()`` between polls, what ``time.sleep(0)`` is meant to do),
copies header and payload out, rebuilds the ``LaunchBatch`` exactly as
``StepChannel.recv`` does, and stores the counter into its own ack slot (one 64-byte
line per follower). Counters are aligned int64 stores from numpy: ordered for the
reader on x86-64 (TSO), which is what this machine and GPU hosts are; a weakly ordered
CPU (aarch64) would need fences (or an atomic op in C) around the counter.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from deepinfer.step_channel import payload_size, unpack_step
from deepinfer_scheduler.batch import LaunchBatch

HEADER_WORDS = 10  # StepChannel's header: kind, is_prompt, T, B, W, S, N, max_q, max_seq, dev
_LINE = 8          # int64 words per cache line: one line per counter
MAX_FOLLOWERS = 7  # ack lines in a segment
TIMEOUT_S = 30.0   # a wait (spin loop, gloo op) longer than this reports a hang


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: one clock for every process of the machine, so stamps taken
    in different ranks compare directly."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass
class ShmStep:
    """A step as a follower receives it (what ``StepChannel.recv`` returns)."""

    is_prompt: bool
    batch: LaunchBatch
    clone_blocks: torch.Tensor


class ShmStepChannel:
    """One end of a leader -> followers step channel over a shared-memory segment.

    Layout (int64 words): the step counter on line 0, follower f's ack counter on line
    1 + f, then the 10-word header (StepChannel's), then the payload (StepChannel's
    layout). See the module docstring for the synchronization.
    """

    def __init__(self, shm: shared_memory.SharedMemory, followers: int,
                 follower: int | None = None) -> None:
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        self._shm = shm
        self.followers = followers
        self.follower = follower  # None on the leader
        self._seq = words[0:1]
        self._acks = words[_LINE: _LINE * (1 + followers): _LINE]
        off = _LINE * (1 + MAX_FOLLOWERS)
        self._header = words[off: off + HEADER_WORDS]
        self._payload = words[off + HEADER_WORDS:]
        self._last = 0  # the segment starts zeroed; a follower that attaches late must
        # still wait for step 1, not for whatever step the counter shows by then

    @staticmethod
    def nbytes(max_payload_words: int) -> int:
        """The segment's size for steps of up to ``max_payload_words`` payload words."""
        return 8 * (_LINE * (1 + MAX_FOLLOWERS) + HEADER_WORDS + max_payload_words)

    def _spin(self, done: Any) -> None:
        n = 0
        while not done():
            os.sched_yield()
            n += 1
            if n % 4096 == 0 and now_ns() - self._spin_start > TIMEOUT_S * 1e9:
                raise TimeoutError(f"shm channel: no progress in {TIMEOUT_S:.0f} s")

    # ---------------------------------------------------------------- leader
    def wait_acks(self) -> None:
        """Block until every follower has copied out the last step (the buffer is free)."""
        seq, acks = self._last, self._acks
        self._spin_start = now_ns()
        self._spin(lambda: bool((acks == seq).all()))

    def send_step(self, out: Any, ids_on_device: bool = False) -> None:
        """Write ``out`` (acks already awaited, ``wait_acks``) and publish it."""
        b = out.batch
        bt = b.block_tables
        clone = out.clone_blocks
        self._header[:] = (1, int(out.is_prompt), b.num_tokens, bt.shape[0], bt.shape[1],
                           b.logits_indices.shape[0], clone.shape[0], b.max_query_len,
                           b.max_seq_len, int(ids_on_device))
        parts = [b.input_ids, b.positions, b.slot_mapping, bt.reshape(-1), b.seq_lens,
                 b.query_start_loc, b.logits_indices, clone.reshape(-1)]
        arrays = [p.numpy() for p in parts]
        n = sum(a.shape[0] for a in arrays)
        np.concatenate(arrays, out=self._payload[:n])
        self._last += 1
        self._seq[0] = self._last  # publish: payload stores precede this one (x86 TSO)

    def send_stop(self) -> None:
        """Tell the followers the run is over (their ``recv`` returns None)."""
        self._header[0] = 0
        self._last += 1
        self._seq[0] = self._last

    # ---------------------------------------------------------------- followers
    def recv(self) -> ShmStep | None:
        """The next step (copied out of the segment), or None when the run is over. The
        caller acks it with ``ack()`` once it no longer needs the segment."""
        seq, last = self._seq, self._last
        self._spin_start = now_ns()
        self._spin(lambda: int(seq[0]) != last)
        self._last = int(seq[0])
        kind, is_prompt, t, b, w, s, n_clone, max_q, max_seq, _ = self._header.tolist()
        if kind == 0:
            return None
        n = payload_size(t, b, w, s, n_clone)
        payload = torch.from_numpy(self._payload[:n].copy())
        batch, clone = unpack_step(payload, t, b, w, s, n_clone, max_q, max_seq)
        return ShmStep(bool(is_prompt), batch, clone)

    def ack(self) -> None:
        """Follower: done with the last step received (the leader may overwrite it)."""
        assert self.follower is not None
        self._acks[self.follower] = self._last


class AckFence:
    """What separates the gloo channel's steps in this benchmark: the shm channel's ack
    protocol without the data. Follower f stores "steps done" into its own line; the
    leader spin-waits (``os.sched_yield()``) until every follower's count reaches its
    own before it starts the next step. Same separation as the shm channel's, cheaper
    than a gloo barrier, and outside the timed window."""

    def __init__(self, shm: shared_memory.SharedMemory, followers: int) -> None:
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        self._acks = words[_LINE: _LINE * (1 + followers): _LINE]
        self.done = 0

    @staticmethod
    def nbytes() -> int:
        """The fence segment's size."""
        return 8 * _LINE * (1 + MAX_FOLLOWERS)

    def wait(self) -> None:
        """Leader: block until every follower has finished the leader's last step."""
        acks, done, start, n = self._acks, self.done, now_ns(), 0
        while not bool((acks >= done).all()):
            os.sched_yield()
            n += 1
            if n % 4096 == 0 and now_ns() - start > TIMEOUT_S * 1e9:
                raise TimeoutError(f"ack fence: no progress in {TIMEOUT_S:.0f} s")
        self.done += 1

    def ack(self, follower: int) -> None:
        """Follower ``follower``: one more step done."""
        self.done += 1
        self._acks[follower] = self.done
