"""Dense (unquantized) projections bound to a faster product where the device has one:
on the CPU, a bfloat16 weight read in place by the native bf16 GEMM at decode's few rows
(:mod:`deepinfer_kernels.cpu_dense`), and a oneDNN-packed copy of it for batched rows
(:mod:`deepinfer_kernels.cpu_prepacked`). Layers keep ``F.linear`` everywhere else."""

from __future__ import annotations

import os

import torch
from torch import nn

from deepinfer.models.parallel_layers import Embedding, Linear
from deepinfer_kernels.cpu_dense import bind_dense_matmul, dense_gemm_usable
from deepinfer_kernels.cpu_prepacked import PackedWeight, prepack_available

__all__ = ["available_memory", "bind_dense_kernels", "dense_bf16_weight"]

#: ``prepack=None`` packs copies when they take at most this share of available memory.
PREPACK_MEMORY_SHARE = 0.25


def _dense(module: nn.Module) -> bool:
    return (isinstance(module, (Linear, Embedding)) and module.qtype is None
            and getattr(module, "block_parts", None) is None)


def available_memory() -> int | None:
    """Bytes of memory the system can still give (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _want_prepack(modules: list[nn.Module], prepack: bool | None) -> bool:
    if prepack is False or not modules or not prepack_available():
        return False
    if prepack:
        return True
    need = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    free = available_memory()
    return free is not None and need <= PREPACK_MEMORY_SHARE * free


def bind_dense_kernels(model: nn.Module, prepack: bool | None = None) -> int:
    """Give every dense Linear (and embedding, for a tied output projection) whose weight
    the CPU kernel reads a ``bound_matmul``; returns how many layers got one.

    ``prepack``: whether those layers also get a oneDNN-packed copy of their weight
    (``packed_weight``, made on first use) for products of ``PACKED_MIN_M`` rows or more;
    None: where this torch has the packed linear and the copies would take at most
    ``PREPACK_MEMORY_SHARE`` of the available memory."""
    dense = [m for m in model.modules() if _dense(m)]
    usable = [m for m in dense if dense_gemm_usable(m.weight)]
    pack = _want_prepack(usable, prepack)
    for module in dense:
        module.packed_weight = None
        module.bound_matmul = None
    for module in usable:
        module.packed_weight = PackedWeight(module.weight) if pack else None
        module.bound_matmul = bind_dense_matmul(module.weight, module.packed_weight)
    return len(usable)


def dense_bf16_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight ``[out, in]`` of a dense layer bound by :func:`bind_dense_kernels` whose
    weight the CPU kernel reads in place, else None."""
    if (not _dense(module) or module.bound_matmul is None
            or getattr(module, "bias", None) is not None):
        return None
    w = module.weight.detach()
    return w if dense_gemm_usable(w) else None
