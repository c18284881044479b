"""In-register decoding of GGUF blocks for the Triton GEMV/GEMM (``gguf_matmul``).

A row of blocks is read as *groups*: 16 consecutive bytes of 4-bit (or 8-bit) codes plus
whatever scales they need. One group gives two *planes* of 16 weights, the low and the
high nibble of each byte (Q8_0: bytes ``i`` and ``16 + i``), so each code byte is loaded
once. A plane's weights are not consecutive in K, so the kernels load x at the same
columns (``group_columns``): the dot product does not care about the order of K.

Groups per block and the columns of a group's planes (``i`` the lane, 0..15):

- 32-weight types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): one group a block, ``k = 32 b + i``
  (low) and ``k + 16`` (high).
- Q4_K, Q5_K: eight groups a block of 256, ``gg = 2 pair + s``: bytes ``32 pair + 16 s + i``
  of the codes, low nibble in sub-block ``2 pair`` (``k = 64 pair + 16 s + i``), high in
  ``2 pair + 1`` (``k + 32``).
- Q6_K: eight groups, ``gg = 4 h + 2 u + s``: ``ql`` bytes ``16 gg + i``, low nibble at
  ``k = 128 h + 32 u + 16 s + i``, high at ``k + 64``; ``qh`` byte ``32 h + 16 s + i``
  holds bits 4-5 of both (bit pairs ``u`` and ``u + 2``).

Byte layouts: ``deepinfer_kernels.gguf_blocks``. Weights are computed in fp32 with the
reference's products (``deepinfer_kernels.gguf_reference``), up to FMA contraction.
Every load is unmasked: the kernels clamp row and group indices into the tensor, and
zero the x columns of groups past the row's end instead.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _byte(b_ptr, off):
    """The bytes at ``off`` (int64 offsets, any shape) as int32 0..255."""
    return tl.load(b_ptr + off).to(tl.int32)


@triton.jit
def _half(b_ptr, off):
    """The little-endian fp16 at ``off`` as fp32 (two byte loads: rows need not be even
    aligned)."""
    lo = tl.load(b_ptr + off).to(tl.uint16)
    hi = tl.load(b_ptr + off + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int8(v):
    """int32 0..255 read as a signed byte, as fp32."""
    return ((v ^ 128) - 128).to(tl.float32)


@triton.jit
def _q32_groups(b_ptr, blk, lane, QTYPE: tl.constexpr):
    """Planes of the 32-weight types. blk: int64 ``[BN, G, 1]`` byte offsets of the
    blocks; lane ``[1, 1, 16]``. Returns fp32 ``(low, high)`` ``[BN, G, 16]``."""
    d = _half(b_ptr, blk)
    if QTYPE == 8:  # Q8_0: int8 codes at 2, w = d * q
        lo = d * _int8(_byte(b_ptr, blk + 2 + lane))
        hi = d * _int8(_byte(b_ptr, blk + 18 + lane))
    else:
        # Q4_0 / Q4_1 / Q5_0 / Q5_1: where the nibbles start and the qh word sits
        if QTYPE == 2:
            QS = 2
        elif QTYPE == 3:
            QS = 4
        elif QTYPE == 6:
            QS = 6
        else:
            QS = 8
        q = _byte(b_ptr, blk + QS + lane)
        lo = q & 15
        hi = q >> 4
        if QTYPE == 6 or QTYPE == 7:
            # The u32 of fifth bits (at 2, or 4 after Q5_1's m): bit k of the block's k.
            at = blk + QS - 4
            qh = (_byte(b_ptr, at) | (_byte(b_ptr, at + 1) << 8)
                  | (_byte(b_ptr, at + 2) << 16) | (_byte(b_ptr, at + 3) << 24))
            lo = lo | (((qh >> lane) & 1) << 4)
            hi = hi | (((qh >> (lane + 16)) & 1) << 4)
        if QTYPE == 3 or QTYPE == 7:  # w = d * q + m
            m = _half(b_ptr, blk + 2)
            lo = d * lo.to(tl.float32) + m
            hi = d * hi.to(tl.float32) + m
        else:  # symmetric: w = d * (q - 8), or q - 16 with the fifth bit
            if QTYPE == 2:
                ZERO = 8
            else:
                ZERO = 16
            lo = d * (lo - ZERO).to(tl.float32)
            hi = d * (hi - ZERO).to(tl.float32)
    return lo, hi


@triton.jit
def _k_scale_min(b_ptr, blk, j):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block ``j`` (int32, 0..7, broadcast
    against blk), as fp32. Sub-blocks 0-3 keep theirs in the low 6 bits of bytes
    ``j`` (scale) and ``4 + j`` (min) of the 12 packed bytes at 4; 4-7 take a nibble of
    byte ``8 + j % 4`` and, as bits 4-5, the top bits of those two bytes."""
    jj = j & 3
    a = _byte(b_ptr, blk + 4 + jj)
    b = _byte(b_ptr, blk + 8 + jj)
    c = _byte(b_ptr, blk + 12 + jj)
    first = j < 4
    scale = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    low = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), low.to(tl.float32)


@triton.jit
def _k_groups(b_ptr, blk, gg, lane, QTYPE: tl.constexpr):
    """Planes of the K-quants. blk: int64 ``[BN, G, 1]`` byte offsets of the blocks of
    256; gg: int32 ``[1, G, 1]`` the group within its block (0..7); lane ``[1, 1, 16]``.
    Returns fp32 ``(low, high)`` ``[BN, G, 16]``."""
    s = gg & 1
    if QTYPE == 14:  # Q6_K: w = d * scale * (q - 32), sixteen sub-blocks of 16
        h = gg >> 2
        u = (gg >> 1) & 1
        ql = _byte(b_ptr, blk + gg * 16 + lane)
        qh = _byte(b_ptr, blk + 128 + h * 32 + s * 16 + lane)
        lo = (ql & 15) | (((qh >> (2 * u)) & 3) << 4)
        hi = (ql >> 4) | (((qh >> (2 * u + 4)) & 3) << 4)
        d = _half(b_ptr, blk + 208)
        sub = blk + 192 + h * 8 + u * 2 + s  # int8 scale of the low plane's sub-block
        lo = (d * _int8(_byte(b_ptr, sub))) * (lo - 32).to(tl.float32)
        hi = (d * _int8(_byte(b_ptr, sub + 4))) * (hi - 32).to(tl.float32)
    else:  # Q4_K / Q5_K: w = (d * scale_j) * q - dmin * min_j
        pair = gg >> 1
        if QTYPE == 12:
            QS = 16
        else:
            QS = 48
        q = _byte(b_ptr, blk + QS + pair * 32 + s * 16 + lane)
        lo = q & 15
        hi = q >> 4
        if QTYPE == 13:  # bit j of qh byte l: bit 4 of weight l of sub-block j
            qh = _byte(b_ptr, blk + 16 + s * 16 + lane)
            lo = lo | (((qh >> (2 * pair)) & 1) << 4)
            hi = hi | (((qh >> (2 * pair + 1)) & 1) << 4)
        d = _half(b_ptr, blk)
        dmin = _half(b_ptr, blk + 2)
        sc_lo, mn_lo = _k_scale_min(b_ptr, blk, 2 * pair)
        sc_hi, mn_hi = _k_scale_min(b_ptr, blk, 2 * pair + 1)
        lo = (d * sc_lo) * lo.to(tl.float32) - dmin * mn_lo
        hi = (d * sc_hi) * hi.to(tl.float32) - dmin * mn_hi
    return lo, hi


@triton.jit
def group_columns(g, QTYPE: tl.constexpr):
    """K columns of groups ``g`` (int32 ``[G]``): ``(low, high)`` int32 ``[G, 16]``, in
    the order ``weight_tile`` lays out each plane. A group past the row's last gives
    columns >= K (the kernels mask x with them)."""
    lane = tl.arange(0, 16)[None, :]
    if QTYPE < 12:
        lo = g[:, None] * 32 + lane
        hi = lo + 16
    else:
        gg = (g & 7)[:, None]
        base = (g >> 3)[:, None] * 256 + (gg & 1) * 16 + lane
        if QTYPE == 14:
            lo = base + (gg >> 2) * 128 + ((gg >> 1) & 1) * 32
            hi = lo + 64
        else:
            lo = base + (gg >> 1) * 64
            hi = lo + 32
    return lo, hi


@triton.jit
def weight_tile(b_ptr, rows, g, n_groups, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """Decode groups ``g`` (int32 ``[GROUPS]``, consecutive) of the rows at byte offsets
    ``rows`` (int64 ``[BLOCK_N]``, clamped into the tensor by the caller).

    Returns ``(w_lo, w_hi, k_lo, k_hi)``: fp32 weights ``[BLOCK_N, GROUPS * 16]`` of the
    two planes and their K columns int32 ``[GROUPS * 16]``. Groups past ``n_groups`` read
    the row's last group again (finite weights; the caller zeroes x there).
    """
    lane = tl.arange(0, 16)[None, None, :]
    safe = tl.minimum(g, n_groups - 1)
    if QTYPE < 12:
        blk = rows[:, None, None] + (safe * BLOCK_BYTES).to(tl.int64)[None, :, None]
        w_lo, w_hi = _q32_groups(b_ptr, blk, lane, QTYPE)
    else:
        blk = rows[:, None, None] + ((safe >> 3) * BLOCK_BYTES).to(tl.int64)[None, :, None]
        w_lo, w_hi = _k_groups(b_ptr, blk, (safe & 7)[None, :, None], lane, QTYPE)
    k_lo, k_hi = group_columns(g, QTYPE)
    C: tl.constexpr = GROUPS * 16
    return (tl.reshape(w_lo, (BLOCK_N, C)), tl.reshape(w_hi, (BLOCK_N, C)),
            tl.reshape(k_lo, (C,)), tl.reshape(k_hi, (C,)))
