"""Data-parallel votes: one int all-reduced with MIN over the DP group."""

from __future__ import annotations

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
        self._stream: torch.cuda.Stream | None = None
        if group is not None:
            dev = torch.device("cpu")
            if device.startswith("cuda") and dist.get_backend(group) == "nccl":
                dev = torch.device(device)
                # A vote's collective waits for the stream it is issued on, and reading
                # the result syncs that stream: on the compute stream every vote would
                # wait for the step in flight (no overlap). Its own stream has no work.
                self._stream = torch.cuda.Stream(device=dev)
                with torch.cuda.stream(self._stream):  # ordered with the votes' fills
                    self._buf = torch.zeros(1, dtype=torch.int64, device=dev)
            else:
                self._buf = torch.zeros(1, dtype=torch.int64, device=dev)

    def allreduce_min(self, value: int) -> int:
        if self._buf is None:
            return value
        if self._stream is None:
            return self._reduce(value)
        with torch.cuda.stream(self._stream):
            return self._reduce(value)

    def _reduce(self, value: int) -> int:
        assert self._buf is not None
        self._buf.fill_(value)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MIN, group=self.group)
        return int(self._buf.item())
