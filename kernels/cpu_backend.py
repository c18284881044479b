"""CPU execution backend: the ops of ``kernels.reference`` with the same signatures, made fast
on the CPU.

``kernels.reference`` stays the simple oracle the kernel tests compare against; this module
is what the engine runs on the CPU. Shapes follow docs/kernels.md: K/V caches are
``[num_blocks, block_size, num_kv_heads, head_dim]``, a slot is
``block_id * block_size + offset``.

Decode (the hot path) is bounded by memory traffic and by per-op overhead, so it:

- gathers whole blocks (one ``index_select`` row per block, not per token) into a small
  per-thread workspace that is reused across calls: a fresh multi-MB tensor per step costs
  more in page faults than the copy itself, and a workspace that stays in cache makes the
  attention after the gather read from cache instead of DRAM;
- works on chunks of sequences sorted by length (longest first), each chunk about
  ``_CHUNK_BYTES`` of gathered K+V, cut to its own longest sequence, so ragged batches pay
  for little padding and no step ever materialises every sequence's whole K/V;
- runs one ``scaled_dot_product_attention`` per chunk with the ``Hq // Hkv`` query heads of
  a KV head as the query axis (K/V read once per group), without a mask when the chunk's
  sequences all have the same length (the common lockstep-decode case).

Positions past a sequence's end are never let into a result: their K/V rows in the
workspace are zeroed before the attention (unwritten slots may hold NaN/inf, and a masked
score times NaN is still NaN) and the mask hides them.

Prefill stays a Python loop over the step's sequences (a CPU prompt step holds few), but
with a causal SDPA that needs no materialised mask when a sequence has no cached prefix,
and K/V expanded (a stride-0 view, no copy) over the query heads of each KV head.

The norms, RoPE and SiLU-and-mul are one C call each (``cpu_layer_ops``): in torch they
are ~40 small ops a layer, most of a decode step's time once the weights are small. A
model whose projections are all GGUF blocks runs a decode step's whole stack of layers as
one C call (``bind_decoder_stack``, :mod:`kernels.cpu_decoder`).

An int8 KV cache (``kv_cache_dtype="int8"``, :mod:`kernels.kv_quant`) is stored and read
by the same C kernels (the torch reference where they do not take a shape).

``store_kv`` is one C call (``kernels/csrc/store_kv_cpu.c``) for fp32/bf16/int8 caches; otherwise
it skips the reference's padding filter (two boolean-index copies) when no slot is
negative, ~3x cheaper per call. The other copy ops (``clone_blocks``, ``zero_states``,
``clone_states``) are the reference's own: they run rarely (copy-on-write, slot reuse), and
an ``index_copy_`` rewrite of ``clone_blocks`` saved at most ~0.1-1.5 ms per call (1-8
pairs on a 30-layer cache), not worth a second implementation. The mixture-of-experts ops
(``moe_route``, ``fused_moe``, ``fused_moe_gguf``) are the reference's too: it already
groups the tokens by expert (one matmul pair per expert that got a token, no per-token
loop). A model whose experts are GGUF blocks on the CPU does not call ``fused_moe_gguf``
(it would dequantize every expert each call): it binds each expert's C matmuls once
(``deepinfer.models.quantized_experts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_kernels import cpu_native, cpu_prefill, reference
from deepinfer_kernels.cpu_decoder import bind_decoder_stack
from deepinfer_kernels.cpu_layer_ops import add_rms_norm, rms_norm, rotary_qk, silu_and_mul
from deepinfer_kernels.cpu_sampling import sample_tokens, sample_tokens_filtered
from deepinfer_kernels.kv_quant import is_int8_cache, kv_row_width
from deepinfer_kernels.reference import (
    clone_blocks,
    clone_states,
    fused_moe,
    fused_moe_gguf,
    moe_route,
    zero_states,
)
from deepinfer_kernels.workspace import scratch

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "gathered_decode_attention",
    "paged_prefill_attention",
    "gathered_prefill_attention",
    "clone_blocks",
    "zero_states",
    "clone_states",
    "moe_route",
    "fused_moe",
    "fused_moe_gguf",
    "rms_norm",
    "add_rms_norm",
    "rotary_qk",
    "silu_and_mul",
    "sample_tokens",
    "sample_tokens_filtered",
    "bind_decoder_stack",
]

# Gathered K+V bytes per decode chunk (fp32 K+V of SmolLM2-135M: ~2.7k tokens). Measured
# with benchmarks/bench_cpu_attention.py at 1 and 2 threads: 256 KiB pays too much per-op
# overhead, 16 MiB falls out of cache and costs ~1.3x; 1-8 MiB are within noise of each
# other, 4 MiB was best or near it on every case.
_CHUNK_BYTES = 4 << 20


def _native_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """The C store (``kernels/csrc/store_kv_cpu.c``) where it takes the inputs: one dtype
    (fp32 or bf16) throughout, or fp32/bf16 K/V into int8 caches (quantized there, as
    :func:`deepinfer_kernels.kv_quant.quantize_kv`); each token's heads back to back,
    contiguous caches, int64 slots. Returns whether it ran. ``IndexError`` naming a slot
    past the cache."""
    lib = cpu_native.native_library()
    t, hkv, d = k.shape
    dtype = k_cache.dtype
    int8 = dtype == torch.int8
    width = kv_row_width(d, "int8") if int8 else d
    # Plain comparisons (no generators): this runs once a layer per step.
    if (lib is None or k.dtype not in (torch.float32, torch.bfloat16)
            or (dtype != k.dtype and not int8) or v.dtype != k.dtype or v_cache.dtype != dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or slots.dtype != torch.int64 or not slots.is_contiguous()
            or k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d
            or v.shape != k.shape or k_cache.shape[2] != hkv or k_cache.shape[3] != width
            or v_cache.shape != k_cache.shape
            or not (k.is_cpu and v.is_cpu and k_cache.is_cpu and v_cache.is_cpu
                    and slots.is_cpu)):
        return False
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    ptrs = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), t)
    if int8:
        rc = lib.store_kv_int8_cpu(*ptrs, hkv, d, num_slots, int(k.dtype == torch.bfloat16))
    else:
        rc = lib.store_kv_cpu(*ptrs, hkv * d, num_slots, k.element_size())
    if rc < 0:
        bad = -rc - 1
        raise IndexError(f"store_kv: token {bad}'s slot {int(slots[bad])} is past the "
                         f"cache's {num_slots} slots")
    return True


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V (``[T, Hkv, D]``) at ``slot_mapping[t]`` (``[T]`` int64).

    Negative slots are padding and are skipped. The C store where it takes the inputs;
    else torch's (then the reference's filtering path where a slot is negative).
    """
    if slot_mapping.numel() == 0:
        return
    if k.dim() == 3 and _native_store(k, v, k_cache, v_cache, slot_mapping):
        return
    if is_int8_cache(k_cache) or bool((slot_mapping < 0).any()):
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    for src, cache in ((k, k_cache), (v, v_cache)):
        # Flat [slots, Hkv, D] view: index_copy_ is ~10x faster than index assignment.
        cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(
            0, slots, src.to(cache.dtype))


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
    """One query per sequence against its ``seq_lens[b]`` cached keys (its last
    ``window`` with a sliding window; scores soft-capped at ``softcap``, Gemma 2): the
    native C kernel (:mod:`kernels.cpu_native`, reads K/V straight from the paged cache)
    where it takes the inputs, else :func:`gathered_decode_attention` (the reference
    with an int8 cache, a window or a cap). Shapes and dtypes as there.
    """
    if cpu_native.can_decode(q, k_cache, v_cache, block_tables, seq_lens):
        return cpu_native.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                 seq_lens, scale=scale, out=out,
                                                 window=window, softcap=softcap)
    # What neither the C kernel nor the gathered path takes.
    if is_int8_cache(k_cache) or window is not None or softcap is not None:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                scale=scale, out=out, window=window,
                                                softcap=softcap)
    return gathered_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                     scale=scale, out=out)


def gathered_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query per sequence against its ``seq_lens[b]`` cached keys, in torch: blocks
    gathered into a reused workspace, then SDPA per chunk (the fallback of
    :func:`paged_decode_attention`: fp16 caches, no C compiler, odd head sizes).

    q ``[B, Hq, D]``; k_cache/v_cache ``[num_blocks, block_size, Hkv, D]`` (contiguous);
    block_tables ``[B, W]`` int32/int64; seq_lens ``[B]`` int32. Returns ``[B, Hq, D]`` in
    q's dtype (written into ``out`` when given). fp32 math whatever the cache dtype. Table
    entries past a sequence's last block are never read. A sequence of length 0 gets zeros.
    ``num_splits`` and ``max_seq_len`` only steer the Triton kernel: the lengths are read
    from ``seq_lens`` here (host memory, no sync), so a wrong hint cannot cut keys off.
    """
    del num_splits, max_seq_len
    b, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    row = hkv * d  # elements of one token's K (or V) row
    block = block_size * row  # elements of one block

    # Longest first: each chunk is cut to the length of its first sequence.
    lens, order = torch.sort(seq_lens.long(), descending=True, stable=True)
    lens_host: list[int] = lens.tolist()
    if lens_host[0] <= 0:
        return out.zero_()
    width = -(-lens_host[0] // block_size)
    need = (lens + block_size - 1) // block_size
    # Columns past a sequence's last block may be padding or stale ids: read the
    # sequence's first block there instead (masked anyway) so no such id is dereferenced.
    tables = block_tables.index_select(0, order)[:, :width].long()
    cols = torch.arange(width, device=q.device)
    # A length-0 sequence's row may be all padding: block 0 there (its output is zeroed).
    first = torch.where(need[:, None] > 0, tables[:, :1], 0)
    tables = torch.where(cols[None, :] < need[:, None], tables, first)

    q_sorted = q.index_select(0, order).float().view(b, hkv, group, d)
    o_sorted = torch.empty((b, hkv, group, d), dtype=torch.float32, device=q.device)
    k_blocks = k_cache.view(k_cache.shape[0], block)
    v_blocks = v_cache.view(v_cache.shape[0], block)
    positions = torch.arange(width * block_size, device=q.device)

    # Enough sequences per chunk that SDPA (parallel over sequence x kv head) has work for
    # every thread; the workspace always holds that many of the longest.
    min_seqs = min(b, -(-torch.get_num_threads() // hkv))
    tok_bytes = 2 * row * k_cache.element_size()
    chunk_tokens = max(_CHUNK_BYTES // tok_bytes, min_seqs * width * block_size)
    k_ws = scratch("k", chunk_tokens * row, k_cache.dtype)
    v_ws = scratch("v", chunk_tokens * row, k_cache.dtype)
    upcast = k_cache.dtype != torch.float32
    if upcast:
        k_ws32 = scratch("k32", chunk_tokens * row, torch.float32)
        v_ws32 = scratch("v32", chunk_tokens * row, torch.float32)

    i = 0
    while i < b:
        longest = lens_host[i]
        if longest == 0:  # the rest are empty sequences: attention over nothing is 0
            o_sorted[i:].zero_()
            break
        nblk = -(-longest // block_size)
        span = nblk * block_size
        n = min(b - i, chunk_tokens // span)  # >= min_seqs: span <= width * block_size
        e = i + n
        k = k_ws[: n * span * row]
        v = v_ws[: n * span * row]
        ids = tables[i:e, :nblk].reshape(-1)
        torch.index_select(k_blocks, 0, ids, out=k.view(n * nblk, block))
        torch.index_select(v_blocks, 0, ids, out=v.view(n * nblk, block))
        mask = None
        if lens_host[e - 1] != longest:
            valid = positions[None, :span] < lens[i:e, None]  # [n, span]
            # Zero every K/V row past its sequence's end (only the ragged tails: cheap).
            bad = (~valid).view(-1).nonzero().view(-1)
            k.view(n * span, row).index_fill_(0, bad, 0)
            v.view(n * span, row).index_fill_(0, bad, 0)
            mask = valid[:, None, None, :longest]
        if upcast:
            k = k_ws32[: k.numel()].copy_(k)
            v = v_ws32[: v.numel()].copy_(v)
        # [n, span, Hkv, D] -> keys 0..longest-1 as [n, Hkv, longest, D] (a strided view).
        kt = k.view(n, span, hkv, d)[:, :longest].transpose(1, 2)
        vt = v.view(n, span, hkv, d)[:, :longest].transpose(1, 2)
        o_sorted[i:e] = F.scaled_dot_product_attention(
            q_sorted[i:e], kt, vt, attn_mask=mask, scale=scale)
        i = e
    out.index_copy_(0, order, o_sorted.view(b, hq, d).to(out.dtype))
    return out


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
    """Causal attention of packed new tokens over prefix + themselves (each over its last
    ``window`` positions with a sliding window; scores soft-capped at ``softcap``), all
    read from cache: the native C kernel (:mod:`kernels.cpu_prefill`) where it takes the
    inputs, else :func:`gathered_prefill_attention` (the reference with an int8 cache, a
    window or a cap).

    q ``[T, Hq, D]`` packed; query_start_loc ``[B+1]`` int32; seq_lens ``[B]`` int32 is the
    cached prefix plus this step's new tokens. Returns ``[T, Hq, D]`` in q's dtype (into
    ``out`` when given); fp32 math.
    """
    del max_query_len
    if cpu_prefill.can_prefill(q, k_cache, v_cache, block_tables):
        return cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                   query_start_loc, seq_lens, scale=scale,
                                                   out=out, window=window, softcap=softcap)
    if is_int8_cache(k_cache) or window is not None or softcap is not None:
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                 query_start_loc, seq_lens, scale=scale,
                                                 out=out, window=window, softcap=softcap)
    return gathered_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                      seq_lens, scale=scale, out=out)


def gathered_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` in torch: each sequence's blocks gathered, then SDPA
    (the fallback for what the native kernel does not take: fp16 caches, other head
    sizes, no C compiler). Shapes and dtypes as there; fp32 math."""
    del max_query_len
    hq, d = q.shape[1], q.shape[2]
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    starts: list[int] = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        ids = block_tables[b, : -(-length // block_size)].long()
        # [length, Hkv, D] -> [Hkv, 1, length, D] expanded (stride 0) over the group: SDPA's
        # own GQA support is several times slower on CPU, and a repeat would copy.
        k, v = (cache.index_select(0, ids).view(-1, hkv, d)[:length].float()
                .permute(1, 0, 2).unsqueeze(1).expand(hkv, group, length, d)
                for cache in (k_cache, v_cache))
        qh = q[s:e].float().view(q_len, hkv, group, d).permute(1, 2, 0, 3)
        if q_len == length:  # no cached prefix: plain causal, no mask tensor
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
        else:  # query i sits at position length - q_len + i (bottom-right causal)
            mask = torch.ones((q_len, length), dtype=torch.bool, device=q.device).tril(
                length - q_len)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
        out[s:e] = o.permute(2, 0, 1, 3).reshape(q_len, hq, d)
    return out
