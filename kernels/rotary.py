"""Rotary position embedding of q and k in one launch, with the per-head q/k RMSNorm that
Qwen3 applies before it fused in.

Neox style (rotate-half, as Hugging Face): with ``x = [x1, x2]`` split at ``D / 2`` and
``cos``/``sin`` the halves of the cache row at the token's position,
``out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]``. In torch that is about seven kernels
per tensor (plus eight per norm); here one program per token reads its q and k heads once
and writes them rotated. Products and sums are rounded to the model dtype where the
model's own torch ops round them, so 16-bit results match the torch path closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, next_pow2, run_launches
from deepinfer_kernels.validation import (
    FLOAT_DTYPES,
    check_positive_float,
    check_runnable_device,
    check_shape,
    check_tensor,
)


@triton.jit
def _rotate_heads(
    src, dst, w_ptr, num_heads, stride_t, stride_h, t64, cos, sin, eps,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (heads < num_heads)[:, None] & d_ok[None, :]
    base = src + t64 * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    if HAS_NORM:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        # Normalised row cast to the model dtype, then times the weight, rounded again.
        x1 = ((a * inv[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt)
        x2 = ((b * inv[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # Each product rounded to the model dtype before the sum, as the torch ops round.
    y1 = (a * c).to(dt).to(tl.float32) - (b * s).to(dt).to(tl.float32)
    y2 = (b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)
    out = dst + t64 * num_heads * (2 * HALF) + heads[:, None] * (2 * HALF) + d[None, :]
    tl.store(out, y1.to(dt), mask=mask)
    tl.store(out + HALF, y2.to(dt), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, pos_ptr, cs_ptr,
    num_q_heads, num_k_heads, max_positions, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t64 = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t64)
    # An out-of-range position reads no cache row (rotation by zero vectors): the host
    # cannot check device positions without a sync.
    pos_ok = (pos >= 0) & (pos < max_positions)
    d = tl.arange(0, BLOCK_HALF)
    row = cs_ptr + tl.where(pos_ok, pos, 0).to(tl.int64) * stride_cs
    cos = tl.load(row + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    cos = tl.where(pos_ok, cos, 0.0)
    sin = tl.where(pos_ok, sin, 0.0)
    _rotate_heads(q_ptr, q_out_ptr, qw_ptr, num_q_heads, stride_qt, stride_qh,
                  t64, cos, sin, eps, HALF, HAS_NORM, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, kw_ptr, num_k_heads, stride_kt, stride_kh,
                  t64, cos, sin, eps, HALF, HAS_NORM, BLOCK_HK, BLOCK_HALF)


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions, after a per-head RMSNorm when the norm
    weights are given (both or neither).

    q: ``[T, Hq, D]``, k: ``[T, Hkv, D]`` float of one dtype, unit stride in the last dim
    (strided views of a fused qkv projection are fine); D even. cos_sin_cache:
    ``[max_positions, D]`` (cos half, then sin half), same dtype, unit last stride.
    positions: ``[T]`` int64, each in ``[0, max_positions)``. q_norm_weight,
    k_norm_weight: ``[D]``. Returns new contiguous ``(q_out [T, Hq, D], k_out [T, Hkv, D])``
    in q's dtype.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("q", q)
    t, _, d = q.shape
    if d % 2:
        raise ValueError(f"q: expected an even head_dim, got shape {tuple(q.shape)}")
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device, last_dim_contiguous=True)
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k: expected [{t}, num_kv_heads, {d}] to match q, got shape "
                         f"{tuple(k.shape)}")
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(q.dtype,), device=device,
                 last_dim_contiguous=True)
    if cos_sin_cache.shape[0] == 0:  # an out-of-range position still loads row 0
        raise ValueError("cos_sin_cache: expected at least one position, got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache: expected [max_positions, {d}], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,), device=device,
                 contiguous=True)
    check_shape("positions", positions, (t,))
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight, k_norm_weight: expected both or neither, got "
                         f"{'q' if k_norm_weight is None else 'k'}_norm_weight alone")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(name, w, ndim=1, dtypes=FLOAT_DTYPES, device=device,
                         contiguous=True)
            check_shape(name, w, (d,))
    if q_norm_weight is not None:
        check_positive_float("eps", eps)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = torch.empty(k.shape, dtype=q.dtype, device=device)
    if t:
        run_launches(rotary_qk_launches(q, k, cos_sin_cache, positions, q_norm_weight,
                                        k_norm_weight, eps, q_out, k_out, Target.of(device)))
    return q_out, k_out


def rotary_qk_launches(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    target: Target,
) -> list[Launch]:
    """The launch of ``rotary_qk`` for validated, non-empty arguments (a pure function of
    shapes, strides, dtypes and ``target``)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    block_half = next_pow2(d // 2)
    has_norm = q_norm_weight is not None
    qw = q_norm_weight if has_norm else cos_sin_cache
    kw = k_norm_weight if has_norm else cos_sin_cache
    elems = next_pow2(hq) * block_half * 2
    return [Launch(_rotary_qk_kernel, (t,), (
        q, k, qw, kw, q_out, k_out, positions, cos_sin_cache,
        hq, hk, cos_sin_cache.shape[0], float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
    ), dict(
        HALF=d // 2, HAS_NORM=has_norm, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk),
        BLOCK_HALF=block_half, num_warps=8 if elems >= 8192 else 4,
    ))]
