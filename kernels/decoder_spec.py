"""What a backend needs to run a model's whole stack of decoder layers as one fused call
at decode (``bind_decoder_stack``, the plan/run split): the weights of each layer and the
shapes that are the same for all of them. The model describes itself with these; a
backend binds them once and returns the per-step function, or None where it has no fused
stack for them (the model then runs layer by layer through the per-op kernels).

Only the plain pre-norm Llama layer is described: fused q/k/v without bias, optional
per-head q/k RMSNorm (Qwen3), RoPE, paged attention, gated MLP, all four projections
kept as GGUF blocks (a fused projection's parts may differ in type) or, with bf16
activations, as dense bf16 weights. Other layers
(biases, MoE, tensor parallelism) have no spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BF16_TYPE", "ROWS16_FLAG", "BlockWeight", "DecoderLayerWeights", "DecoderStackFn",
           "DecoderStackSpec", "Projection", "bind_decoder_stack", "projection_parts"]


#: ggml's BF16 type id: a ``BlockWeight`` of this type is a plain bfloat16 weight
#: ``[out, in]`` viewed as uint8 ``[out, 2 * in]`` (a "block" of one weight).
BF16_TYPE = 30
#: Or-ed into a ``BlockWeight``'s type id: its blocks are repacked in 16-row groups
#: (``deepinfer_kernels.cpu_gguf_rows16``), computed by the row-group int8 kernel.
ROWS16_FLAG = 1 << 8


@dataclass(frozen=True)
class BlockWeight:
    """A projection's weight kept as GGUF blocks: uint8 ``[out, row_bytes]`` and the ggml
    type id (``BF16_TYPE``: a dense bfloat16 weight, viewed as bytes)."""

    blocks: torch.Tensor
    qtype: int


#: A projection: one weight, or parts of different types stacked along the output in
#: order (llama.cpp's mixed presets store attn_v or ffn_up a type above the rest), each
#: ``[rows_i, row_bytes_i]``.
Projection = BlockWeight | tuple[BlockWeight, ...]


def projection_parts(w: Projection) -> tuple[BlockWeight, ...]:
    """The parts of a projection in output order (one for a single weight)."""
    return w if isinstance(w, tuple) else (w,)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer. Norm weights ``[hidden]`` (q/k norms ``[head_dim]``, or None)
    in the activation dtype; ``qkv`` rows are q, then k, then v; ``gate_up`` rows are
    gate, then up. ``window``: the layer's sliding attention window (None: none);
    ``rope``: whether RoPE rotates q and k (False: a NoPE layer, SmolLM3's)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int | None = None
    rope: bool = True


@dataclass(frozen=True)
class DecoderStackSpec:
    """The layers in order, the final norm ``[hidden]``, the RoPE cache ``[max_positions,
    head_dim]`` (cos half, then sin half), the attention shapes and scale, the one
    RMSNorm epsilon every norm uses, and the factor each attention and MLP output takes
    before its residual add (Granite's ``residual_multiplier``; 1 elsewhere)."""

    layers: tuple[DecoderLayerWeights, ...]
    final_norm: torch.Tensor
    cos_sin_cache: torch.Tensor
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float
    residual_multiplier: float = 1.0


#: ``f(x, positions, kv_cache, slot_mapping, block_tables, seq_lens)``: embeddings
#: ``[T, hidden]``, positions ``[T]`` int64, the whole cache ``[L, 2, NB, BS, Hkv, D]``,
#: slots ``[T]`` int64, tables ``[T, W]``, lengths ``[T]`` int32 (one query a sequence) ->
#: the final-normed hidden states ``[T, hidden]``, or None when this step's inputs are
#: not ones the fused call takes (the caller then runs layer by layer).
DecoderStackFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def bind_decoder_stack(spec: DecoderStackSpec) -> DecoderStackFn | None:
    """The answer of a backend without a fused decoder stack (the Triton kernels, whose
    decode steps CUDA graphs replay whole; the torch reference, which is the oracle op by
    op): None, so the model runs its layers one by one."""
    return None
