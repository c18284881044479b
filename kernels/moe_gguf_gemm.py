"""Grouped GEMM over stacked expert weights kept as GGUF blocks: ``moe_gemm`` whose
weight tiles are decoded in registers (``gguf_decode.weight_tile``) and never written out.

``out[i] = a[i // top_k or i] @ W[expert(i)].T`` for every (token, k) pair ``i``, rows
read through ``moe_align``'s sorted ids: one program computes a ``BLOCK_M x BLOCK_N``
tile of one block of the sorted ids, all of whose rows belong to one expert, so the
expert's weight tile is decoded once per block. Each K step decodes ``GROUPS`` groups
(two planes of 16 weights each, in every block type) to a's dtype and runs one ``tl.dot``
per plane, accumulating in fp32; a is loaded at the planes' columns (a plane's weights
are not consecutive in K). ``GATED``: the gate rows ``0..N`` and the up rows ``N..2N`` of
the expert are decoded side by side and the epilogue writes ``silu(gate) * up``.
``MUL_WEIGHT``: the pair's routing weight scales its row. Padding rows (the sentinel
``num_pairs``) load zeros and are never stored; blocks past ``num_padded`` exit at once.
No host sync: the grid is a host bound from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.gguf_blocks import BlockFormat
from deepinfer_kernels.gguf_decode import weight_tile
from deepinfer_kernels.moe_gemm import moe_tile
from deepinfer_kernels.runtime import Launch, Target, dot_flags, next_pow2
from deepinfer_kernels.tl_helpers import mma


@triton.jit
def moe_gguf_gemm_kernel(
    a_ptr, b_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
    num_pairs, N, K, n_groups,
    stride_am, stride_be, stride_bn, stride_om,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    GATED: tl.constexpr, EVEN_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    live, expert, pair, row_ok, a_row, n = moe_tile(
        sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, N, TOP_K, A_PER_TOKEN,
        BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    # Rows past N decode row N - 1 (never stored): the weight loads need no mask.
    rows = tl.minimum(n, N - 1).to(tl.int64) * stride_bn
    b_expert = b_ptr + expert * stride_be
    a_rows = a_ptr + a_row.to(tl.int64)[:, None] * stride_am
    ok = row_ok[:, None]
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        w_lo, w_hi, k_lo, k_hi = weight_tile(b_expert, rows, g, n_groups, QTYPE,
                                             BLOCK_BYTES, BLOCK_N, GROUPS)
        if EVEN_G:
            mask_lo = ok
            mask_hi = ok
        else:  # groups past the row's end: a is zero there
            mask_lo = ok & (k_lo < K)[None, :]
            mask_hi = ok & (k_hi < K)[None, :]
        a_lo = tl.load(a_rows + k_lo[None, :], mask=mask_lo, other=0.0)
        a_hi = tl.load(a_rows + k_hi[None, :], mask=mask_hi, other=0.0)
        acc = mma(a_lo, tl.trans(w_lo.to(dtype)), acc, PRECISION, UPCAST)
        acc = mma(a_hi, tl.trans(w_hi.to(dtype)), acc, PRECISION, UPCAST)
        if GATED:
            u_lo, u_hi, _, _ = weight_tile(b_expert, rows + N * stride_bn, g, n_groups,
                                           QTYPE, BLOCK_BYTES, BLOCK_N, GROUPS)
            acc_up = mma(a_lo, tl.trans(u_lo.to(dtype)), acc_up, PRECISION, UPCAST)
            acc_up = mma(a_hi, tl.trans(u_hi.to(dtype)), acc_up, PRECISION, UPCAST)

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok & (n < N)[None, :])


def moe_gguf_config(block_m: int, n_groups: int, elem_bytes: int, gated: bool,
                    target: Target) -> dict[str, int]:
    """BLOCK_N/GROUPS/GROUP_M/warps/stages for a given BLOCK_M (deterministic).

    The decoded weight tile lives in registers before it feeds the dots, so the tiles are
    those of ``gguf_matmul``'s GEMM, N tiles halved where ``GATED`` decodes two: 16-bit
    a: N tiles of 64 (32 gated from BLOCK_M 64), 2 groups a step (K = 32 a dot; one at
    BLOCK_M 128 before sm_90), 4 warps (8 at BLOCK_M 128); fp32 a (IEEE dots on the FMA
    units): one group a step and N tiles of 32. tests/kernels/test_compile.py checks that
    none spills on sm_80 or sm_90.
    """
    if target.interpret:
        return {"BLOCK_N": 32, "GROUPS": min(next_pow2(n_groups), 8), "GROUP_M": 1,
                "num_warps": 1, "num_stages": 1}
    if elem_bytes >= 4:
        cfg = {"BLOCK_N": 32, "GROUPS": 1, "GROUP_M": 1 if block_m == 16 else 8,
               "num_warps": 8 if block_m >= 128 else 4, "num_stages": 2}
    else:
        # Before sm_90 the mma operands sit in registers: 128-row tiles take one group a
        # step (two spill 8-16 B on sm_80).
        groups = 1 if block_m >= 128 and target.capability[0] < 9 else 2
        cfg = {"BLOCK_N": 32 if gated and block_m >= 64 else 64, "GROUPS": groups,
               "GROUP_M": 1 if block_m == 16 else 8,
               "num_warps": 8 if block_m >= 128 else 4, "num_stages": 3}
    cfg["GROUPS"] = min(cfg["GROUPS"], next_pow2(n_groups))
    if target.capability[0] < 8:  # no cp.async pipelining before sm_80
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    return cfg


def moe_gguf_gemm_launches(
    a: torch.Tensor,
    blocks: torch.Tensor,
    fmt: BlockFormat,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
    mul_routed_weight: bool,
    gated: bool,
    target: Target,
) -> list[Launch]:
    """The launch of one grouped GEMM on GGUF blocks for validated, non-empty arguments
    (pure: shapes, strides, dtypes and ``target``). ``blocks``: uint8 ``[E, N, row_bytes]``
    (``[E, 2N, row_bytes]`` when ``gated``), contiguous; a ``[T or T*top_k, K]`` with unit
    last stride; ``block_m = len(sorted_ids) // len(block_expert)``."""
    num_pairs = out.shape[0]
    n = blocks.shape[1] // 2 if gated else blocks.shape[1]
    k = a.shape[1]
    n_groups = k // 32  # a group is two planes of 16 weights, in every format
    block_m = sorted_ids.shape[0] // block_expert.shape[0]
    cfg = moe_gguf_config(block_m, n_groups, a.element_size(), gated, target)
    precision, upcast = dot_flags(a.dtype, target.interpret)
    grid = (block_expert.shape[0] * triton.cdiv(n, cfg["BLOCK_N"]),)
    weights = topk_weights if mul_routed_weight and topk_weights is not None else out
    return [Launch(moe_gguf_gemm_kernel, grid, (
        a, blocks, out, sorted_ids, block_expert, num_padded, weights,
        num_pairs, n, k, n_groups,
        a.stride(0), blocks.stride(0), blocks.stride(1), out.stride(0),
    ), dict(
        QTYPE=fmt.type_id, BLOCK_BYTES=fmt.block_bytes,
        TOP_K=top_k, A_PER_TOKEN=a.shape[0] != num_pairs, MUL_WEIGHT=bool(mul_routed_weight),
        GATED=bool(gated), EVEN_G=n_groups % cfg["GROUPS"] == 0,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], GROUPS=cfg["GROUPS"],
        GROUP_M=cfg["GROUP_M"], PRECISION=precision, UPCAST=upcast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    ))]
