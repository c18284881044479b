"""Plain-torch GGUF block dequantization and the quantized-weight matmul: the oracle the
Triton (GEMV/GEMM) and CPU kernels for weights kept quantized are tested against, and
the signature they share.

Simple on purpose: every block of a tensor is decoded at once (no loop over blocks or
rows), in float32, with the products in the order ``gguf.quants`` (ggml's reference)
takes them, so the weights equal ``gguf.quants.dequantize`` bit for bit. The byte
layouts are listed in ``deepinfer_kernels.gguf_blocks``. The fp16 fields are read with
the host's byte order: little-endian, as GGUF is, on every platform torch supports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepinfer_kernels.gguf_blocks import BlockFormat
from deepinfer_kernels.validation import check_gguf_blocks, check_gguf_matmul_args


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block (uint8 ``[B, block_bytes]``), float32 ``[B, 1]``."""
    return raw[:, at:at + 2].contiguous().view(torch.float16).float()


def _ints(raw: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes ``start:stop`` of every block as int32 ``[B, stop - start]`` (shifts and masks
    are plain on int32 on every device, unlike on uint8)."""
    return raw[:, start:stop].to(torch.int32)


def _fields(packed: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Bit fields of packed bytes: int32 ``[B, G, L]`` -> ``[B, G * S * L]``, where element
    ``(g, s, l)`` is ``(packed[:, g, l] >> shifts[s]) & mask``. This one order covers
    every layout here: a group's L bytes give L consecutive weights per shift."""
    by = torch.tensor(tuple(shifts), dtype=torch.int32, device=packed.device).view(-1, 1)
    return ((packed.unsqueeze(-2) >> by) & mask).flatten(1)


def _low_high(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The 16 nibble bytes at ``start`` of a 32-weight block -> int32 ``[B, 32]``: byte i
    holds weight i (low nibble) and weight i + 16 (high nibble)."""
    return _fields(_ints(raw, start, start + 16).unsqueeze(1), (0, 4), 0xF)


def _fifth_bits(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The 4-byte (little-endian u32) high-bit word of Q5_0/Q5_1 -> int32 ``[B, 32]``
    holding 0 or 16: bit i, i.e. bit i % 8 of byte i // 8, is bit 4 of weight i."""
    return _fields(_ints(raw, start, start + 4).unsqueeze(-1), range(8), 1) << 4


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    return raw[:, 2:].view(torch.int8).float() * _half(raw, 0)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * (_low_high(raw, 2) - 8).float()


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * _low_high(raw, 4).float() + _half(raw, 2)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    q = _low_high(raw, 6) | _fifth_bits(raw, 2)
    return _half(raw, 0) * (q - 16).float()


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    q = _low_high(raw, 8) | _fifth_bits(raw, 4)
    return _half(raw, 0) * q.float() + _half(raw, 2)


def _k_scales_mins(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes at 4 -> eight 6-bit scales and eight 6-bit mins, int32
    ``[B, 8]`` each, one per sub-block of 32. Bytes 0-3 hold scales 0-3 (low 6 bits),
    bytes 4-7 mins 0-3; sub-blocks 4-7 take a nibble of bytes 8-11 (scale low, min high)
    and, as bits 4-5, the spare top two bits of bytes 0-3 (scales) and 4-7 (mins)."""
    packed = _ints(raw, 4, 16)
    sc, mn, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([sc & 63, (extra & 0xF) | ((sc >> 6) << 4)], dim=1)
    mins = torch.cat([mn & 63, (extra >> 4) | ((mn >> 6) << 4)], dim=1)
    return scales, mins


def _k_affine(raw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: ``(d * scale_j) * q - dmin * min_j`` over eight sub-blocks of 32;
    q int32 ``[B, 256]``."""
    scales, mins = _k_scales_mins(raw)
    step = (_half(raw, 0) * scales.float()).unsqueeze(-1)  # [B, 8, 1]
    low = (_half(raw, 2) * mins.float()).unsqueeze(-1)
    return (step * q.view(-1, 8, 32).float() - low).flatten(1)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    # 128 bytes in four groups of 32: each group's low nibbles, then its high nibbles,
    # are two consecutive sub-blocks.
    return _k_affine(raw, _fields(_ints(raw, 16, 144).view(-1, 4, 32), (0, 4), 0xF))


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    low = _fields(_ints(raw, 48, 176).view(-1, 4, 32), (0, 4), 0xF)
    # 32 high-bit bytes: bit j of byte i is bit 4 of weight i of sub-block j.
    high = _fields(_ints(raw, 16, 48).unsqueeze(1), range(8), 1)
    return _k_affine(raw, low | (high << 4))


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 weights; in each, 64 low-nibble bytes give weights 0-63 (low
    # nibbles) and 64-127 (high), and 32 bytes of 2-bit pairs give bits 4-5 of weights
    # 0-31, 32-63, 64-95, 96-127 (bit pairs 0-1, 2-3, 4-5, 6-7).
    low = _fields(_ints(raw, 0, 128).view(-1, 2, 64), (0, 4), 0xF)
    high = _fields(_ints(raw, 128, 192).view(-1, 2, 32), (0, 2, 4, 6), 0x3)
    q = ((low | (high << 4)) - 32).view(-1, 16, 16).float()
    step = _half(raw, 208) * raw[:, 192:208].view(torch.int8).float()  # [B, 16]
    return (step.unsqueeze(-1) * q).flatten(1)


# format name -> uint8 [B, block_bytes] -> float32 [B, block_weights]
_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def _dequantize(blocks: torch.Tensor, fmt: BlockFormat, k: int) -> torch.Tensor:
    """Checked arguments: all blocks of all rows decoded in one pass."""
    raw = blocks.reshape(-1, fmt.block_bytes)  # copies only rows with padding between
    return _DECODERS[fmt.name](raw).reshape(blocks.shape[0], k)


def dequantize_gguf(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Decode GGUF block rows to their weights.

    blocks: uint8 ``[N, row_bytes]`` on any device, unit last stride; each row the raw
    bytes of one weight row, ``row_bytes`` a whole number of ``qtype`` blocks (as the
    GGUF reader gives a tensor's data, reshaped to its rows).
    qtype: ggml type id (an int or ``gguf.GGMLQuantizationType``), one of
    ``deepinfer_kernels.gguf_blocks.BLOCK_FORMATS``.

    Returns float32 ``[N, K]``, ``K = row_bytes / block_bytes * block_weights``, equal to
    ``gguf.quants.dequantize`` bit for bit. ``ValueError`` naming the argument on a bad
    tensor, an unknown type or a row that is not whole blocks.
    """
    b, fmt, k = check_gguf_blocks(blocks, qtype)
    return _dequantize(b, fmt, k)


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for a weight ``W`` ``[N, K]`` kept as GGUF blocks: a linear layer
    without bias (the Triton GEMV/GEMM and CPU kernels take the same arguments).

    x: ``[M, K]`` float32, bfloat16 or float16 (any strides).
    blocks: uint8 ``[N, row_bytes]`` on x's device, unit last stride: W's rows as raw
    ``qtype`` blocks, ``K = row_bytes / block_bytes * block_weights``.
    qtype: ggml type id (see ``dequantize_gguf``).
    out: optional ``[M, N]`` in x's dtype, written and returned.

    Returns ``[M, N]`` in x's dtype: the weights dequantized to float32 and the products
    accumulated in float32, rounded to x's dtype once at the end. ``ValueError`` naming
    the argument on a bad tensor, an unknown type, a row that is not whole blocks, or a
    K of x that differs from the blocks'.
    """
    xt, b, fmt = check_gguf_matmul_args(x, blocks, qtype, out)
    w = _dequantize(b, fmt, xt.shape[1])
    y = xt.float() @ w.T
    if out is None:
        return y.to(xt.dtype)
    out.copy_(y)
    return out
