"""Dequantization of GGUF tensors to float32, vectorised in torch for the block formats
common in small checkpoints (Q8_0, Q4_0, Q4_1; the default model is Q4_1): whole tensors
at once in numpy, where ``gguf.quants`` (used for the other formats) loops over row groups
in Python, which was most of the default model's load time.

ggml block layouts (32 weights a block, little-endian):
  Q8_0: d f16, q int8[32]                     w = d * q
  Q4_0: d f16, q uint8[16] (two 4-bit each)   w = d * (nibble - 8)
  Q4_1: d f16, m f16, q uint8[16]             w = d * nibble + m
Low nibbles hold weights 0..15 of a block, high nibbles weights 16..31.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of every block (uint8 ``[N, size]``) as float32 ``[N, 1]``."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 ``[N, 16]`` -> float32 ``[N, 32]``: low nibbles, then high nibbles."""
    out = np.empty((q.shape[0], 32), np.float32)
    np.bitwise_and(q, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(q, 4, out=out[:, 16:], casting="unsafe")
    return out


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType | int) -> np.ndarray:
    """float32 weights of a tensor's raw blocks ``data`` (uint8 ``[..., row_bytes]``, as the
    GGUF reader gives them): shape ``[..., row_bytes / block_bytes * 32]``."""
    qtype = Q(qtype)
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}.get(qtype)
    if size is None:
        return gguf_dequantize(data, qtype)
    rows = data.shape[:-1]
    blocks = np.asarray(data).reshape(-1, size)
    d = _halves(blocks, 0)
    if qtype == Q.Q8_0:
        w = blocks[:, 2:].view(np.int8).astype(np.float32)
        w *= d
    elif qtype == Q.Q4_0:
        w = _nibbles(blocks[:, 2:])
        w -= 8.0
        w *= d
    else:
        w = _nibbles(blocks[:, 4:])
        w *= d
        w += _halves(blocks, 2)
    return w.reshape(*rows, -1)
