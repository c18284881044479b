"""Data-parallel votes: one int all-reduced with MIN over the DP group."""

from __future__ import annotations

import contextlib
import functools
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist


class DPVoter:
    """``allreduce_min(v)`` over ``group`` (identity when ``group`` is None: no collective).

    The vote tensor lives on the GPU for an NCCL group (the engine on CUDA) and on the CPU
    for gloo. It is allocated once; every rank calls ``allreduce_min`` the same number of
    times in the same order (the scheduler's ``decode_step`` guarantees it)."""

    def __init__(self, group: dist.ProcessGroup | None, device: str = "cpu") -> None:
        self.group = group
        self._buf: torch.Tensor | None = None
        if group is not None:
            dev = torch.device("cpu")
            if device.startswith("cuda") and dist.get_backend(group) == "nccl":
                dev = torch.device(device)
            with host_collective_stream(dev):  # ordered with the votes' fills
                self._buf = torch.zeros(1, dtype=torch.int64, device=dev)

    def allreduce_min(self, value: int) -> int:
        if self._buf is None:
            return value
        with host_collective_stream(self._buf.device):
            self._buf.fill_(value)
            dist.all_reduce(self._buf, op=dist.ReduceOp.MIN, group=self.group)
            return int(self._buf.item())


def host_collective_stream(device: torch.device) -> AbstractContextManager:
    """Where to issue a collective whose result the host reads at once (votes, counts):
    on CUDA, a stream of its own. The collective waits for the stream it is issued on,
    and reading the result syncs that stream: on the compute stream each would wait for
    the step in flight (no overlapped scheduling). Elsewhere, nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(_side_stream(device))


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)
