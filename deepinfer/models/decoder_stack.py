"""A decoder's layers described for a backend's fused decode step
(``ModelBackend.bind_decoder_stack``), and the binding kept per backend.

Only layers that are the plain pre-norm Llama block are described: q/k/v without bias or
clipping, no full-width q/k norm, no q/k norm on a NoPE layer (the C step copies those
q/k as projected), a dense gated MLP, every projection kept as GGUF blocks
(a fused one's parts may differ in type) or bound to the CPU's dense bf16 kernel, one
RMSNorm epsilon, no tensor parallelism. For any other model the spec is None and the
decoder runs layer by layer.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.backend import ModelBackend
from deepinfer.models.dense_kernels import dense_bf16_weight
from deepinfer.models.layers import GatedMLP
from deepinfer.models.parallel_layers import Linear
from deepinfer.models.quantized import part_blocks
from deepinfer_kernels.decoder_spec import (
    BF16_TYPE,
    ROWS16_FLAG,
    BlockWeight,
    DecoderLayerWeights,
    DecoderStackFn,
    DecoderStackSpec,
    Projection,
)

__all__ = ["DecoderStackBinding", "decoder_stack_spec"]


def _blocks(layer: nn.Module) -> Projection | None:
    if not isinstance(layer, Linear) or layer.bias is not None:
        return None
    if layer.block_parts is not None:  # parts of different types, in output order
        return tuple(BlockWeight(part_blocks(layer, p.row_offset), p.qtype)
                     for p in layer.block_parts)
    if layer.qtype is not None:
        return BlockWeight(layer.weight.detach(),
                           layer.qtype | (ROWS16_FLAG if layer.rows16 else 0))
    dense = dense_bf16_weight(layer)
    return None if dense is None else BlockWeight(dense.view(torch.uint8), BF16_TYPE)


def _layer_weights(block: nn.Module, eps: float) -> DecoderLayerWeights | None:
    attn, mlp = block.self_attn, block.mlp
    if (not isinstance(mlp, GatedMLP) or mlp.act != "silu" or block.sandwich
            or block.post_norms or (not attn.rope and attn.q_norm is not None)
            or attn.full_width_norm or attn.clip_qkv is not None):
        return None
    norms = [block.input_layernorm, block.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if any(n.eps != eps for n in norms):
        return None
    parts = [_blocks(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                  mlp.down_proj)]
    if any(p is None for p in parts):
        return None
    qkv, o, gate_up, down = parts
    return DecoderLayerWeights(
        block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach(),
        qkv, o, gate_up, down,
        None if attn.q_norm is None else attn.q_norm.weight.detach(),
        None if attn.k_norm is None else attn.k_norm.weight.detach(), attn.attn.window,
        attn.rope)


def decoder_stack_spec(model: nn.Module) -> DecoderStackSpec | None:
    """The spec of a ``LlamaForCausalLM``'s layers, or None where one of them is not the
    plain block the fused step takes (see the module docstring)."""
    cfg = model.config
    if model.tp.size != 1 or not len(model.model.layers):
        return None
    eps = model.model.norm.eps
    layers = []
    for block in model.model.layers:
        weights = _layer_weights(block, eps)
        if weights is None:
            return None
        layers.append(weights)
    attn = model.model.layers[0].self_attn
    return DecoderStackSpec(
        layers=tuple(layers), final_norm=model.model.norm.weight.detach(),
        cos_sin_cache=model.rotary.cos_sin_cache, hidden_size=cfg.hidden_size,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        intermediate_size=model.model.layers[0].mlp.intermediate_size, eps=eps,
        scale=attn.attn.scale, residual_multiplier=cfg.residual_multiplier)


class DecoderStackBinding:
    """The fused decode step bound for one backend at a time: bound on first use, again
    when the backend changes, dropped by :meth:`reset` (after the weights change)."""

    def __init__(self) -> None:
        self._backend: ModelBackend | None = None
        self._fn: DecoderStackFn | None = None
        self._rope: torch.Tensor | None = None

    def get(self, model: nn.Module, backend: ModelBackend) -> DecoderStackFn | None:
        """The bound step for ``backend``, or None where it or the model has none."""
        # The RoPE cache is rebuilt after loading (a new tensor): bind to the current one.
        if backend is not self._backend or self._rope is not model.rotary.cos_sin_cache:
            spec = decoder_stack_spec(model)
            self._rope = model.rotary.cos_sin_cache
            self._fn = None if spec is None else backend.bind_decoder_stack(spec)
            self._backend = backend
        return self._fn

    def reset(self) -> None:
        """Forget the binding: its pointers name the weights as they were."""
        self._backend = self._fn = self._rope = None

    def run(self, model: nn.Module, backend: ModelBackend, x: torch.Tensor,
            positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of a decode step through the fused call, or
        None where there is none or it does not take these inputs."""
        fn = self.get(model, backend)
        if fn is None:
            return None
        return fn(x, positions, kv_cache, slot_mapping, block_tables, seq_lens)
