"""Small ``triton.jit`` helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.

    UPCAST works around the interpreter multiplying bf16 operands as raw bits; it is
    False for compiled kernels, which keep 16-bit operands for the tensor cores.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)
