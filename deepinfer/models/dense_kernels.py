"""Dense (unquantized) projections bound to a faster product where the device has one:
on the CPU, a bfloat16 weight read in place by the native bf16 GEMM at decode's few rows
(:mod:`deepinfer_kernels.cpu_dense`). Layers keep ``F.linear`` everywhere else."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.parallel_layers import Embedding, Linear
from deepinfer_kernels.cpu_dense import bind_dense_matmul, dense_gemm_usable

__all__ = ["bind_dense_kernels", "dense_bf16_weight"]


def _dense(module: nn.Module) -> bool:
    return (isinstance(module, (Linear, Embedding)) and module.qtype is None
            and getattr(module, "block_parts", None) is None)


def bind_dense_kernels(model: nn.Module) -> int:
    """Give every dense Linear (and embedding, for a tied output projection) whose weight
    the CPU kernel reads a ``bound_matmul``; returns how many layers got one."""
    bound = 0
    for module in model.modules():
        if not _dense(module):
            continue
        module.bound_matmul = bind_dense_matmul(module.weight)
        bound += module.bound_matmul is not None
    return bound


def dense_bf16_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight ``[out, in]`` of a dense layer bound by :func:`bind_dense_kernels` whose
    weight the CPU kernel reads in place, else None."""
    if (not _dense(module) or module.bound_matmul is None
            or getattr(module, "bias", None) is not None):
        return None
    w = module.weight.detach()
    return w if dense_gemm_usable(w) else None
