"""Scatter this step's K/V into the paged cache (float, or int8 codes and scales: see
:mod:`deepinfer_kernels.kv_quant`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.kv_quant import KV_GROUP, is_int8_cache
from deepinfer_kernels.runtime import Launch, Target, next_pow2, run_launches
from deepinfer_kernels.validation import (
    FLOAT_DTYPES,
    check_cache_rows,
    check_kv_caches,
    check_runnable_device,
    check_shape,
    check_tensor,
)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    num_tokens, num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    # One program moves BLOCK_T tokens x (all kv heads * head_dim) elements; the flattened
    # (head, dim) axis is one vector so small heads still give full-width accesses.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_HD)
    h = j // HEAD_DIM
    d = j % HEAD_DIM
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1)
    # Negative slots are padding; out-of-range slots are dropped rather than written
    # out of bounds (the host cannot check them without a sync).
    keep = t_ok & (slot >= 0) & (slot < num_slots)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    mask = keep[:, None] & (j < NUM_HEADS * HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    src_k = k_ptr + t64[:, None] * stride_kt + (h * stride_kh + d)[None, :]
    src_v = v_ptr + t64[:, None] * stride_vt + (h * stride_vh + d)[None, :]
    dst = (blk * stride_cb + off * stride_cs)[:, None] + (h * stride_ch + d)[None, :]
    kv = tl.load(src_k, mask=mask)
    tl.store(kc_ptr + dst, kv.to(kc_ptr.dtype.element_ty), mask=mask)
    vv = tl.load(src_v, mask=mask)
    tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


# 1.5 * 2**23: adding and then subtracting it rounds an fp32 of size < 2**22 to an integer,
# ties to even, as torch.round (the interpreter has no libdevice.rint).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _quantize_rows(src, cache_ptr, dst_row, col, g, keep, g_ok, HEAD_DIM: tl.constexpr):
    """Quantize ``[T, G, 32]`` values at ``src`` into int8 rows at byte ``dst_row[t]``:
    codes at ``col``, then an fp32 scale per group (max |x| / 127; NaN if the group holds
    one), as ``kv_quant.quantize_kv`` does, bit for bit (IEEE divisions, ties to even)."""
    mask = keep[:, None, None] & g_ok[None, :, None]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    has_nan = tl.max((x != x).to(tl.int32), 2) > 0  # tl.max drops NaNs: test for them
    scale = tl.where(has_nan, float("nan"), tl.math.div_rn(tl.max(tl.abs(x), 2), 127.0))
    live = (scale > 0)[:, :, None]
    codes = tl.math.div_rn(x, tl.where(live, scale[:, :, None], 1.0))
    codes = tl.where(live & (codes == codes), codes, 0.0)  # inf / inf: 0, as nan_to_num
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
    codes = (codes + _ROUND_MAGIC) - _ROUND_MAGIC
    tl.store(cache_ptr + dst_row[:, None, None] + col[None, :, :], codes.to(tl.int8),
             mask=mask)
    # Row offsets are multiples of 4 (rows are D * 9 / 8 bytes, D a multiple of 32).
    scales = (cache_ptr + dst_row + HEAD_DIM).to(tl.pointer_type(tl.float32))
    tl.store(scales[:, None] + g[None, :], scale, mask=keep[:, None] & g_ok[None, :])


@triton.jit
def _store_kv_int8_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    num_tokens, num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUPS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One program quantizes BLOCK_T tokens of one KV head, as [tokens, groups, 32] tiles.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    g = tl.arange(0, GROUPS_PAD)
    col = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    g_ok = g < HEAD_DIM // 32
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1)
    keep = t_ok & (slot >= 0) & (slot < num_slots)  # as _store_kv_kernel: no writes past
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch
    t64 = t.to(tl.int64)
    _quantize_rows(k_ptr + (t64 * stride_kt + h * stride_kh)[:, None, None] + col[None, :, :],
                   kc_ptr, dst, col, g, keep, g_ok, HEAD_DIM)
    _quantize_rows(v_ptr + (t64 * stride_vt + h * stride_vh)[:, None, None] + col[None, :, :],
                   vc_ptr, dst, col, g, keep, g_ok, HEAD_DIM)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V at cache slot ``slot_mapping[t]`` (``block * block_size + offset``).

    k, v: ``[T, Hkv, D]`` float (any of fp32/fp16/bf16; cast to the cache dtype), unit
    stride in the last dim. k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``,
    contiguous; or int8 ``[..., D * 9 / 8]`` (``D`` a multiple of 32), where each row is
    quantized as :func:`deepinfer_kernels.kv_quant.quantize_kv` does, bit for bit.
    slot_mapping: ``[T]`` int64; a negative slot is skipped (padding).
    """
    kt = check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("k", kt)
    vt = check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                      last_dim_contiguous=True)
    check_shape("v", vt, kt.shape)
    kc, vc = check_kv_caches(k_cache, v_cache, device)
    if kc.shape[2] != kt.shape[1]:
        raise ValueError(
            f"k_cache: expected [num_blocks, block_size, {kt.shape[1]}, ...] to match k's "
            f"heads, got shape {tuple(kc.shape)}"
        )
    check_cache_rows(kc, kt.shape[2])
    sm = check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,),
                      device=device, contiguous=True)
    check_shape("slot_mapping", sm, (kt.shape[0],))
    if kt.shape[0] == 0 or kc.numel() == 0:
        return
    run_launches(store_kv_launches(kt, vt, kc, vc, sm, Target.of(device)))


def store_kv_launches(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    target: Target,
) -> list[Launch]:
    """The launch of ``store_kv`` for validated, non-empty arguments (a pure function of
    shapes, strides, dtypes and ``target``; ``deepinfer_compile_grid.check`` (tools/) plans
    with it too)."""
    num_tokens, num_heads, head_dim = k.shape
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if is_int8_cache(k_cache):
        groups_pad = next_pow2(head_dim // KV_GROUP)
        per_program = 16384 if target.interpret else 2048
        block_t = max(1, min(next_pow2(num_tokens), per_program // (groups_pad * KV_GROUP)))
        grid = (triton.cdiv(num_tokens, block_t), num_heads)
        return [Launch(_store_kv_int8_kernel, grid, (
            k, v, k_cache, v_cache, slot_mapping,
            num_tokens, k_cache.shape[0] * k_cache.shape[1],
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_strides,
        ), dict(BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, GROUPS_PAD=groups_pad,
                BLOCK_T=block_t, num_warps=4))]
    block_hd = next_pow2(num_heads * head_dim)
    # ~4K elements per program on GPU; the interpreter prefers fewer, larger programs.
    per_program = 16384 if target.interpret else 4096
    block_t = max(1, min(next_pow2(num_tokens), per_program // block_hd))
    grid = (triton.cdiv(num_tokens, block_t),)
    return [Launch(_store_kv_kernel, grid, (
        k, v, k_cache, v_cache, slot_mapping,
        num_tokens, k_cache.shape[0] * k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_strides,
    ), dict(
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, NUM_HEADS=num_heads,
        BLOCK_T=block_t, BLOCK_HD=block_hd,
        num_warps=4,
    ))]
