"""How big the KV cache is: what sizes it (``KVCacheSpec``), its shape and the bytes of
one block on a rank (its tensor-parallel share of the KV heads)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.config import ModelConfig
from deepinfer.models.tensor_parallel import SINGLE, TPGroup, local_sizes


@dataclass
class KVCacheSpec:
    """How to size the KV cache: on CPU ``kv_cache_memory`` bytes; on CUDA what is left of
    ``gpu_memory_utilization`` of the device after a profiling forward at
    ``max_num_batched_tokens``. Never more blocks than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens could use."""

    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_memory: int
    gpu_memory_utilization: float


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int,
                   tp: TPGroup = SINGLE) -> tuple[int, ...]:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, with this
    TP rank's KV heads."""
    heads = local_sizes(cfg, tp).num_kv_heads
    return (cfg.num_layers, 2, num_blocks, block_size, heads, cfg.head_dim)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                   tp: TPGroup = SINGLE) -> int:
    """Bytes one KV block takes over all layers, K and V (this TP rank's heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return int(np.prod(kv_cache_shape(cfg, 1, block_size, tp))) * elem
