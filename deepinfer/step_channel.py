"""How the leader of a tensor-parallel group hands each step to the other ranks.

Rank 0 of the group schedules; the others only run the same forward on their shard. Per
step the leader broadcasts, over a gloo group (host memory: no device sync), one
fixed-size int64 buffer: a header, then the step's launch tensors and copy-on-write pairs
flattened; the followers rebuild a ``LaunchBatch`` from it. A gloo broadcast costs about
the same from 0.2 to 140 KiB (benchmarks/results/step-broadcast-cpu.md), so one buffer
of ``INLINE`` ints carries every decode step up to a few hundred sequences whole; a
larger step sends the rest in a second broadcast. Decode inputs still in flight
when the step was scheduled (overlapped scheduling's placeholders) are resolved on the
leader's device and broadcast over the device group, so no rank waits on the host.

Header (int64): kind, is_prompt, T, B, W, S, clone pairs, max_query_len, max_seq_len,
ids on the device, R (scored rows). Payload: input_ids [T], positions [T],
slot_mapping [T], block_tables [B*W], seq_lens [B], query_start_loc [B+1],
logits_indices [S], clone pairs [2N], score_rows [R], score_targets [R] (every rank
scores its vocabulary block of the rows a prompt step scores). Shared memory would be
cheaper still on one node (0.1-0.2x of gloo in that benchmark) but needs followers that
spin while they wait: not done yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deepinfer_scheduler.batch import LaunchBatch

_HEADER = 11
#: Ints of one broadcast (header included): 64 KiB.
INLINE = 8192
_STEP, _STOP = 1, 0


@dataclass
class FollowerStep:
    """What a follower needs of one step: the launch batch (host tensors), whether it is
    a prompt step, the copy-on-write pairs ``[N, 2]`` int64, and whether its input ids
    come from the leader's device (``StepChannel.recv_ids``)."""

    is_prompt: bool
    batch: LaunchBatch
    clone_blocks: torch.Tensor
    ids_on_device: bool


class StepChannel:
    """One end of the leader -> followers step broadcast.

    ``host_group``: a gloo group of the TP ranks; ``device_group``: the group of the
    device collectives (the same one on CPU); ``leader``: the global rank of the TP
    group's rank 0.
    """

    def __init__(self, host_group: Any, device_group: Any, leader: int) -> None:
        self.host_group = host_group
        self.device_group = device_group
        self.leader = leader
        self._buf = torch.zeros(INLINE, dtype=torch.int64)
        self._buf_np = self._buf.numpy()

    # ------------------------------------------------------------------ leader
    def send_step(self, out: Any, ids_on_device: bool) -> None:
        """Broadcast scheduler output ``out`` (its batch and clone pairs) to the
        followers."""
        b = out.batch
        bt = b.block_tables
        clone = out.clone_blocks
        buf = self._buf_np
        scored = b.score_rows
        buf[:_HEADER] = (_STEP, int(out.is_prompt), b.num_tokens, bt.shape[0], bt.shape[1],
                         b.logits_indices.shape[0], clone.shape[0], b.max_query_len,
                         b.max_seq_len, int(ids_on_device), scored.shape[0])
        parts = [b.input_ids, b.positions, b.slot_mapping, bt.reshape(-1), b.seq_lens,
                 b.query_start_loc, b.logits_indices, clone.reshape(-1), scored,
                 b.score_targets]
        n = payload_size(b.num_tokens, bt.shape[0], bt.shape[1],
                         b.logits_indices.shape[0], clone.shape[0], scored.shape[0])
        if n <= INLINE - _HEADER:  # the usual case: one broadcast
            np.concatenate([p.numpy() for p in parts], out=buf[_HEADER:_HEADER + n],
                           casting="unsafe")
            dist.broadcast(self._buf, self.leader, group=self.host_group)
            return
        dist.broadcast(self._buf, self.leader, group=self.host_group)
        payload = np.concatenate([p.numpy() for p in parts]).astype(np.int64, copy=False)
        dist.broadcast(torch.from_numpy(payload), self.leader, group=self.host_group)

    def send_ids(self, ids: torch.Tensor) -> None:
        """The step's resolved input ids ``[T]`` int64, on the leader's device."""
        dist.broadcast(ids, self.leader, group=self.device_group)

    def send_stop(self) -> None:
        """Tell the followers that the run is over."""
        self._buf_np[:_HEADER] = 0
        self._buf_np[0] = _STOP
        dist.broadcast(self._buf, self.leader, group=self.host_group)

    # ------------------------------------------------------------------ followers
    def recv(self) -> FollowerStep | None:
        """The next step from the leader, or None when the run is over."""
        dist.broadcast(self._buf, self.leader, group=self.host_group)
        header = self._buf_np[:_HEADER].tolist()
        kind, is_prompt, t, b, w, s, n_clone, max_q, max_seq, on_dev, r = header
        if kind == _STOP:
            return None
        n = payload_size(t, b, w, s, n_clone, r)
        if n <= INLINE - _HEADER:
            payload = self._buf[_HEADER:_HEADER + n].clone()  # the buffer is reused
        else:
            payload = torch.empty(n, dtype=torch.int64)
            dist.broadcast(payload, self.leader, group=self.host_group)
        batch, clone = unpack_step(payload, t, b, w, s, n_clone, max_q, max_seq, r)
        return FollowerStep(bool(is_prompt), batch, clone, bool(on_dev))

    def recv_ids(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The leader's resolved input ids ``[num_tokens]`` int64 on ``device``."""
        ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
        dist.broadcast(ids, self.leader, group=self.device_group)
        return ids


def payload_size(t: int, b: int, w: int, s: int, n_clone: int, r: int = 0) -> int:
    """Ints in the payload of a step of ``t`` tokens, ``b`` sequences, block tables ``w``
    wide, ``s`` samples, ``n_clone`` copy-on-write pairs and ``r`` scored rows."""
    return 3 * t + b * w + 2 * b + 1 + s + 2 * n_clone + 2 * r


def unpack_step(payload: torch.Tensor, t: int, b: int, w: int, s: int, n_clone: int,
                max_query_len: int, max_seq_len: int,
                r: int = 0) -> tuple[LaunchBatch, torch.Tensor]:
    """A payload (int64 ``[payload_size(...)]``, the module docstring's layout) -> the
    step's ``LaunchBatch`` (views of it, the scheduler's dtypes; no state slots: a
    follower does not sample) and its copy-on-write pairs ``[n_clone, 2]``."""
    sizes = [t, t, t, b * w, b, b + 1, s, 2 * n_clone, r, r]
    ids, pos, slots, bt, lens, qsl, li, clone, scored, targets = payload.split(sizes)
    i32 = torch.int32
    batch = LaunchBatch(
        input_ids=ids, positions=pos, slot_mapping=slots,
        block_tables=bt.to(i32).view(b, w), seq_lens=lens.to(i32),
        query_start_loc=qsl.to(i32), logits_indices=li,
        state_slots=torch.empty(0, dtype=torch.int64),
        sample_state_slots=torch.empty(0, dtype=torch.int64),
        max_query_len=max_query_len, max_seq_len=max_seq_len, num_tokens=t,
        score_rows=scored, score_targets=targets)
    return batch, clone.view(-1, 2)
