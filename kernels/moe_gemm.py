"""Grouped GEMM over stacked expert weights, rows read through ``moe_align``'s sorted ids.

``out[i] = a[i // top_k or i] @ w[expert(i)].T`` for every (token, k) pair ``i``, in
place (row ``i`` of ``out``), optionally scaled by the pair's routing weight. One program
computes a ``BLOCK_M x BLOCK_N`` tile of one block of the sorted ids: all its rows belong
to one expert (``block_expert``), so the weight tile is shared by the whole block and
read once per block. Padding rows (the sentinel ``num_pairs``) load zeros and are never
stored; blocks past ``num_padded`` exit at once.

``GATED`` (the first GEMM of a SwiGLU expert): ``w`` is ``[E, 2N, K]`` with the gate
projection in rows ``0..N`` and the up projection in rows ``N..2N``; the program keeps
both accumulators and writes ``silu(gate) * up`` (``[rows, N]``), so the ``[rows, 2N]``
intermediate never goes through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, dot_flags
from deepinfer_kernels.tl_helpers import mma


@triton.jit
def moe_tile(sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, N,
             TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile of a grouped GEMM over ``moe_align``'s sorted ids: program ->
    (m block, n block), GROUP_M m blocks at a time sweeping n, so the neighbouring
    programs of a wave share a rows and weight tiles in L2. Returns ``(live, expert,
    pair, row_ok, a_row, n)``: whether the block holds rows (blocks past the device-side
    padded total do not), its expert (int64), the pairs of its rows ``[BLOCK_M]`` (the
    sentinel ``num_pairs`` on padding rows), which are real, the row of a each reads,
    and the tile's columns ``[BLOCK_N]``."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.num_programs(0) // num_n
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + r)
    row_ok = pair < num_pairs
    if A_PER_TOKEN:
        a_row = pair // TOP_K
    else:
        a_row = pair
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return live, expert, pair, row_ok, a_row, n


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    GATED: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    live, expert, pair, row_ok, a_row, n = moe_tile(
        sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, N, TOP_K, A_PER_TOKEN,
        BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = kk < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = mma(a, w, acc, PRECISION, UPCAST)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=n_ok[None, :], other=0.0)
            else:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=n_ok[None, :] & k_ok[:, None],
                               other=0.0)
            acc_up = mma(a, w_up, acc_up, PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_block_m(num_tokens: int, top_k: int, num_experts: int, target: Target) -> int:
    """BLOCK_M for a layer call (the alignment pads to it): by the mean number of pairs
    per expert. Decode-sized calls (<= 16 per expert) use 16, the smallest ``tl.dot`` M,
    so padding wastes little of what is a weight-streaming, memory-bound GEMM."""
    if target.interpret:
        return 16
    per_expert = num_tokens * top_k / max(1, num_experts)
    if per_expert <= 16:
        return 16
    if per_expert <= 48:
        return 32
    if per_expert <= 192:
        return 64
    return 128


def moe_gemm_config(block_m: int, n: int, k: int, elem_bytes: int, gated: bool,
                    target: Target, num_blocks: int = 1 << 30) -> dict[str, int]:
    """BLOCK_N/BLOCK_K/GROUP_M/warps/stages for a given BLOCK_M (deterministic).

    16-bit: decode tiles (BLOCK_M 16) read long ``[128, 64]`` weight tiles, 4 stages deep,
    so each SM keeps ~100 KB of weight loads in flight; where ``num_blocks`` (the bound
    on row blocks) x N tiles would not give every SM two programs, N tiles of 32 instead
    (Qwen3-30B-A3B decode: 8 blocks x 768 columns); prefill tiles (64/128) are
    FlashAttention-like ``128 x 128 x 64`` with 8 warps. ``GATED`` keeps two accumulators
    and loads two weight tiles, so its BLOCK_N is halved at BLOCK_M >= 64. fp32 (IEEE
    dots on the FMA units) uses 32-wide K tiles and 3 stages. tests/kernels/test_compile.py checks
    that none spills on sm_90 and that shared memory fits sm_80 and sm_90.
    """
    if target.interpret:
        return {"BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 1, "num_stages": 1}
    if elem_bytes >= 4:
        # fp32 (IEEE dots on the FMA units, operands held in registers): K tiles of 32 and
        # 3 stages; N tiles of 32 for GATED's two accumulators from BLOCK_M 32 on, and at
        # BLOCK_M 32. Other tiles spill on sm_90 (64 x 64 x 4 stages at BLOCK_M 16: 8 B;
        # 32 x 64 x 32 down tiles: 8 B with Triton 3.6; 64 x 32 x 32 down tiles: 40 B with
        # Triton 3.9, where 64 x 64 does not). The compile check runs them all.
        narrow = block_m == 32 or (gated and block_m > 32)
        cfg = {"BLOCK_N": 32 if narrow else 64, "BLOCK_K": 32,
               "GROUP_M": 1 if block_m == 16 else 8, "num_warps": 8 if block_m >= 128 else 4,
               "num_stages": 3}
    elif block_m == 16:
        narrow = num_blocks * triton.cdiv(n, 64) < 2 * target.num_sms
        cfg = {"BLOCK_N": 32 if narrow else 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
               "num_stages": 4}
    elif block_m == 32:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 4}
    elif block_m == 64:
        cfg = {"BLOCK_N": 64 if gated else 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
               "num_stages": 4}
    else:
        cfg = {"BLOCK_N": 64 if gated else 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
               "num_stages": 3}
    if target.capability[0] < 8:  # no cp.async pipelining before sm_80
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    return cfg


def moe_gemm_launches(
    a: torch.Tensor,
    w: torch.Tensor,
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
    """The launch of ``fused_moe_gemm`` for validated, non-empty arguments (pure: shapes,
    strides, dtypes and ``target``). ``block_m = len(sorted_ids) // len(block_expert)``."""
    num_pairs = out.shape[0]
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    block_m = sorted_ids.shape[0] // block_expert.shape[0]
    cfg = moe_gemm_config(block_m, n, k, a.element_size(), gated, target,
                          block_expert.shape[0])
    precision, upcast = dot_flags(a.dtype, target.interpret)
    grid = (block_expert.shape[0] * triton.cdiv(n, cfg["BLOCK_N"]),)
    weights = topk_weights if mul_routed_weight and topk_weights is not None else out
    return [Launch(moe_gemm_kernel, grid, (
        a, w, out, sorted_ids, block_expert, num_padded, weights,
        num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
    ), dict(
        TOP_K=top_k, A_PER_TOKEN=a.shape[0] != num_pairs, MUL_WEIGHT=bool(mul_routed_weight),
        GATED=bool(gated), EVEN_K=k % cfg["BLOCK_K"] == 0,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], PRECISION=precision, UPCAST=upcast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    ))]
