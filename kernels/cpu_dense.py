"""Products with a plain bfloat16 weight on the CPU, read where it lies by the bf16 GEMM
of ``kernels/csrc/gguf_gemm_bf16_cpu.c`` (``dense_gemm_bf16_cpu``), for the few-row
shapes of decode.

Why: torch's bf16 ``F.linear`` carries a fixed cost per call that dominates at a few rows
(2 cores, AVX512-BF16, SmolLM2-135M shapes: 30-100 us for a 576-wide GEMV that reads
0.7-3.5 MB, against 8-30 us here, 3.4-3.9x; 1.6-2x at 8 rows). From some tens of rows
its blocked GEMM is the faster one (ours 0.8-0.9x at 128-1024 rows): those go to torch,
and where the binding holds a oneDNN-packed copy of the weight
(:mod:`deepinfer_kernels.cpu_prepacked`) everything from ``PACKED_MIN_M`` rows goes there.
Products agree with torch's to the rounding of fp32 sums and the bf16 output.

fp32 products (:func:`dense_linear`) stay torch's, with the operands swapped at a few to
a few hundred rows: ``F.linear`` hands MKL the weight as its GEMM's B operand, which it
copies into its packed layout on every call (37% of an 8-sequence fp32 decode step of the
default model on a 2-core AVX2 EPYC); as A it is streamed once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_kernels.cpu_gguf import bf16_gemm
from deepinfer_kernels.cpu_native import native_library
from deepinfer_kernels.cpu_prepacked import PackedWeight

__all__ = ["DENSE_MAX_M", "F32_SWAPPED_MAX_M", "PACKED_MIN_M", "bind_dense_matmul",
           "dense_gemm_usable", "dense_linear", "dense_matmul"]

#: Rows from which torch's GEMM takes over (measured, 2 cores, the default model's
#: shapes: ours 1.0-1.24x torch's at 32 rows, 0.84-1.0x at 128).
DENSE_MAX_M = 64
#: Rows from which a packed copy, where the binding has one, takes over (2 cores, weights
#: read from memory as in a step: even with the kernel at 8 rows, 1.16x at 12, 1.17x at
#: 64; the kernel 1.13x at one row).
PACKED_MIN_M = 8
_K_MULTIPLE = 32  # the kernel's K step: one 512-bit load of bf16
#: fp32 products of 2 to this many rows run as ``(weight @ x.T).T`` (2-core AVX2 EPYC,
#: MKL, weights read from memory: 1.1-2.2x ``F.linear`` at the default model's layers from
#: 2 to 512 rows, 1.4-3.8x at its 49152 x 576 output projection; 0.88-1.09x at 2048).
F32_SWAPPED_MAX_M = 512


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[M, K]``, weight ``[N, K]`` -> ``[M, N]``. fp32
    x and weight on the CPU with 2 to ``F32_SWAPPED_MAX_M`` rows go as
    ``(weight @ x.T).T`` (made contiguous), the same products summed in another order."""
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and 1 < x.shape[0] <= F32_SWAPPED_MAX_M and x.is_cpu and weight.is_cpu):
        y = torch.mm(weight, x.t()).t().contiguous()
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def dense_gemm_usable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (``[N, K]``) is one the kernel reads in place: bfloat16 on the
    CPU, unit last stride, K a multiple of 32, on a build with AVX512-BF16."""
    return (weight.dtype == torch.bfloat16 and weight.is_cpu and weight.dim() == 2
            and weight.shape[1] % _K_MULTIPLE == 0 and weight.shape[1] > 0
            and weight.stride(1) == 1 and weight.stride(0) >= weight.shape[1]
            and bf16_gemm())


def _product(call, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``call`` (the library's ``dense_gemm_bf16_cpu``) on checked x ``[M > 0, K]``."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16)
    rc = call(x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, weight.stride(0),
              out.data_ptr(), n, 1, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"dense_matmul: the native kernel refused (code {rc})")
    return out


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]`` bf16 (unit last stride) @ ``weight.T`` (``[N, K]``, usable as
    :func:`dense_gemm_usable` says) -> ``[M, N]`` bf16, fp32 accumulation, any M."""
    if not x.shape[0]:
        return torch.empty((0, weight.shape[0]), dtype=torch.bfloat16)
    return _product(native_library().dense_gemm_bf16_cpu, x, weight)


def bind_dense_matmul(weight: torch.Tensor, packed: PackedWeight | None = None,
                      ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``f(x)`` = ``x @ weight.T`` (x ``[M, K]`` -> ``[M, N]`` in x's dtype) that takes
    the kernel for bf16 x of fewer than ``DENSE_MAX_M`` rows and ``F.linear`` otherwise;
    None where the weight is not one the kernel reads (the layer keeps ``F.linear``).
    With ``packed`` (the weight's :class:`PackedWeight`), bf16 x of ``PACKED_MIN_M`` rows
    or more goes to that instead.

    ``weight`` is the layer's parameter: a new storage swapped into it is followed (its
    shape may not change)."""
    if not dense_gemm_usable(weight):
        return None
    call = native_library().dense_gemm_bf16_cpu
    k = weight.shape[1]
    bf16 = torch.bfloat16
    small = DENSE_MAX_M if packed is None else PACKED_MIN_M

    def matmul(x: torch.Tensor) -> torch.Tensor:
        # Plain comparisons: a decode step makes ~120 of these calls. The weight's address
        # and dtype are read per call: loading may swap a parameter's storage.
        m = x.shape[0]
        if (x.dtype != bf16 or weight.dtype != bf16 or x.dim() != 2 or x.shape[1] != k
                or not x.is_cpu):
            return F.linear(x, weight)
        if 0 < m < small and x.stride(1) == 1:
            return _product(call, x, weight)
        if packed is not None and m >= small:
            return packed.matmul(x)
        return F.linear(x, weight)

    return matmul
