"""Per-step attention metadata and the layer that routes attention to the kernel backend.

The backend is any ``ModelBackend`` (``deepinfer.models.backend``: ``store_kv``,
``paged_prefill_attention``, ``paged_decode_attention`` here), e.g.
``deepinfer_kernels.cpu_backend`` on CPU or ``deepinfer_kernels`` with Triton: the model
never imports a backend itself, so the same weights run on each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.models.backend import ModelBackend


@dataclass
class AttentionMetadata:
    """What every attention layer of one step needs (shared by all layers).

    Attributes:
        is_prompt: prefill step (packed prompts, causal) or decode step (one query each).
        slot_mapping: ``[T]`` int64 cache slot (``block_id * block_size + offset``) of each
            new token; negative = padding, not stored.
        block_tables: ``[B, W]`` int32 block ids of each sequence.
        seq_lens: ``[B]`` int32 cached prefix + this step's new tokens.
        query_start_loc: ``[B+1]`` int32 offsets of each sequence's tokens in the packed
            batch (prefill; for decode it is ``arange(B+1)``).
        max_query_len: largest new-token count of a sequence (host int, kernel hint).
        max_seq_len: largest ``seq_lens`` entry (host int, kernel hint).
    """

    is_prompt: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


class Attention(nn.Module):
    """Store this step's K/V in the paged cache, then attend through it.

    Holds no weights: projections and RoPE live in the decoder layer.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window  # sliding window: positions a query sees (None: all)
        self.softcap = softcap  # Gemma 2: scores s taken as softcap * tanh(s / softcap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, backend: ModelBackend) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``; caches ``[NB, BS, Hkv, D]`` -> ``[T, Hq, D]``.

        For a decode step ``T == B`` (one new token per sequence). The decoder passes
        contiguous q/k/v.
        """
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prompt:
            return backend.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.seq_lens, scale=self.scale, max_query_len=meta.max_query_len,
                window=self.window, softcap=self.softcap,
            )
        return backend.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            scale=self.scale, max_seq_len=meta.max_seq_len, window=self.window,
            softcap=self.softcap,
        )
