"""A sequence's KV blocks and sampler-state rows as one flat byte payload, for handing
sequences from a prefill engine to a decode engine (``deepinfer.distributed.pd``).

Bytes, not typed tensors, so that one send carries everything whatever the dtypes
(gloo/NCCL need no bf16/bool support). KV bytes come first, so the typed views taken of
the payload stay aligned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.host_copy import values_to_device


def handoff_bytes(kv_cache: torch.Tensor, states: Sequence[torch.Tensor],
                  num_blocks: int, num_seqs: int) -> int:
    """Size of an ``export_kv`` payload of ``num_blocks`` blocks and ``num_seqs`` state
    rows. ``kv_cache`` ``[L, 2, num_cache_blocks, bs, Hkv, D]``; ``states`` ``[S, ...]``
    each."""
    block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    row = sum(t[0].numel() * t.element_size() for t in states)
    return num_blocks * block + num_seqs * row


def export_kv(kv_cache: torch.Tensor, states: Sequence[torch.Tensor],
              blocks: list[int], slots: list[int]) -> torch.Tensor:
    """Flat uint8 payload on the cache's device: ``kv_cache[:, :, blocks]`` ([L, 2, nb,
    bs, Hkv, D]) then, per state tensor, its rows ``[slots]``."""
    dev = kv_cache.device
    bidx = values_to_device(blocks, torch.int64, dev)
    sidx = values_to_device(slots, torch.int64, dev)
    return torch.cat([kv_cache.index_select(2, bidx).reshape(-1).view(torch.uint8)]
                     + [t.index_select(0, sidx).reshape(-1).view(torch.uint8)
                        for t in states])


def import_kv(kv_cache: torch.Tensor, states: Sequence[torch.Tensor],
              payload: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
    """Scatter an ``export_kv`` payload (uint8 ``[handoff_bytes(...)]``) into ``blocks``
    of ``kv_cache`` and rows ``slots`` of ``states``, in place."""
    dev = kv_cache.device
    shape = list(kv_cache.shape)
    shape[2] = len(blocks)
    nkv = kv_cache[:, :, 0].numel() * kv_cache.element_size() * len(blocks)
    src = payload[:nkv].view(kv_cache.dtype).view(shape)
    kv_cache.index_copy_(2, values_to_device(blocks, torch.int64, dev), src)
    sidx = values_to_device(slots, torch.int64, dev)
    off = nkv
    for t in states:
        n = len(slots) * t[0].numel() * t.element_size()
        rows = payload[off:off + n].view(t.dtype).view(len(slots), *t.shape[1:])
        t.index_copy_(0, sidx, rows)
        off += n
