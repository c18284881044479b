"""Shared builders for the kernel tests: paged caches full of NaN except the live tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# fp32: the kernels accumulate in fp32 in a different order than the reference (online
# softmax over tiles), so allow a few ulps of the O(1) outputs.
# fp16/bf16: the kernel output is rounded to 16 bits (and on GPU P is rounded before P@V).
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1e-2},
}


def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random normal data made on CPU (seeded) and moved to the test device."""
    return torch.randn(shape, generator=g).to(dtype=dtype, device=DEVICE)


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def make_paged_kv(
    lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    g: torch.Generator, num_blocks: int | None = None, extra_cols: int = 2,
) -> PagedKV:
    """Caches filled with NaN everywhere except the first ``lens[b]`` tokens of each sequence.

    Blocks are a shuffled, non-contiguous draw from ``num_blocks`` ids; every block-table
    entry past a sequence's end points at another (NaN) block, so any read past the end
    shows up as NaN in the output.
    """
    need = [(n + block_size - 1) // block_size for n in lens]
    width = max(need + [1]) + extra_cols
    total = sum(need) + width * len(lens)
    num_blocks = max(num_blocks or 0, total + 4)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks, generator=g)
    live, spare = perm[: sum(need)], perm[sum(need):]
    tables = torch.empty((len(lens), width), dtype=torch.int32)
    pos = 0
    for b, (n, nb) in enumerate(zip(lens, need)):
        blocks = live[pos : pos + nb]
        pos += nb
        tables[b, :nb] = blocks.int()
        tables[b, nb:] = spare[b * width : b * width + width - nb].int()
        if n:
            flat = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
            blk, off = (flat // block_size).to(DEVICE), (flat % block_size).to(DEVICE)
            k_cache[blk, off] = randn((n, num_kv_heads, head_dim), dtype, g)
            v_cache[blk, off] = randn((n, num_kv_heads, head_dim), dtype, g)
    return PagedKV(k_cache, v_cache, tables.to(DEVICE),
                   torch.tensor(lens, dtype=torch.int32, device=DEVICE))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "NaN in output (read past a sequence's end?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw-bit view for exact comparisons (NaN-safe)."""
    return t.contiguous().view(-1).view(torch.uint8)


def seed_for(*parts: object) -> int:
    """Stable per-case seed (``hash`` of strings changes between processes)."""
    import zlib

    return zlib.crc32(repr(parts).encode())


def cpu_paged_kv(lens, bs: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator,
                 int8: bool = False):
    """:func:`make_paged_kv` on the host, its caches int8 (``kv_quant``) with ``int8``."""
    from deepinfer_kernels.kv_quant import quantize_kv

    kv = make_paged_kv(lens, bs, hkv, d, dtype, g)
    kv.k_cache, kv.v_cache = kv.k_cache.cpu(), kv.v_cache.cpu()
    if int8:
        kv.k_cache, kv.v_cache = quantize_kv(kv.k_cache), quantize_kv(kv.v_cache)
    kv.block_tables, kv.seq_lens = kv.block_tables.cpu(), kv.seq_lens.cpu()
    return kv


def cache_rows(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """A sequence's first ``n`` K or V rows ``[n, Hkv, D]`` in fp32, read slot by slot."""
    from deepinfer_kernels.kv_quant import kv_values

    bs = cache.shape[1]
    pos = torch.arange(n)
    return kv_values(cache[table[pos // bs].long(), pos % bs]).float()
