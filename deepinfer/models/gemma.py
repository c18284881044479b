"""Decoder layers with norms after the attention and the MLP. Gemma 2's and 3's
(``ModelConfig.sandwich_norms``): a norm before and after each of the attention and the
MLP, the outputs added to the residual stream after their post-norm, and its RMSNorm
weights folded from offsets (``1 + w``, as stored) into plain weights at load, so every
norm runs the backends' usual RMSNorm kernels. OLMo 2's (``ModelConfig.post_norms``):
the norms after only.

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

__all__ = ["add_sandwich_norms", "fold_norm_offsets", "post_norm_forward",
           "sandwich_forward"]


def add_sandwich_norms(layer: nn.Module, cfg: ModelConfig) -> None:
    """Give a decoder layer Gemma's two MLP norms, or OLMo 2's one and no input norm
    (their ``post_attention_layernorm`` then normalizes the attention output, as their
    checkpoints name it); nothing for the other architectures."""
    if cfg.sandwich_norms:
        layer.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    if cfg.sandwich_norms or cfg.post_norms:
        layer.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    if cfg.post_norms:
        del layer.input_layernorm


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


def post_norm_forward(layer: nn.Module, rope: tuple[torch.Tensor, torch.Tensor],
                      x: torch.Tensor, residual: torch.Tensor | None,
                      layer_cache: torch.Tensor, meta: AttentionMetadata,
                      backend: ModelBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """One OLMo 2 block: the stream ``s`` (x plus the residual, x alone for the first
    layer) goes unnormalized into the attention, ``s + norm(attn(s))`` into the MLP.
    Returns ``(post-normed MLP output, stream)`` as :func:`sandwich_forward`."""
    s = x if residual is None else x + residual
    a = layer.self_attn(rope, s, layer_cache, meta, backend)
    norm = layer.post_attention_layernorm
    s = s + backend.rms_norm(a, norm.weight, norm.eps)
    norm = layer.post_feedforward_layernorm
    return backend.rms_norm(layer.mlp(s, backend), norm.weight, norm.eps), s


@torch.no_grad()
def fold_norm_offsets(model: nn.Module) -> None:
    """Every RMSNorm weight ``w`` of ``model`` (stored as Gemma stores it) becomes ``1 +
    w``, summed in fp32 and rounded once to the weight's dtype (transformers multiplies
    by ``1 + w.float()``: the same in fp32, one rounding of the factor apart in 16 bits)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.copy_(m.weight.float() + 1.0)
