"""Shared builders for the GGUF tests (the torch oracle's and the Triton kernels'): raw
blocks of every type with hostile fp16 scales, per-case random generators, and the check
of a product against ``x @ W.T`` in float64."""

from __future__ import annotations

import zlib

import numpy as np
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import quantize as gguf_quantize

from deepinfer_kernels.gguf_blocks import BlockFormat

# gguf 0.19 quantizes the 32-weight types only; K-quant payloads are random bytes.
GGUF_QUANTIZES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
# Byte offsets of each block's fp16 fields (d, and m / dmin where the type has one), from
# ggml's block structs: where the tests write their own scales.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def fp16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` nonzero finite fp16 values as little-endian bytes, uint8 ``[n, 2]``: random
    signs, about a quarter subnormal (bit patterns 1..0x3FF), the rest normal in
    [2^-14, 2^-4] (small enough that fp16 matmul outputs stay far from overflow). The
    first is always a negative subnormal, the second a negative normal value."""
    normal = np.exp2(rng.uniform(-14, -4, n)).astype(np.float16).view(np.uint16)
    subnormal = rng.integers(1, 0x400, n, dtype=np.uint16)
    bits = np.where(rng.random(n) < 0.25, subnormal, normal)
    bits |= rng.integers(0, 2, n).astype(np.uint16) << 15
    bits[0] = 0x8000 | subnormal[0]
    if n > 1:
        bits[1] = 0x8000 | normal[1]
    return bits.astype("<u2").view(np.uint8).reshape(n, 2)


def make_blocks(fmt: BlockFormat, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of a ``[rows, k]`` weight, uint8 ``[rows, row_bytes]``. Where ``gguf``
    quantizes the type: blocks of normal data, with every other block's fp16 fields
    replaced by ``fp16_scales``; otherwise random bytes with all fp16 fields replaced (so
    none is NaN or inf)."""
    n_blocks = rows * k // fmt.block_weights
    if fmt.name in GGUF_QUANTIZES:
        data = rng.standard_normal((rows, k)).astype(np.float32)
        raw = gguf_quantize(data, GQ(fmt.type_id)).reshape(n_blocks, fmt.block_bytes).copy()
        mixed = raw[1::2]  # a view: the writes below land in raw
    else:
        raw = rng.integers(0, 256, (n_blocks, fmt.block_bytes), dtype=np.uint8)
        mixed = raw
    for at in FP16_FIELDS[fmt.name]:
        mixed[:, at:at + 2] = fp16_scales(rng, mixed.shape[0])
    return raw.reshape(rows, -1)


def ragged_k(fmt: BlockFormat, blocks_of_32: int = 11) -> int:
    """Several blocks, not a power of two: ``blocks_of_32`` x 32 (11 x 32 = 352) for the
    32-weight types, 3 x 256 = 768 for the K-quants."""
    return (blocks_of_32 if fmt.block_weights == 32 else 3) * fmt.block_weights


def rng_for(*case: object) -> np.random.Generator:
    """A generator seeded by the case's parameters: fresh, reproducible data per case."""
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float) -> None:
    """``y`` (``[M, N]``) against ``x @ w.T`` in float64, within ``rtol`` of the scale of
    each dot product, ``|x| @ |w|.T`` (a plain relative error is meaningless where the
    sum cancels). NaN anywhere fails."""
    wd, xd = w.cpu().double(), x.cpu().double()
    want, scale = xd @ wd.T, xd.abs() @ wd.abs().T
    err = (y.cpu().double() - want).abs()
    assert not bool(torch.isnan(y).any()), "NaN in the output"
    assert bool((err <= rtol * scale).all()), \
        f"max error / scale {float((err / scale.clamp_min(1e-30)).max()):.3g} > {rtol}"
