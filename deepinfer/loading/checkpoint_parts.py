"""Checkpoint tensors whose layout is not the decoder's, put into its layout as they are
read: Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` split into the Llama parts (then
cut to this rank's tensor-parallel shard, as the parts would have been), and the q/k rows
of a partial rotary (Phi-4-mini rotates 3/4 of each head) reordered so that the rotated
pairs sit where the rotary kernels pair values. A base model's names (``layers.0...``,
``embed_tokens.weight``: saved from ``Qwen3Model`` and the like, as embedding models are)
get the ``model.`` prefix of the causal LM's.

Why reorder instead of teaching every rotary kernel a rotary width: rotate-half pairs
value ``i`` of a head with ``i + D / 2``, transformers' partial rotary pairs ``i`` with
``i + R / 2`` among the first ``R``. Reordering q's and k's rows the same way leaves every
q.k product as it was (v and the attention output are untouched), and the rows past the
rotated pairs meet cos 1 and sin 0 in the cache (``RotaryEmbedding``), so the C, Triton
and torch kernels, the fused CPU decode step and the KV cache all run unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from deepinfer.config import ModelConfig
from deepinfer.models.tensor_parallel import TPGroup, shard_slice, take_shard

__all__ = ["checkpoint_parts", "fused_part_names", "rotary_row_order"]

_FUSED_SUFFIXES = (".self_attn.qkv_proj.weight", ".mlp.gate_up_proj.weight")
#: The decoder's own tensors, named without ``model.`` in a base model's checkpoint.
_BASE_MODEL_PREFIXES = ("layers.", "embed_tokens.", "norm.")


def fused_part_names(name: str) -> list[str]:
    """The Llama part names a Phi-3 fused tensor ``name`` is split into (``[name]`` for
    any other tensor)."""
    if name.endswith(_FUSED_SUFFIXES[0]):
        base = name[:-len("qkv_proj.weight")]
        return [f"{base}{p}_proj.weight" for p in ("q", "k", "v")]
    if name.endswith(_FUSED_SUFFIXES[1]):
        base = name[:-len("gate_up_proj.weight")]
        return [f"{base}gate_proj.weight", f"{base}up_proj.weight"]
    return [name]


def rotary_row_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order ``[head_dim]`` (int64) to read one head's q or k rows in: the first
    ``rotary_dim / 2`` rows, the first half of the rest, the next ``rotary_dim / 2``
    rows, then the other half of the rest; so rotated value ``i`` and its partner
    ``i + rotary_dim / 2`` land ``head_dim / 2`` apart."""
    r, pass_half = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = torch.arange(r)
    rest = torch.arange(rotary_dim, head_dim)
    return torch.cat([first, rest[:pass_half], first + r, rest[pass_half:]])


def _reorder_heads(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows ``[heads * D, ...]`` (a weight or a bias) with each head's rows in ``order``."""
    d = order.shape[0]
    heads = t.shape[0] // d
    return t.reshape(heads, d, *t.shape[1:])[:, order].reshape(t.shape)


def _split_fused(name: str, t: torch.Tensor, cfg: ModelConfig
                 ) -> list[tuple[str, torch.Tensor]]:
    """Phi-3's fused tensors as the Llama parts (``q_proj``/``k_proj``/``v_proj``,
    ``gate_proj``/``up_proj``; rows of weights or of GGUF blocks alike); any other tensor
    as it is."""
    parts = fused_part_names(name)
    if len(parts) == 3:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if t.shape[0] != q + 2 * kv:
            raise ValueError(f"checkpoint tensor {name!r}: {t.shape[0]} rows, expected "
                             f"{q + 2 * kv} (q, k and v of {cfg.num_heads} and "
                             f"{cfg.num_kv_heads} heads of {cfg.head_dim})")
        return list(zip(parts, (t[:q], t[q:q + kv], t[q + kv:])))
    if len(parts) == 2:
        inter = cfg.intermediate_size
        if t.shape[0] != 2 * inter:
            raise ValueError(f"checkpoint tensor {name!r}: {t.shape[0]} rows, expected "
                             f"{2 * inter} (gate and up of intermediate_size {inter})")
        return list(zip(parts, (t[:inter], t[inter:])))
    return [(name, t)]


def checkpoint_parts(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                     tp: TPGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (HF-named, each already this rank's shard where ``shard_slice`` names
    one) in the decoder's layout: fused Phi-3 tensors (read whole: no shard pattern
    matches them) split, each part cut to its shard; q/k rows reordered for a partial
    rotary; a base model's names prefixed ``model.``. ``ValueError`` naming a fused
    tensor of the wrong size."""
    order = (rotary_row_order(cfg.head_dim, cfg.rotary_dim)
             if cfg.rotary_dim < cfg.head_dim else None)
    for name, tensor in weights:
        if name.startswith(_BASE_MODEL_PREFIXES):
            name = f"model.{name}"
        fused = name.endswith(_FUSED_SUFFIXES)
        for part_name, part in _split_fused(name, tensor, cfg):
            if fused:
                part = take_shard(part.contiguous(), shard_slice(part_name, cfg, tp),
                                  part_name)
            if order is not None and (".q_proj." in part_name or ".k_proj." in part_name):
                part = _reorder_heads(part, order)
            yield part_name, part
