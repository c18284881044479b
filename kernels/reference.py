"""Plain-torch versions of every kernel, with the same signatures as the Triton ones.

They are the test oracle and the CPU execution backend. Shapes follow DESIGN.md:
K/V caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and a slot is
``block_id * block_size + offset``. Decode is batched over sequences (it is the CPU decode
path of the engine); prefill loops over the sequences of a step in Python, which is fine
for a reference and for the few prompts of a CPU prompt step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V (``[T, Hkv, D]``) at ``slot_mapping[t]`` (``[T]`` int64).

    Negative slots are padding and are skipped.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # A flat [slots, Hkv, D] view: index_copy_ beats advanced-index assignment by ~10x
    # on CPU.
    for src, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        flat.index_copy_(0, slots, src[keep].to(cache.dtype))


def _gather_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """Gather the first ``length`` cached tokens of one sequence: ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    # index_select: an order of magnitude faster than advanced indexing on CPU.
    blocks = cache.index_select(0, block_table_row[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor) -> torch.Tensor:
    """q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``, mask ``[Lq, Lk]`` bool -> ``[Lq, Hq, D]``.

    fp32 math. GQA without repeating K/V: the ``Hq // Hkv`` query heads of a kv head are
    stacked along the query axis, so one SDPA call per kv head group covers them.
    """
    lq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qf = q.float().reshape(lq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * lq, d)
    o = F.scaled_dot_product_attention(
        qf, k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask.repeat(group, 1), scale=scale,
    )  # [Hkv, G * Lq, D]
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
) -> torch.Tensor:
    """One query per sequence against its ``seq_lens[b]`` cached keys.

    q ``[B, Hq, D]``; block_tables ``[B, max_blocks]`` int32; seq_lens ``[B]`` int32.
    Returns ``[B, Hq, D]`` in q's dtype (written into ``out`` when given).
    ``num_splits`` and ``max_seq_len`` only steer the Triton kernel; accepted here so the
    two backends are interchangeable.
    """
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
    slots = torch.where(valid, slots, slots[:, :1]).reshape(-1)
    k, v = (cache.view(-1, hkv, d).index_select(0, slots).view(b, length, hkv, d).float()
            for cache in (k_cache, v_cache))
    # GQA: the group's query heads act as the query axis of one SDPA per kv head.
    qf = q.float().reshape(b, hkv, hq // hkv, d)
    o = F.scaled_dot_product_attention(
        qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale,
    )
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
) -> torch.Tensor:
    """Causal attention of packed new tokens over prefix + themselves, all read from cache.

    q ``[T, Hq, D]`` packed; query_start_loc ``[B+1]`` int32; seq_lens ``[B]`` int32 is the
    cached prefix plus this step's new tokens. Returns ``[T, Hq, D]``.
    """
    del max_query_len
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
        k = _gather_kv(k_cache, block_tables[b], length)
        v = _gather_kv(v_cache, block_tables[b], length)
        q_pos = torch.arange(length - q_len, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, Lk]
        out[s:e] = _attend(q[s:e], k, v, scale, mask).to(out.dtype)
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
