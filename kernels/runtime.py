"""Host-side helpers shared by the Triton ops: interpreter detection, SM count, padding,
and the ``Target``/``Launch`` split between choosing a launch and running it.

Nothing here touches device data, so nothing here can cause a host-device sync.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def pad_dim(n: int, minimum: int = 16) -> int:
    """Power-of-two tile extent for a dimension of size ``n``.

    ``tl.dot`` needs every operand dimension >= 16, and ``tl.arange`` needs powers of two,
    so head sizes like 80/96 are padded to 128 and masked.
    """
    return max(minimum, next_pow2(n))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """Streaming-multiprocessor count of ``device`` (cached); a small constant off-GPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _sm_count(index)
    # Interpreter: pretend to be a tiny GPU so the split heuristic stays cheap to run.
    return 4


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability, ``(0, 0)`` off-GPU."""
    if device.type != "cuda":
        return (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


def dot_flags(dtype: torch.dtype, interpret: bool | None = None) -> tuple[str | None, bool]:
    """(``input_precision`` for ``tl.dot``, whether to upcast dot operands to fp32).

    fp32 inputs use "ieee": the default TF32 would lose ~3 decimal digits and break the
    fp32 contract. The interpreter (triton 3.9) multiplies bf16 operands as their raw
    uint16 bits, so under the interpreter bf16 operands are upcast to fp32 first; compiled
    kernels keep bf16 operands for the tensor cores. ``interpret`` defaults to
    ``interpreting()``.
    """
    if interpret is None:
        interpret = interpreting()
    precision = "ieee" if dtype == torch.float32 else None  # None: Triton's default
    upcast = interpret and dtype == torch.bfloat16
    return precision, upcast


@dataclass(frozen=True)
class Target:
    """Everything a launch configuration depends on besides shapes, strides and dtypes.

    The launchers take it explicitly (instead of asking the device) so that the same choice
    code can be run for a GPU that is not there: ``deepinfer_compile_grid.check`` (tools/)
    plans launches for sm_80/sm_90 on a CPU machine and compiles exactly what the engine
    would run.
    """

    capability: tuple[int, int]  # (0, 0) off-GPU
    num_sms: int
    interpret: bool

    @staticmethod
    def of(device: torch.device) -> Target:
        """The target the ops run on for tensors on ``device``."""
        return Target(capability(device), num_sms(device), interpreting())


@dataclass
class Launch:
    """One kernel launch, fully decided: ``kernel[grid](*args, **kwargs)``.

    ``kwargs`` holds the constexprs and the launch options (num_warps, num_stages).
    """

    kernel: Any  # a triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def run_launches(launches: list[Launch]) -> None:
    """Run planned launches in order (on the current stream)."""
    for launch in launches:
        launch()


def int_view(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Reinterpret a contiguous tensor as a flat integer tensor of the widest word that
    divides ``row_bytes`` (and the data pointer's alignment).

    Copy/zero kernels move raw bits, so they are exact for any dtype (bool, fp8, NaN
    payloads) and one compiled kernel per word size serves every dtype.
    """
    flat = t.reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat
