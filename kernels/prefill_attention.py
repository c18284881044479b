"""Paged prefill attention: causal FlashAttention-2 style tiles over a paged KV cache.

Each program owns BLOCK_M consecutive new queries of one sequence and one query head and
walks the keys 0..(its last query position) in BLOCK_N tiles read through the block table,
with fp32 accumulators and an online softmax in the exp2 domain. Key tiles that every query
of the tile can see run without a mask; only the tiles crossing the causal diagonal pay
for it, and tiles past the diagonal are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The soft cap is defined once, with the decode kernel, for both.
from deepinfer_kernels.decode_attention import score_scales, softcap_scores
from deepinfer_kernels.kv_quant import is_int8_cache
from deepinfer_kernels.runtime import Launch, Target, dot_flags, pad_dim, run_launches
from deepinfer_kernels.tl_helpers import load_kv, mma
from deepinfer_kernels.validation import (
    NO_WINDOW,
    check_attention_common,
    check_optional_int,
    check_out,
    check_scale,
    check_softcap,
    check_tensor,
    check_window,
    fail,
)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos,
    kc_ptr, vc_ptr, bt_row, head_off, d, d_ok,
    lo, hi, seq_len, qk_scale, cap_scale, window,
    stride_cb, stride_cs,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, KV_INT8: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Fold key tiles [lo, hi) into the running (acc, l, m); CAUSAL adds the diagonal mask
    and the sliding window's (query p sees keys p - window + 1 .. p); SOFTCAP soft-caps
    the scores (``score_scales`` gives ``qk_scale`` and ``cap_scale``)."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len  # all true in an unmasked tile (lo/hi keep it below seq_len)
        if CAUSAL:
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            kv_mask = n_ok[:, None] & d_ok[None, :]
        else:
            blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_ok[None, :]
        row = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + head_off
        k = load_kv(kc_ptr, row, d, n_ok, kv_mask, HEAD_DIM, D_PAD, KV_INT8, q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                PRECISION, UPCAST) * qk_scale
        if SOFTCAP:  # before the mask: masked keys stay -inf
            s = softcap_scores(s, cap_scale)
        if CAUSAL:
            visible = ((n[None, :] <= q_pos[:, None]) & n_ok[None, :]
                       & (n[None, :] > q_pos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; use 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(vc_ptr, row, d, n_ok, kv_mask, HEAD_DIM, D_PAD, KV_INT8, q.dtype)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    qk_scale, cap_scale, window,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_INT8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    m_tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        prefix = seq_len - q_len
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < q_len
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        tok = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = prefix + m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        head_off = (h // GROUP) * stride_ch

        # Keys below [win_lo, full_end) are visible to every query of the tile, causally.
        full_end = ((prefix + m0 + 1) // BLOCK_N) * BLOCK_N
        # Keys past the tile's last query (or the sequence) are never visited.
        diag_end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        # A sliding window: no query sees keys below win_lo; every query sees those from
        # win_full (its last query's window start) on. No window: both are 0.
        win_lo = (tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        win_full = tl.maximum(
            tl.cdiv(tl.maximum(prefix + m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, win_lo)
        open_lo = tl.minimum(win_full, full_end)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, head_off, d, d_ok,
            win_lo, open_lo, seq_len, qk_scale, cap_scale, window, stride_cb, stride_cs,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, True, KV_INT8,
            PRECISION, UPCAST, SOFTCAP)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, head_off, d, d_ok,
            open_lo, full_end, seq_len, qk_scale, cap_scale, window, stride_cb, stride_cs,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, False, KV_INT8,
            PRECISION, UPCAST, SOFTCAP)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, head_off, d, d_ok,
            full_end, diag_end, seq_len, qk_scale, cap_scale, window, stride_cb, stride_cs,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, True, KV_INT8,
            PRECISION, UPCAST, SOFTCAP)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# Compiled tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages) by (element bytes, padded
# head_dim), chosen so that nothing spills on sm_80 or sm_90 (Triton 3.6 and 3.9, ptxas
# stack frame 0; tests/kernels/test_compile.py checks every configuration the engine uses).
# 16-bit keeps tensor-core tiles (BLOCK_M >= 64: wgmma on sm_90, mma.sync on sm_80); wider
# heads trade BLOCK_M or warps for the fp32 accumulator ([BLOCK_M, D] / threads registers).
# fp32 ("ieee" dot, no tensor cores) holds whole K rows of each operand per thread, so its
# tiles are much smaller; it is a test dtype, rarely served.
_PREFILL_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    # Registers as sm_90 / sm_80 (Triton 3.9; 3.6 within a few, except where noted).
    # 128x32 x 4 warps: 168-174 / 254 (ptxas fills the file on sm_80; no stack).
    (2, 64): (128, 32, 4, 3),
    # 128x64 spills at d=128 (255 registers + stack); 128x32 x 8 warps: 136-140 / 200-204.
    (2, 128): (128, 32, 8, 3),
    # 64x32 x 4 warps spilled 96 B on sm_80 (72 B with 3.6) and sat at 254-255 registers
    # on sm_90; 8 warps: 188-190 / 194-198 (3.6: 175-180 / 246-254).
    (2, 256): (64, 32, 8, 3),
    # fp32: the old 128x32 / 64x32 / 32x32 tiles spilled 560 / 1,880 / 1,888 B on sm_90
    # (3.6: 544 / 6,232 / 5,992 B); these use 78-80 / 74-78 / 128-168 registers.
    (4, 64): (64, 16, 8, 2),
    (4, 128): (32, 16, 8, 2),
    (4, 256): (16, 16, 4, 2),
}
_PREFILL_WIDE = (32, 32, 4, 2)  # head_dim > 256: not served today, not compile-checked
# An int8 cache's tiles where the float ones spill: dequantizing a key/value tile (codes,
# scales, the float tile) takes registers. sm_90 / sm_80 (Triton 3.9): 16-bit d=128 at
# 128x32 spilled 8 B on sm_80, 64x32 x 8 warps: 130 / 178; fp32 spilled 16-3,240 B on
# sm_90 at the float tiles, these use 200 / 188 / 77 registers there.
_PREFILL_INT8_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (2, 128): (64, 32, 8, 3),
    (4, 64): (32, 16, 8, 2),
    (4, 128): (16, 16, 8, 2),
    (4, 256): (16, 16, 8, 1),
}


def _prefill_config(head_dim_pad: int, elem_bytes: int, target: Target,
                    kv_int8: bool = False) -> dict[str, int]:
    """Tile sizes and launch parameters (deterministic): see ``_PREFILL_TILES`` (and
    ``_PREFILL_INT8_TILES`` over an int8 cache).

    Interpreter: small tiles, because the tests want several tiles per sequence and its
    cost grows with the number of tile steps.
    """
    if target.interpret:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 1, "num_stages": 1}
    # Heads below 64 use the d=64 tiles (their padded rows are narrower still).
    key = (min(elem_bytes, 4), max(64, head_dim_pad))
    tiles = _PREFILL_INT8_TILES if kv_int8 and key in _PREFILL_INT8_TILES else _PREFILL_TILES
    block_m, block_n, warps, stages = tiles.get(key, _PREFILL_WIDE)
    if target.capability[0] < 8:  # no cp.async pipelining before sm_80
        stages = min(stages, 2)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def prefill_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    max_q: int,
    target: Target,
    window: int | None = None,
    softcap: float | None = None,
) -> list[Launch]:
    """The launch of ``paged_prefill_attention`` for validated, non-empty arguments.

    A pure function of shapes, strides, dtypes, ``max_q`` (the grid's query bound) and
    ``target``, shared by the op and by ``deepinfer_compile_grid.check`` (tools/).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    d_pad = pad_dim(head_dim)
    kv_int8 = is_int8_cache(k_cache)
    cfg = _prefill_config(d_pad, q.element_size(), target, kv_int8)
    precision, upcast = dot_flags(q.dtype, target.interpret)
    grid = (triton.cdiv(max_q, cfg["BLOCK_M"]), num_q_heads, seq_lens.shape[0])
    return [Launch(prefill_kernel, grid, (
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        *score_scales(sm_scale, softcap), NO_WINDOW if window is None else window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
    ), dict(
        GROUP=num_q_heads // k_cache.shape[2], HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        KV_INT8=kv_int8, PRECISION=precision, UPCAST=upcast, SOFTCAP=softcap is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    ))]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over cached prefix + themselves (with a
    sliding ``window``, each query over its last ``window`` positions; with a ``softcap``,
    each scaled score ``s`` taken as ``softcap * tanh(s / softcap)``, as Gemma 2's).

    q: ``[T, Hq, D]`` packed new tokens (fp32/fp16/bf16, unit last stride); k_cache,
    v_cache: ``[num_blocks, block_size, Hkv, D]`` same dtype, contiguous (or int8
    ``[..., D * 9 / 8]``, :mod:`deepinfer_kernels.kv_quant`), already holding
    this step's K/V (store_kv first); block_tables: ``[B, max_blocks]`` int32;
    query_start_loc: ``[B+1]`` int32 offsets into q; seq_lens: ``[B]`` int32, cached prefix
    plus new tokens. The i-th new query of sequence b sits at position
    ``seq_lens[b] - q_len_b + i`` and sees keys ``0..position``. Returns ``[T, Hq, D]``.

    ``max_query_len`` is an optional host-int bound on the per-sequence query counts that
    sizes the grid (default T; extra programs exit at once): a smaller one leaves rows
    unwritten. Block ids are not read on the host either: the first
    ``cdiv(seq_lens[b], block_size)`` entries of row b must be valid (as for decode).
    """
    q, k_cache, v_cache, block_tables, seq_lens = check_attention_common(
        q, k_cache, v_cache, block_tables, seq_lens)
    qsl = check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,),
                       device=q.device, contiguous=True)
    batch = seq_lens.shape[0]
    if qsl.shape[0] != batch + 1:
        fail("query_start_loc", f"shape ({batch + 1},) (num sequences + 1)", tuple(qsl.shape))
    num_tokens, num_q_heads, head_dim = q.shape
    sm_scale = check_scale(scale, head_dim)
    hint = check_optional_int("max_query_len", max_query_len, 0)
    window, softcap = check_window(window), check_softcap(softcap)
    out = torch.empty_like(q) if out is None else check_out(out, q)
    if num_tokens == 0 or batch == 0 or num_q_heads == 0:
        return out

    max_q = num_tokens if hint is None else min(hint, num_tokens)
    if max_q == 0:
        return out
    run_launches(prefill_launches(q, k_cache, v_cache, block_tables, qsl, seq_lens, out,
                                  sm_scale, max_q, Target.of(q.device), window, softcap))
    return out
