"""Gemma 3's decoder layer (``ModelConfig.sandwich_norms``): a norm before and after each
of the attention and the MLP, the outputs added to the residual stream after their
post-norm, and its RMSNorm weights folded from offsets (``1 + w``, as stored) into plain
weights at load, so every norm runs the backends' usual RMSNorm kernels.

The residual stream is carried beside the block output as in
:class:`~deepinfer.models.llama.LlamaDecoderLayer`, so the adds fuse into the norms after
them (``add_rms_norm``): the same sums in the same dtype as transformers' Gemma3.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.models.attention import AttentionMetadata
from deepinfer.models.backend import ModelBackend
from deepinfer.models.layers import RMSNorm, add_norm

__all__ = ["add_sandwich_norms", "fold_norm_offsets", "sandwich_forward"]


def add_sandwich_norms(layer: nn.Module, cfg: ModelConfig) -> None:
    """Give a decoder layer Gemma's two MLP norms (its ``post_attention_layernorm`` then
    normalizes the attention output, as Gemma's checkpoints name it)."""
    layer.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def sandwich_forward(layer: nn.Module, rope: tuple[torch.Tensor, torch.Tensor],
                     x: torch.Tensor, residual: torch.Tensor | None,
                     layer_cache: torch.Tensor, meta: AttentionMetadata,
                     backend: ModelBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gemma block: x ``[T, hidden]``, the previous block's (post-normed) output, and
    the residual stream before it (None for the first layer, whose x is the embeddings).
    Returns ``(post-normed MLP output, stream)``; the stream after the block is their
    sum."""
    h, residual = add_norm(layer.input_layernorm, x, residual, backend)
    a = layer.self_attn(rope, h, layer_cache, meta, backend)
    norm = layer.post_attention_layernorm
    a = backend.rms_norm(a, norm.weight, norm.eps)
    norm = layer.pre_feedforward_layernorm
    h, residual = backend.add_rms_norm(a, residual, norm.weight, norm.eps)
    out = layer.mlp(h, backend)
    norm = layer.post_feedforward_layernorm
    return backend.rms_norm(out, norm.weight, norm.eps), residual


@torch.no_grad()
def fold_norm_offsets(model: nn.Module) -> None:
    """Every RMSNorm weight ``w`` of ``model`` (stored as Gemma stores it) becomes ``1 +
    w``, summed in fp32 and rounded once to the weight's dtype (transformers multiplies
    by ``1 + w.float()``: the same in fp32, one rounding of the factor apart in 16 bits)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.copy_(m.weight.float() + 1.0)
