"""Paged causal prefill attention by the native C kernel
(``kernels/csrc/paged_prefill_cpu.c``): new tokens against their sequence's cached prefix
and each other, K/V read where they lie in the paged cache, fp32 math.

Measured with ``benchmarks/bench_cpu_prefill.py`` (2 cores, the default model's
attention shapes: 9 query heads over 3 KV heads, 64 wide, bf16): 1.2-1.7x the torch path
it replaces, from 4 prompts of 128 tokens to 16 chunks of 64 over 448 cached. That path
(``cpu_backend.gathered_prefill_attention``) gathers each sequence's K/V out of the
cache, widens them and calls SDPA per sequence; it stays the fallback for what the
kernel does not take (fp16 caches, head dims not a multiple of 16 or above 256, more
than 16 query heads a KV head, no C compiler).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.cpu_native import KV_KIND, native_library, softcap_arg
from deepinfer_kernels.kv_quant import KV_GROUP, cache_head_dim
from deepinfer_kernels.validation import check_out, check_softcap, check_window, table_error

__all__ = ["can_prefill", "paged_prefill_attention"]

_MAX_D, _MAX_GROUP = 256, 16
_KINDS = (torch.float32, torch.bfloat16)


def can_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill_attention` takes these inputs: CPU tensors, q fp32 or
    bf16, the caches fp32, bf16 or int8 (both alike, contiguous ``[NB, BS, Hkv, D]``, int8
    ``[..., D * 9 / 8]``: :mod:`deepinfer_kernels.kv_quant`), D a multiple
    of 16 up to 256, at most 16 query heads per KV head, int32/int64 block tables; and
    the native library built."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        return False
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and block_tables.is_cpu):
        return False
    if q.dtype not in _KINDS or k_cache.dtype not in KV_KIND or v_cache.dtype != k_cache.dtype:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.dtype == torch.int8 and d % KV_GROUP:
        return False
    if (d % 16 or d > _MAX_D or cache_head_dim(k_cache) != d or hkv == 0 or hq % hkv
            or hq // hkv > _MAX_GROUP):
        return False
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.dim() != 2:
        return False
    return native_library() is not None


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float | None = None,
                            out: torch.Tensor | None = None,
                            window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over prefix + themselves, all read from cache
    (with a sliding ``window``, each query over its last ``window`` positions; scores
    soft-capped at ``softcap``: :func:`deepinfer_kernels.validation.check_softcap`).

    q ``[T, Hq, D]`` fp32/bf16 packed; k_cache/v_cache ``[num_blocks, block_size, Hkv, D]``
    (int8: ``[..., D * 9 / 8]``);
    block_tables ``[B, W]`` int32/int64 (any row stride); query_start_loc ``[B+1]``;
    seq_lens ``[B]`` (cached prefix plus this step's new tokens). Returns ``[T, Hq, D]`` in
    q's dtype (into ``out`` when given). Call only where :func:`can_prefill` holds.
    ``IndexError`` naming the sequence whose table is too short for its length or names a
    block outside the cache; ``ValueError`` for one with more new tokens than its length.
    Nothing is written on either."""
    lib = native_library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see can_prefill)")
    window, softcap = check_window(window), check_softcap(softcap)
    t, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    else:  # the C kernel writes T x Hq x D elements of q's dtype through its pointer
        check_out(out, q)
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    b = lens.shape[0]
    if starts.shape[0] != b + 1 or block_tables.shape[0] < b or int(starts[-1]) != t:
        raise ValueError(f"paged_prefill_attention: {b} sequences need query_start_loc of "
                         f"{b + 1} ending at {t} tokens and {b} block_tables rows; got "
                         f"{tuple(starts.tolist())} and {block_tables.shape[0]} rows")
    if t == 0:
        return out
    qc = q if q.is_contiguous() else q.contiguous()
    direct = out.is_contiguous()
    res = out if direct else torch.empty_like(qc)
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    rc = lib.paged_prefill_attention_cpu(
        qc.data_ptr(), int(q.dtype == torch.bfloat16), k_cache.data_ptr(), v_cache.data_ptr(),
        KV_KIND[k_cache.dtype], tables.data_ptr(),
        int(tables.dtype == torch.int64), tables.shape[1], tables.stride(0), starts.data_ptr(),
        lens.data_ptr(), b, hq, hkv, d, num_blocks, block_size, scale, res.data_ptr(),
        window or 0, softcap_arg(softcap), torch.get_num_threads())
    if rc >= 16:
        s = (rc - 16) // 2
        q_len, length = int(starts[s + 1] - starts[s]), int(lens[s])
        if rc % 2:
            raise ValueError(f"paged_prefill_attention: sequence {s} has {q_len} new tokens "
                             f"but seq_lens {length}")
        raise table_error("paged_prefill_attention", s, length, block_size,
                          tables.shape[1], num_blocks)
    if rc:
        raise RuntimeError(f"paged_prefill_attention: the native kernel refused (code {rc})")
    if not direct:
        out.copy_(res)
    return out
