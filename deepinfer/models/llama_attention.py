"""The decoder's attention block: the fused q/k/v projection, the q/k norms (per head, or
over the whole projection), RoPE (or none, on NoPE layers), the paged attention and the
output projection; split per rank under tensor parallelism."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.models.attention import Attention, AttentionMetadata
from deepinfer.models.backend import ModelBackend
from deepinfer.models.layers import RMSNorm
from deepinfer.models.parallel_layers import Linear, ShardedRMSNorm, row_parallel_linear
from deepinfer.models.tensor_parallel import SINGLE, TPGroup, local_sizes

__all__ = ["LlamaAttention"]


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, RoPE, paged attention, output projection.
    Under tensor parallelism it holds this rank's heads (qkv column-parallel, o_proj
    row-parallel)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        sizes = local_sizes(cfg, tp)
        self.num_heads, self.num_kv_heads = sizes.num_heads, sizes.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        # Its bias (if any) is whole on every rank, added once after the all-reduce.
        self.o_proj = row_parallel_linear(self.q_size, cfg.hidden_size,
                                          bias=cfg.o_proj_bias, tp=tp)
        self.full_width_norm = cfg.qk_norm_full_width
        self.clip_qkv = cfg.clip_qkv
        if cfg.qk_norm_full_width and tp.size > 1:  # OLMoE split: statistics all-reduced
            self.q_norm = ShardedRMSNorm(self.q_size, cfg.rms_norm_eps, tp)
            self.k_norm = ShardedRMSNorm(self.kv_size, cfg.rms_norm_eps, tp)
        elif cfg.qk_norm_full_width:  # OLMoE: over all heads at once
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                              scale=cfg.attention_multiplier, window=cfg.layer_window(layer),
                              softcap=cfg.attn_logit_softcapping)
        self.rope = layer not in cfg.nope_layers  # SmolLM3's NoPE layers rotate nothing

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata,
                backend: ModelBackend) -> torch.Tensor:
        """x ``[T, hidden]``; rope ``(cos_sin_cache [max_positions, D], positions [T]
        int64)``; layer_cache ``[2, NB, BS, Hkv, D]`` -> ``[T, hidden]``."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        # v stays a strided view of the fused output: it only feeds store_kv, which takes
        # any row stride (unit last stride).
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not self.rope:  # NoPE: q and k packed (the attention kernels take no stride)
            if self.q_norm is not None and not self.full_width_norm:  # Exaone 4's: per head
                q, k = (backend.rms_norm(x.reshape(-1, self.head_dim), n.weight,
                                         n.eps).view(x.shape)
                        for x, n in ((q, self.q_norm), (k, self.k_norm)))
            else:
                q, k = q.contiguous(), k.contiguous()
        elif self.q_norm is not None and not self.full_width_norm:  # inside the rotary
            q, k = backend.rotary_qk(q, k, *rope, self.q_norm.weight, self.k_norm.weight,
                                     self.q_norm.eps)
        else:
            q, k = backend.rotary_qk(q, k, *rope)
        o = self.attn(q, k, v, layer_cache[0], layer_cache[1], meta, backend)
        return self.o_proj(o.reshape(t, self.q_size))
