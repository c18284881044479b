"""Paged decode attention: one new query per sequence against its cached keys.

Decode is memory-bound, so the kernel is organised around reading each K/V byte once:
one program per (sequence, kv head[, KV split]) loads the whole GQA group of query heads
as the M side of a ``tl.dot`` (``[GROUP_PAD, D] x [D, BLOCK_N]``). When
``batch * kv_heads`` cannot fill the GPU, the key range is split (flash-decoding) and a
second small kernel merges the partial results by log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer_kernels.kv_quant import is_int8_cache
from deepinfer_kernels.runtime import (
    Launch,
    Target,
    dot_flags,
    next_pow2,
    num_sms,
    pad_dim,
    run_launches,
)
from deepinfer_kernels.tl_helpers import load_kv, mma
from deepinfer_kernels.validation import (
    NO_WINDOW,
    check_attention_common,
    check_optional_int,
    check_out,
    check_scale,
    check_softcap,
    check_window,
)

LOG2E = 1.4426950408889634
_MAX_SPLITS = 64  # the merge kernel's [splits, D] register tile


@triton.jit
def softcap_scores(x, cap_scale):
    """``tanh(x) * cap_scale``: soft-capped scores in the exp2 domain, for ``x`` a scaled
    score over the cap and ``cap_scale`` the cap times log2(e) (``score_scales``).

    No libdevice call, so it runs under the interpreter and on any CUDA Triton: tanh from
    ``exp(-2|x|)`` (in (0, 1], never overflows) and the sign put back after. Below
    |x| = 1/8 that loses relative precision (1 - e cancels; a cap far above the scores
    would blur them), so there an odd Taylor polynomial takes over, whose first dropped
    term is under 1e-9 of it: about 4e-7 relative error everywhere.
    """
    a = tl.abs(x)
    e = tl.exp2(a * -2.885390081777927)  # exp(-2|x|): 2 * log2(e)
    x2 = x * x
    small = a + a * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                                                       + x2 * -0.05396825396825397))
    t = tl.where(a < 0.125, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t) * cap_scale


def score_scales(sm_scale: float, softcap: float | None) -> tuple[float, float]:
    """The kernels' ``(qk_scale, cap_scale)``. Uncapped, a score times ``qk_scale`` is its
    exp2-domain value and ``cap_scale`` is unused; capped, it is ``softcap_scores``'s
    argument ``s / softcap`` and ``cap_scale`` the cap in the exp2 domain."""
    if softcap is None:
        return sm_scale * LOG2E, 1.0
    return sm_scale / softcap, softcap * LOG2E


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_ptr, lse_ptr,
    qk_scale, cap_scale, window,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_btb,
    stride_ob, stride_oh,
    stride_pb, stride_ps, stride_ph,  # partials [B, S, Hq, D_PAD]
    stride_lb, stride_ls,  # lse [B, S, Hq], log2 domain
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, KV_INT8: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    seq_len = tl.load(seq_lens_ptr + b)
    # A sliding window: the query (at seq_len - 1) sees its last `window` keys.
    lo = tl.maximum(seq_len - window, 0)
    if SPLIT:
        # Each sequence spreads its own keys over the splits (whole key tiles each), read
        # on the device: the launch's length bound (a CUDA graph's is max_model_len) only
        # sets how many splits there are, so a short context still uses all of them.
        split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, tl.num_programs(2)), BLOCK_N),
                               1) * BLOCK_N
        start = lo + s * split_len
        end = tl.minimum(seq_len, start + split_len)
    else:
        start = lo
        end = seq_len

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = kvh * stride_ch
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        # Per-token address through the block table: works for any block size vs BLOCK_N
        # (each token row of one head is HEAD_DIM contiguous elements).
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + head_off
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = load_kv(kc_ptr, row, d, n_ok, kv_mask, HEAD_DIM, D_PAD, KV_INT8, q.dtype)
        scores = mma(q, tl.trans(k), tl.zeros([GROUP_PAD, BLOCK_N], tl.float32),
                     PRECISION, UPCAST) * qk_scale
        if SOFTCAP:  # before the mask: masked keys stay -inf
            scores = softcap_scores(scores, cap_scale)
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(vc_ptr, row, d, n_ok, kv_mask, HEAD_DIM, D_PAD, KV_INT8, q.dtype)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new

    # Empty ranges (a split past the end, or seq_len == 0) leave l_i == 0: emit zeros and
    # lse = -inf so the merge gives them weight 0.
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        base = b.to(tl.int64) * stride_pb + s * stride_ps
        tl.store(part_ptr + base + heads[:, None] * stride_ph + d[None, :], o,
                 mask=g_ok[:, None] & (d < D_PAD)[None, :])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + s * stride_ls + heads, lse, mask=g_ok)
    else:
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr,
    num_splits,
    stride_pb, stride_ps, stride_ph,
    stride_lb, stride_ls,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + s * stride_ls + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): avoid inf - inf
    w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
    part = tl.load(part_ptr + b.to(tl.int64) * stride_pb + s[:, None] * stride_ps
                   + h * stride_ph + d[None, :], mask=s_ok[:, None], other=0.0)
    w_sum = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
             o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _decode_config(head_dim_pad: int, elem_bytes: int, target: Target,
                   kv_int8: bool = False) -> dict[str, int]:
    """Tile size and launch parameters (deterministic; sized by hand for H100/H200).

    Decode streams K/V once, so the goal is enough bytes in flight per SM: a tile of keys
    per step, pipelined 3 deep, as wide as the register file allows without spilling (64
    keys of 128-byte rows, 32 of 256-byte rows, else 16). tests/kernels/test_compile.py
    checks that none of these spills on sm_80 or sm_90.
    """
    if target.interpret:
        return {"BLOCK_N": 32, "num_warps": 1, "num_stages": 1}
    row_bytes = head_dim_pad * elem_bytes
    # Register budget (sm_90 compile, cuobjdump -res-usage): 64 keys of 256-byte rows
    # spill at d=128 16-bit; 32 do not. fp32 d=128 needs 16.
    block_n = 64 if row_bytes <= 128 else 32 if row_bytes <= 256 else 16
    stage_bytes = 2 * block_n * row_bytes  # one K tile + one V tile
    stages = 3 if target.capability[0] >= 8 and 3 * stage_bytes <= 100_000 else 2
    if kv_int8 and elem_bytes >= 4 and head_dim_pad >= 128:
        # fp32 over an int8 cache: dequantizing the 16-key tiles spilled 136-3,400 B at 4
        # warps on sm_80 and sm_90; 8 warps use 182-184 registers at d=128 (3 stages) and
        # 64-72 at d=256, where 2 stages still spilled (192 B).
        return {"BLOCK_N": block_n, "num_warps": 8,
                "num_stages": stages if head_dim_pad == 128 else 1}
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": stages}


def choose_num_splits(batch: int, num_kv_heads: int, bound: int, block_n: int,
                      sms: int | torch.device) -> int:
    """How many KV splits to use so that ``batch * kv_heads * splits`` fills the GPU.

    No splitting once the unsplit grid already covers every SM; otherwise aim for about two
    programs per SM, with at least four key tiles per split so the merge stays cheap.
    ``sms``: the SM count (or a device to ask).
    """
    programs = batch * num_kv_heads
    if isinstance(sms, torch.device):
        sms = num_sms(sms)
    if programs >= sms or bound <= 0:
        return 1
    by_length = max(1, bound // (4 * block_n))
    return max(1, min(math.ceil(2 * sms / programs), by_length, _MAX_SPLITS))


def decode_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    num_splits: int | None,
    max_seq_len: int | None,
    target: Target,
    window: int | None = None,
    softcap: float | None = None,
) -> list[Launch]:
    """The launches of ``paged_decode_attention`` for validated, non-empty arguments.

    A pure function of shapes, strides, dtypes, the host hints and ``target`` (the split
    buffers are allocated on q's device, so meta tensors plan without any GPU), shared by
    the op and by ``deepinfer_compile_grid.check`` (tools/).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    bound = capacity if max_seq_len is None else min(max_seq_len, capacity)
    if window is not None:  # no sequence reads more keys than its window
        bound = min(bound, window)
    group = num_q_heads // num_kv_heads
    d_pad = pad_dim(head_dim)
    kv_int8 = is_int8_cache(k_cache)
    cfg = _decode_config(d_pad, q.element_size(), target, kv_int8)
    block_n = cfg["BLOCK_N"]
    # The merge keeps a [splits, D] fp32 tile in registers: 64 splits at most.
    splits = min(num_splits, _MAX_SPLITS) if num_splits is not None else choose_num_splits(
        batch, num_kv_heads, bound, block_n, target.num_sms)
    precision, upcast = dot_flags(q.dtype, target.interpret)
    common = dict(
        GROUP=group, GROUP_PAD=pad_dim(group), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, KV_INT8=kv_int8,
        PRECISION=precision, UPCAST=upcast, SOFTCAP=softcap is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    scales = score_scales(sm_scale, softcap)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if splits == 1:
        return [Launch(_decode_kernel, (batch, num_kv_heads, 1), (
            q, k_cache, v_cache, block_tables, seq_lens,
            out, out, out,
            *scales, NO_WINDOW if window is None else window,
            q.stride(0), q.stride(1), *cache_strides, block_tables.stride(0),
            out.stride(0), out.stride(1),
            0, 0, 0, 0, 0,
        ), dict(SPLIT=False, **common))]

    part = torch.empty((batch, splits, num_q_heads, d_pad), dtype=torch.float32,
                       device=q.device)
    lse = torch.empty((batch, splits, num_q_heads), dtype=torch.float32, device=q.device)
    return [
        Launch(_decode_kernel, (batch, num_kv_heads, splits), (
            q, k_cache, v_cache, block_tables, seq_lens,
            out, part, lse,
            *scales, NO_WINDOW if window is None else window,
            q.stride(0), q.stride(1), *cache_strides, block_tables.stride(0),
            out.stride(0), out.stride(1),
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        ), dict(SPLIT=True, **common)),
        Launch(_merge_kernel, (batch, num_q_heads), (
            part, lse, out, splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
        ), dict(HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=next_pow2(splits),
                num_warps=1 if target.interpret else 4)),
    ]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence attends to its ``seq_lens[b]`` cached keys (paged cache;
    its last ``window`` with a sliding window; each scaled score ``s`` taken as
    ``softcap * tanh(s / softcap)`` with a ``softcap``, Gemma 2's logit soft-capping).

    q: ``[B, Hq, D]`` fp32/fp16/bf16 (unit last stride); k_cache, v_cache:
    ``[num_blocks, block_size, Hkv, D]`` same dtype as q, contiguous, or int8
    ``[..., D * 9 / 8]`` (:mod:`deepinfer_kernels.kv_quant`; rows dequantized to q's
    dtype before each ``tl.dot``); block_tables:
    ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32. q head h reads kv head
    ``h // (Hq // Hkv)``. Returns ``[B, Hq, D]`` (``out`` when given, else q's dtype).

    ``num_splits`` forces the number of KV splits (1 = unsplit, at most 64); by default it
    is chosen from the GPU's SM count. ``max_seq_len`` is an optional host-int upper bound on
    ``seq_lens`` used to choose how many splits (default: ``max_blocks * block_size``);
    each sequence then spreads its own ``seq_lens[b]`` keys over them, read on the device:
    seq_lens itself is never read on the host. Nor are the table's values: the caller guarantees
    ``seq_lens[b] <= max_blocks * block_size`` and valid block ids in the first
    ``cdiv(seq_lens[b], block_size)`` entries of row b (the scheduler's tables are; a host
    check would be a sync per step).
    """
    q, k_cache, v_cache, block_tables, seq_lens = check_attention_common(
        q, k_cache, v_cache, block_tables, seq_lens)
    if q.shape[0] != seq_lens.shape[0]:  # the grid is q's rows: each reads its own row
        raise ValueError(f"q: expected {seq_lens.shape[0]} rows (one per seq_lens entry), "
                         f"got {q.shape[0]}")
    sm_scale = check_scale(scale, q.shape[2])
    forced = check_optional_int("num_splits", num_splits, 1)
    hint = check_optional_int("max_seq_len", max_seq_len, 0)
    window, softcap = check_window(window), check_softcap(softcap)
    out = torch.empty_like(q) if out is None else check_out(out, q)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    run_launches(decode_launches(q, k_cache, v_cache, block_tables, seq_lens, out, sm_scale,
                                 forced, hint, Target.of(q.device), window, softcap))
    return out
