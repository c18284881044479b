"""Plain-torch versions of every kernel, with the same signatures as the Triton ones.

They are the test oracle and the CPU execution backend. Shapes follow DESIGN.md:
K/V caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and a slot is
``block_id * block_size + offset``. Decode is batched over sequences (it is the CPU decode
path of the engine); prefill loops over the sequences of a step in Python, which is fine
for a reference and for the few prompts of a CPU prompt step. The GGUF quantized-weight
ops (``dequantize_gguf``, ``gguf_matmul``) live in ``gguf_reference`` and the sampling ops
(``sample_tokens``, ``sample_tokens_filtered``) in ``sampling_reference``; both are
re-exported here, so this module still holds the reference of every op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Re-exported: this module holds the reference of every op.
from deepinfer_kernels.decoder_spec import bind_decoder_stack  # noqa: F401
from deepinfer_kernels.gguf_reference import dequantize_gguf, gguf_matmul  # noqa: F401
from deepinfer_kernels.kv_quant import is_int8_cache, kv_values, quantize_kv
from deepinfer_kernels.sampling_reference import (  # noqa: F401
    filter_logits,
    inverse_cdf_draw_ok,
    sample_tokens,
    sample_tokens_filtered,
)
from deepinfer_kernels.validation import check_softcap, check_window


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V (``[T, Hkv, D]``) at ``slot_mapping[t]`` (``[T]`` int64).

    Negative slots are padding and are skipped. An int8 cache (``[..., D * 9 / 8]``, see
    :mod:`deepinfer_kernels.kv_quant`) gets each row's codes and scale.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # A flat [slots, Hkv, D] view: index_copy_ beats advanced-index assignment by ~10x
    # on CPU.
    for src, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        rows = quantize_kv(src[keep]) if is_int8_cache(cache) else src[keep].to(cache.dtype)
        flat.index_copy_(0, slots, rows)


def _gather_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """Gather the first ``length`` cached tokens of one sequence: ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    # index_select: an order of magnitude faster than advanced indexing on CPU.
    blocks = cache.index_select(0, block_table_row[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, scale: float,
                         softcap: float | None) -> torch.Tensor:
    """SDPA over ``[..., Lq, D]`` queries and ``[..., Lk, D]`` keys/values with a bool
    ``mask`` broadcast to ``[..., Lq, Lk]``; with ``softcap`` each scaled score ``s``
    becomes ``softcap * tanh(s / softcap)`` first (Gemma 2), which SDPA cannot do. A
    row with no key left is NaN, as SDPA's."""
    # A cap past fp32's range changes no fp32 score (and would be inf * tanh(0) = NaN).
    if softcap is None or softcap > torch.finfo(torch.float32).max:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``, mask ``[Lq, Lk]`` bool -> ``[Lq, Hq, D]``.

    fp32 math. GQA without repeating K/V: the ``Hq // Hkv`` query heads of a kv head are
    stacked along the query axis, so one SDPA call per kv head group covers them.
    """
    lq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qf = q.float().reshape(lq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * lq, d)
    o = softcapped_attention(qf, k.float().transpose(0, 1), v.float().transpose(0, 1),
                             mask.repeat(group, 1), scale, softcap)  # [Hkv, G * Lq, D]
    return o.reshape(hkv, group, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)


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
    """One query per sequence against its ``seq_lens[b]`` cached keys (the last
    ``window`` of them with a sliding window: ``check_window``; scores soft-capped at
    ``softcap``: ``check_softcap``).

    q ``[B, Hq, D]``; block_tables ``[B, max_blocks]`` int32; seq_lens ``[B]`` int32; the
    caches in q's dtype or int8 (``[..., D * 9 / 8]``, :mod:`deepinfer_kernels.kv_quant`).
    Returns ``[B, Hq, D]`` in q's dtype (written into ``out`` when given).
    ``num_splits`` and ``max_seq_len`` only steer the Triton kernel; accepted here so the
    two backends are interchangeable.
    """
    window, softcap = check_window(window), check_softcap(softcap)
    del num_splits, max_seq_len  # the oracle reads every table column; hints can't hurt it
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    # Batched over sequences (this is also the CPU decode path): gather every sequence's
    # tokens by slot. Positions past a sequence's end read its position 0 instead of
    # whatever the block holds there (never-written slots may hold NaN/inf, and a masked
    # score times NaN is still NaN); the attention mask hides them.
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1]
    length = width * block_size
    pos = torch.arange(length, device=q.device)
    table = block_tables[:, :width].long()
    slots = table[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    if window is not None:  # the query sits at seq_len - 1: keys after it minus window
        valid &= pos[None, :] >= seq_lens[:, None] - window
    # A length-0 sequence's table may be all padding: it reads slot 0 (and gets zeros).
    first = torch.where(seq_lens[:, None] > 0, slots[:, :1], 0)
    slots = torch.where(valid, slots, first).reshape(-1)
    width_d = k_cache.shape[3]  # D, or D * 9 / 8 for an int8 cache
    k, v = (kv_values(cache.view(-1, hkv, width_d).index_select(0, slots)).view(
        b, length, hkv, d) for cache in (k_cache, v_cache))
    # GQA: the group's query heads act as the query axis of one SDPA per kv head.
    qf = q.float().reshape(b, hkv, hq // hkv, d)
    o = softcapped_attention(qf, k.transpose(1, 2), v.transpose(1, 2),
                             valid[:, None, None, :], scale, softcap)
    o = torch.where((seq_lens > 0)[:, None, None, None], o, 0.0)  # no key: zeros, not NaN
    out.copy_(o.reshape(b, hq, d))
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
    """Causal attention of packed new tokens over prefix + themselves, all read from cache
    (with a sliding ``window``, each query over its last ``window`` positions, itself
    included: ``check_window``; scores soft-capped at ``softcap``: ``check_softcap``).

    q ``[T, Hq, D]`` packed; query_start_loc ``[B+1]`` int32; seq_lens ``[B]`` int32 is the
    cached prefix plus this step's new tokens; caches as in :func:`paged_decode_attention`.
    Returns ``[T, Hq, D]``.
    """
    del max_query_len
    window, softcap = check_window(window), check_softcap(softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, length in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        k = kv_values(_gather_kv(k_cache, block_tables[b], length))
        v = kv_values(_gather_kv(v_cache, block_tables[b], length))
        q_pos = torch.arange(length - q_len, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, Lk]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        out[s:e] = _attend(q[s:e], k, v, scale, mask, softcap).to(out.dtype)
    return out


def clone_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy block ``src`` to ``dst`` for every ``(src, dst)`` row of ``pairs`` ``[N, 2]``.

    kv_cache ``[num_layers, 2, num_blocks, block_size, Hkv, D]``; every layer, K and V.
    """
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def zero_states(states: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
    """Zero rows ``slots`` (``[M]``) of every tensor in ``states`` (slot is dim 0)."""
    if slots.numel() == 0:
        return
    idx = slots.long()
    for s in states:
        s[idx.to(s.device)] = 0


def clone_states(states: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy row ``src`` to row ``dst`` for each ``(src, dst)`` in ``pairs`` ``[P, 2]``."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    for s in states:
        s[dst.to(s.device)] = s[src.to(s.device)]


# --- decoder-layer elementwise ops --------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dim, statistics in fp32 (Hugging
    Face's RMSNorm, op for op). x ``[T, H]``, weight ``[H]`` -> ``[T, H]`` in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s, weight, eps), s)``, each ``[T, H]``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x ``[T, H, D]`` with cos/sin ``[T, 1, D/2]``: ``[x1 cos - x2 sin,
    x2 cos + x1 sin]``, equal to Hugging Face's ``x cos + rotate_half(x) sin`` bit for bit
    (``a + (-b) == a - b``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` rotated by ``positions`` (``[T]`` int64) with
    the rows of ``cos_sin_cache`` ``[max_positions, D]`` (cos half, sin half), after a
    per-head RMSNorm when the norm weights (``[D]``) are given."""
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return rotate_half_pairs(q, cos, sin), rotate_half_pairs(k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate then up) -> ``silu(gate) * up`` ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- mixture of experts ------------------------------------------------------------------

def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over ``router_logits [T, E]`` in fp32, the ``top_k`` largest (descending,
    ties to the lowest expert index), divided by their sum when ``renormalize``.

    Returns ``(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k].contiguous(), ids[:, :top_k].int().contiguous()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs (rows of ``topk_ids.view(-1)``) grouped by expert, each group padded to
    ``block_m`` with the sentinel ``T * top_k``; see ``kernels.moe_align`` for the layout.

    Returns ``(sorted_ids [P] int32, block_expert [P // block_m] int32 (-1 past the padded
    total), num_padded [1] int32)``, ``P = moe_align_size(T * top_k, E, block_m)``.
    """
    flat = topk_ids.reshape(-1).long()
    n, device = flat.numel(), flat.device
    bound = n + min(num_experts, n) * (block_m - 1)
    size = (bound + block_m - 1) // block_m * block_m
    keep = (flat >= 0) & (flat < num_experts)
    expert = torch.where(keep, flat, num_experts)  # dropped pairs sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts, first = ends - padded, torch.cumsum(counts, 0) - counts
    order = torch.sort(expert, stable=True).indices[: int(keep.sum())]
    e_sorted = expert[order]
    dest = starts[e_sorted] + torch.arange(order.numel(), device=device) - first[e_sorted]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.int()
    rows = torch.arange(size // block_m, device=device) * block_m
    total = padded.sum()
    block_expert = torch.searchsorted(ends, rows, right=True)
    block_expert = torch.where(rows < total, block_expert, -1).int()
    return sorted_ids, block_expert, total.reshape(1).int()


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
    mul_routed_weight: bool,
    gated: bool = False,
) -> torch.Tensor:
    """``out[i] = a[i // top_k or i] @ w[expert(i)].T`` (x weight; ``silu(gate) * up`` when
    ``gated``) for every pair ``i`` listed in ``sorted_ids[:num_padded]``; one matmul per
    expert, fp32 math. See ``kernels.fused_moe_gemm`` for the shapes."""
    pairs = out.shape[0]
    block_m = sorted_ids.shape[0] // max(1, block_expert.shape[0])
    used = int(num_padded[0])
    ids = sorted_ids[:used].long()
    experts = block_expert[: used // block_m].long().repeat_interleave(block_m)
    valid = ids < pairs
    ids, experts = ids[valid], experts[valid]
    rows = ids // top_k if a.shape[0] != pairs else ids
    for e in torch.unique(experts).tolist():
        sel = experts == e
        y = a[rows[sel]].float() @ w[e].float().T
        if gated:
            half = y.shape[1] // 2
            y = F.silu(y[:, :half]) * y[:, half:]
        if mul_routed_weight:
            assert topk_weights is not None
            y = y * topk_weights.reshape(-1)[ids[sel]].float()[:, None]
        out[ids[sel]] = y.to(out.dtype)
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU mixture-of-experts MLP, grouped by expert (one loop step per expert that
    got a token, no per-token loop), fp32 math.

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``;
    topk_weights ``[T, k]`` fp32; topk_ids ``[T, k]`` int32. Returns ``[T, H]`` in x's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    acc = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        h = x[tokens].float() @ w13[e].float().T
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = (h @ w2[e].float().T) * topk_weights.reshape(-1)[pairs].float()[:, None]
        acc.index_add_(0, tokens, y)
    if out is None:
        out = torch.empty_like(x)
    out.copy_(acc)
    return out


def fused_moe_gguf(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    qtype13: int,
    qtype2: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe`` with the experts held as GGUF blocks (w13 uint8 ``[E, 2I,
    row_bytes(H)]`` of type ``qtype13``, w2 uint8 ``[E, H, row_bytes(I)]`` of type
    ``qtype2``): dequantized to fp32 (``dequantize_gguf``), then ``fused_moe`` in fp32
    math. Returns ``[T, H]`` in x's dtype."""
    w13_f = dequantize_gguf(w13.reshape(-1, w13.shape[-1]), qtype13).view(
        w13.shape[0], w13.shape[1], -1)
    w2_f = dequantize_gguf(w2.reshape(-1, w2.shape[-1]), qtype2).view(
        w2.shape[0], w2.shape[1], -1)
    return fused_moe(x, w13_f, w2_f, topk_weights, topk_ids, out)
