"""``x @ W.T`` with W kept as GGUF blocks: the weights are decoded in registers inside the
matmul loop and never written out (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

Two kernels, chosen by the number of rows of x:

- GEMV (``M <= 16``, decode): one program per ``BLOCK_N`` weight rows and all of x's rows
  (``BLOCK_M = next_pow2(M)``); it loops over K a few groups at a time
  (``deepinfer_kernels.gguf_decode``), decodes both planes of each group to fp32 and
  accumulates ``x * w`` with fp32 FMAs, reducing over K each step. Memory-bound: the
  quantized bytes are read once, x (a few KB) stays in L1/L2.
- GEMM (``M > 16``, prefill): ``BLOCK_M x BLOCK_N`` output tiles, grouped launch order
  for L2 reuse; each K step decodes the weight tile to x's dtype (fp32 for fp32 x) and
  runs one ``tl.dot`` per plane, accumulating in fp32.

A plane's weights are not consecutive in K, so x is loaded at the plane's columns. Both
paths round to x's dtype once, at the end. The tiles come from rules (``gemv_config``,
``gemm_config``) that are not yet tuned on a GPU; tests/kernels/test_compile.py checks
that none spills or overflows shared memory on sm_80/sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.gguf_blocks import BlockFormat
from deepinfer_kernels.gguf_decode import weight_tile
from deepinfer_kernels.runtime import Launch, Target, dot_flags, next_pow2, run_launches
from deepinfer_kernels.tl_helpers import mma
from deepinfer_kernels.validation import check_gguf_matmul_args, check_runnable_device

GEMV_MAX_M = 16  # rows of x up to which the FMA kernel runs; tl.dot above


@triton.jit
def _gguf_gemv_kernel(
    x_ptr, b_ptr, out_ptr, M, N, K, n_groups,
    stride_xm, stride_xk, stride_bn, stride_om, stride_on,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, EVEN_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N - 1 (never stored): the weight loads need no mask.
    rows = tl.minimum(n, N - 1).to(tl.int64) * stride_bn
    m = tl.arange(0, BLOCK_M)
    m_ok = (m < M)[:, None]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        w_lo, w_hi, k_lo, k_hi = weight_tile(b_ptr, rows, g, n_groups, QTYPE, BLOCK_BYTES,
                                             BLOCK_N, GROUPS)
        if EVEN_G:
            mask_lo = m_ok
            mask_hi = m_ok
        else:  # groups past the row's end: x is zero there
            mask_lo = m_ok & (k_lo < K)[None, :]
            mask_hi = m_ok & (k_hi < K)[None, :]
        x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=mask_lo, other=0.0)
        x_hi = tl.load(x_rows + k_hi[None, :] * stride_xk, mask=mask_hi, other=0.0)
        acc += tl.sum(x_lo.to(tl.float32)[:, None, :] * w_lo[None, :, :], axis=2)
        acc += tl.sum(x_hi.to(tl.float32)[:, None, :] * w_hi[None, :, :], axis=2)
    out_ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (n < N)[None, :])


@triton.jit
def _gguf_gemm_kernel(
    x_ptr, b_ptr, out_ptr, M, N, K, n_groups,
    stride_xm, stride_xk, stride_bn, stride_om, stride_on,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, EVEN_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Program -> (m tile, n tile), GROUP_M m tiles at a time sweeping n, so a wave's
    # programs share x rows and weight tiles in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = (m < M)[:, None]
    rows = tl.minimum(n, N - 1).to(tl.int64) * stride_bn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        w_lo, w_hi, k_lo, k_hi = weight_tile(b_ptr, rows, g, n_groups, QTYPE, BLOCK_BYTES,
                                             BLOCK_N, GROUPS)
        if EVEN_G:
            mask_lo = m_ok
            mask_hi = m_ok
        else:
            mask_lo = m_ok & (k_lo < K)[None, :]
            mask_hi = m_ok & (k_hi < K)[None, :]
        x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=mask_lo, other=0.0)
        x_hi = tl.load(x_rows + k_hi[None, :] * stride_xk, mask=mask_hi, other=0.0)
        acc = mma(x_lo, tl.trans(w_lo.to(dtype)), acc, PRECISION, UPCAST)
        acc = mma(x_hi, tl.trans(w_hi.to(dtype)), acc, PRECISION, UPCAST)
    out_ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (n < N)[None, :])


def gemv_config(m: int, n_groups: int, target: Target) -> dict[str, int]:
    """BLOCK_M/BLOCK_N/GROUPS/warps of the GEMV for ``m <= 16`` rows of x.

    Each K step multiplies a ``[BLOCK_M, BLOCK_N, 16 GROUPS]`` product per plane over 8
    weight rows (N = 4096 gives 512 programs): 32 groups (512 weights a plane) at
    BLOCK_M 1, then 16 / BLOCK_M and at least 2 (a product of 4096 from BLOCK_M 2 to 8
    spills 8 B for Q6_K on sm_90). The interpreter takes whole small matrices in few
    programs instead (its cost is per program and per step).
    """
    block_m = next_pow2(m)
    if target.interpret:
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "GROUPS": min(next_pow2(n_groups), 32),
                "num_warps": 1, "num_stages": 1}
    groups = 32 if block_m == 1 else max(2, 16 // block_m)
    return {"BLOCK_M": block_m, "BLOCK_N": 8, "GROUPS": min(next_pow2(n_groups), groups),
            "num_warps": 4, "num_stages": 2}


def gemm_config(m: int, n_groups: int, elem_bytes: int, target: Target) -> dict[str, int]:
    """Tiles of the GEMM for ``m > 16`` rows of x (deterministic).

    16-bit x: BLOCK_M 32 / 64 / 128 by M, 3 stages, GROUP_M 8. sm_90 (wgmma reads the
    decoded tile from shared memory): N tiles of 64 (128 at BLOCK_M 128, on 8 warps), 4
    groups a step (two dots with K = 64). Before sm_90 (mma operands in registers): N
    tiles of 64, 2 groups a step, 8 warps from BLOCK_M 64 (128 x 128 tiles, or 4 groups,
    spill there). fp32 (IEEE dots on the FMA units, each thread holding whole K rows of
    both operands): one group a step (K = 16 a dot; 2 spill on sm_90), 64 x 64 tiles on
    8 warps, 32 x 64 on 4 below 33 rows.
    """
    if target.interpret:
        return {"BLOCK_M": 32 if m <= 32 else 64, "BLOCK_N": 32,
                "GROUPS": min(next_pow2(n_groups), 16), "GROUP_M": 1, "num_warps": 1,
                "num_stages": 1}
    if elem_bytes >= 4:
        block_m = 32 if m <= 32 else 64
        cfg = {"BLOCK_M": block_m, "BLOCK_N": 64, "GROUPS": 1, "GROUP_M": 8,
               "num_warps": 4 if block_m == 32 else 8, "num_stages": 2}
    else:
        block_m = 32 if m <= 32 else 64 if m <= 64 else 128
        if target.capability[0] >= 9:
            cfg = {"BLOCK_M": block_m, "BLOCK_N": 128 if block_m == 128 else 64,
                   "GROUPS": 4, "GROUP_M": 8, "num_warps": 8 if block_m == 128 else 4,
                   "num_stages": 3}
        else:
            cfg = {"BLOCK_M": block_m, "BLOCK_N": 64, "GROUPS": 2, "GROUP_M": 8,
                   "num_warps": 4 if block_m == 32 else 8, "num_stages": 3}
    cfg["GROUPS"] = min(cfg["GROUPS"], next_pow2(n_groups))
    if target.capability[0] < 8:  # no cp.async pipelining before sm_80
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    return cfg


def gguf_matmul_launches(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat,
                         out: torch.Tensor, target: Target) -> list[Launch]:
    """The launch of ``gguf_matmul`` for validated, non-empty arguments (a pure function
    of shapes, strides, dtypes and ``target``): the GEMV for ``M <= 16``, else the GEMM."""
    m, k = x.shape
    n = blocks.shape[0]
    n_groups = k // 32  # a group is two planes of 16 weights, in every format
    args = (x, blocks, out, m, n, k, n_groups, x.stride(0), x.stride(1), blocks.stride(0),
            out.stride(0), out.stride(1))
    if m <= GEMV_MAX_M:
        cfg = gemv_config(m, n_groups, target)
        kernel, grid, extra = _gguf_gemv_kernel, (triton.cdiv(n, cfg["BLOCK_N"]),), {}
    else:
        cfg = gemm_config(m, n_groups, x.element_size(), target)
        precision, upcast = dot_flags(x.dtype, target.interpret)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        kernel = _gguf_gemm_kernel
        extra = {"GROUP_M": cfg["GROUP_M"], "PRECISION": precision, "UPCAST": upcast}
    return [Launch(kernel, grid, args, dict(
        QTYPE=fmt.type_id, BLOCK_BYTES=fmt.block_bytes, EVEN_G=n_groups % cfg["GROUPS"] == 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUPS=cfg["GROUPS"], **extra,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    ))]


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for a weight ``W`` ``[N, K]`` kept as GGUF blocks, decoded in registers.

    x: ``[M, K]`` float32, bfloat16 or float16 (any strides), on CUDA (or CPU under
    ``TRITON_INTERPRET=1``).
    blocks: uint8 ``[N, row_bytes]`` on x's device, unit last stride (any row stride):
    W's rows as raw ``qtype`` blocks, ``K = row_bytes / block_bytes * block_weights``.
    qtype: ggml type id of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K (an int or
    ``gguf.GGMLQuantizationType``).
    out: optional ``[M, N]`` in x's dtype (any strides), written and returned.

    Returns ``[M, N]`` in x's dtype, accumulated in fp32 and rounded once; 16-bit x is
    multiplied by weights rounded to its dtype on the GEMM path (M > 16). Same contract
    as ``deepinfer_kernels.reference.gguf_matmul``; ``ValueError`` naming the argument
    on bad input, before any launch.
    """
    xt, b, fmt = check_gguf_matmul_args(x, blocks, qtype, out)
    device = check_runnable_device("x", xt)
    if out is None:
        out = torch.empty((xt.shape[0], b.shape[0]), dtype=xt.dtype, device=device)
    if out.numel():
        run_launches(gguf_matmul_launches(xt, b, fmt, out, Target.of(device)))
    return out
