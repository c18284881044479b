"""How big the KV cache is: what sizes it (``KVCacheSpec``), its shape and the bytes of
one block on a rank (its tensor-parallel share of the KV heads)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.config import ModelConfig
from deepinfer.models.tensor_parallel import SINGLE, TPGroup, local_sizes
from deepinfer_kernels.kv_quant import kv_row_width


@dataclass
class KVCacheSpec:
    """How to size the KV cache: on CPU ``kv_cache_memory`` bytes; on CUDA what is left of
    ``gpu_memory_utilization`` of the device after a profiling forward at
    ``max_num_batched_tokens``. Never more blocks than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens could use. ``kv_cache_dtype``: ``auto`` (the model's dtype)
    or ``int8`` (codes and a scale per 32 values, :mod:`deepinfer_kernels.kv_quant`)."""

    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_memory: int
    gpu_memory_utilization: float
    kv_cache_dtype: str = "auto"


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int,
                   tp: TPGroup = SINGLE, kv_cache_dtype: str = "auto") -> tuple[int, ...]:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, with this
    TP rank's KV heads; an int8 cache's rows are ``head_dim * 9 / 8`` wide (the codes,
    then a 4-byte scale per 32)."""
    heads = local_sizes(cfg, tp).num_kv_heads
    return (cfg.num_layers, 2, num_blocks, block_size, heads,
            kv_row_width(cfg.head_dim, kv_cache_dtype))


def kv_cache_torch_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The cache tensor's dtype: the model's (``auto``) or ``torch.int8``."""
    return torch.int8 if kv_cache_dtype == "int8" else dtype


def new_kv_cache(cfg: ModelConfig, num_blocks: int, spec: KVCacheSpec, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup = SINGLE) -> torch.Tensor:
    """An uninitialised cache of ``num_blocks`` blocks as ``spec`` lays them out, for a
    model computing in ``dtype``: ``kv_cache_shape`` in ``kv_cache_torch_dtype``."""
    return torch.empty(kv_cache_shape(cfg, num_blocks, spec.block_size, tp,
                                      spec.kv_cache_dtype),
                       dtype=kv_cache_torch_dtype(dtype, spec.kv_cache_dtype), device=device)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                   tp: TPGroup = SINGLE, kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes over all layers, K and V (this TP rank's heads)."""
    elem = torch.empty((), dtype=kv_cache_torch_dtype(dtype, kv_cache_dtype)).element_size()
    return int(np.prod(kv_cache_shape(cfg, 1, block_size, tp, kv_cache_dtype))) * elem
