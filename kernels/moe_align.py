"""Mixture-of-experts alignment: group the (token, k) pairs by expert and pad every group
to the grouped GEMM's BLOCK_M, on the device, without a host sync.

Pair ``i`` is row ``i`` of ``topk_ids.view(-1)`` (token ``i // top_k``, choice
``i % top_k``). The result, for ``P = moe_align_size(T * top_k, E, block_m)`` (a host
upper bound on the padded total, from shapes only):

- ``sorted_ids [P]`` int32: expert 0's pairs in ascending pair order, padded with the
  sentinel ``T * top_k`` up to a multiple of ``block_m``, then expert 1's, ... then the
  sentinel up to ``P``. Experts with no pair take no room.
- ``block_expert [P // block_m]`` int32: the expert of each block of ``block_m`` rows;
  -1 for blocks past the padded total.
- ``num_padded [1]`` int32: the padded total (a multiple of ``block_m``, <= P).

Three launches, a stable counting sort: (1) per chunk of CHUNK pairs, a one-hot
histogram over the experts; (2) one program: per-expert totals, padded group starts
(cumsum), each chunk's write offset per expert, ``block_expert``, ``num_padded``, and the
sentinel fill; (3) per chunk, each pair's rank among the chunk's earlier pairs of its
expert (a CHUNK x CHUNK compare), and the scatter. Ids outside ``[0, E)`` are dropped
(the host cannot check values without a sync), so no write ever goes out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, next_pow2, run_launches
from deepinfer_kernels.validation import check_moe_align_args


def moe_align_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host upper bound ``P`` on the padded total: every expert that gets a pair (at most
    ``min(E, pairs)`` of them) pads by at most ``block_m - 1``; rounded to ``block_m``."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts,
                  CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
    hits = (ids[:, None] == e[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * num_experts + e, tl.sum(hits, 0), mask=e < num_experts)


@triton.jit
def _offsets_kernel(
    counts_ptr, offsets_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_chunks, num_experts, num_pairs, num_rows, num_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CB: tl.constexpr, BB: tl.constexpr,
    FILL: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    e_ok = e < num_experts
    total = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, CB):
        c = c0 + tl.arange(0, CB)
        m = (c < num_chunks)[:, None] & e_ok[None, :]
        total += tl.sum(tl.load(counts_ptr + c[:, None] * num_experts + e[None, :],
                                mask=m, other=0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    padded_total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, padded_total)

    # Where each chunk writes its pairs of expert e: the group start plus the pairs of e
    # in earlier chunks.
    running = ends - padded
    for c0 in range(0, num_chunks, CB):
        c = c0 + tl.arange(0, CB)
        m = (c < num_chunks)[:, None] & e_ok[None, :]
        cnt = tl.load(counts_ptr + c[:, None] * num_experts + e[None, :], mask=m, other=0)
        before = tl.cumsum(cnt, 0) - cnt
        tl.store(offsets_ptr + c[:, None] * num_experts + e[None, :],
                 running[None, :] + before, mask=m)
        running += tl.sum(cnt, 0)

    # Block b starts at row b * BLOCK_M and belongs to the expert whose group holds that
    # row: the number of groups that end at or before it (empty groups end where the
    # previous one does, so they are skipped).
    for b0 in range(0, num_blocks, BB):
        b = b0 + tl.arange(0, BB)
        row = b * BLOCK_M
        expert = tl.sum(((ends[None, :] <= row[:, None]) & e_ok[None, :]).to(tl.int32), 1)
        expert = tl.where(row < padded_total, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)

    for r0 in range(0, num_rows, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + r, tl.full([FILL], 0, tl.int32) + num_pairs, mask=r < num_rows)


@triton.jit
def _scatter_kernel(ids_ptr, offsets_ptr, sorted_ptr, num_pairs, num_experts,
                    CHUNK: tl.constexpr):
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    i = c * CHUNK + j
    ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
    ok = (i < num_pairs) & (ids >= 0) & (ids < num_experts)
    earlier = (ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)
    base = tl.load(offsets_ptr + c * num_experts + ids, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, i, mask=ok)


def align_launches(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    target: Target,
) -> list[Launch]:
    """The three launches of ``moe_align`` for validated, non-empty arguments (pure:
    shapes and ``target``; the scratch buffers are allocated on topk_ids' device, so meta
    tensors plan without a GPU)."""
    num_pairs = topk_ids.numel()
    e_pad = next_pow2(max(num_experts, 16))
    # CHUNK x E_PAD one-hot and CHUNK x CHUNK rank tiles: ~8K elements on a GPU.
    chunk = 16 if target.interpret else max(16, min(64, 8192 // e_pad))
    num_chunks = triton.cdiv(num_pairs, chunk)
    counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=topk_ids.device)
    offsets = torch.empty_like(counts)
    warps = 1 if target.interpret else 4
    flat = topk_ids.view(-1)
    cb = max(1, min(next_pow2(num_chunks), 4096 // e_pad))
    bb = max(1, min(next_pow2(block_expert.numel()), 4096 // e_pad))
    return [
        Launch(_count_kernel, (num_chunks,), (flat, counts, num_pairs, num_experts),
               dict(CHUNK=chunk, E_PAD=e_pad, num_warps=warps)),
        Launch(_offsets_kernel, (1,), (
            counts, offsets, sorted_ids, block_expert, num_padded,
            num_chunks, num_experts, num_pairs, sorted_ids.numel(), block_expert.numel(),
        ), dict(BLOCK_M=block_m, E_PAD=e_pad, CB=cb, BB=bb, FILL=1024,
                num_warps=warps)),
        Launch(_scatter_kernel, (num_chunks,), (flat, offsets, sorted_ids, num_pairs,
                                                num_experts),
               dict(CHUNK=chunk, num_warps=warps)),
    ]


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs of ``topk_ids`` by expert, each group padded to
    ``block_m`` rows (see the module docstring for the layout).

    topk_ids: ``[T, top_k]`` int32, contiguous, values in ``[0, num_experts)``.
    block_m: the grouped GEMM's BLOCK_M, a power of two >= 16.
    Returns ``(sorted_ids [P] int32, block_expert [P // block_m] int32, num_padded [1]
    int32)`` with ``P = moe_align_size(T * top_k, num_experts, block_m)``.
    """
    ids = check_moe_align_args(topk_ids, num_experts, block_m)
    size = moe_align_size(ids.numel(), num_experts, block_m)
    device = ids.device
    sorted_ids = torch.empty((size,), dtype=torch.int32, device=device)
    block_expert = torch.empty((size // block_m,), dtype=torch.int32, device=device)
    num_padded = torch.zeros((1,), dtype=torch.int32, device=device)
    if ids.numel() == 0:
        return sorted_ids, block_expert, num_padded
    run_launches(align_launches(ids, num_experts, block_m, sorted_ids, block_expert,
                                num_padded, Target.of(device)))
    return sorted_ids, block_expert, num_padded
