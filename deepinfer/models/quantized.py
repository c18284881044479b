"""Weights kept as GGUF blocks: which layers of a model hold them, and the kernels bound
to them.

A layer kept quantized (a :class:`~deepinfer.models.parallel_layers.Linear` or
``Embedding``) holds its weight as uint8 ``[out, row_bytes]``: the rows of the file's
blocks as stored, so a fused projection (q/k/v, gate/up) is its parts' rows stacked, as
for float weights, provided its parts share one type. Its ``qtype`` is the ggml type id.
After the weights are in place, :func:`bind_quantized_kernels` hands each such layer the
per-call kernel of its device (checked once: the plan/run split).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.parallel_layers import Embedding, Linear
from deepinfer_kernels import gguf_kernels
from deepinfer_kernels.gguf_blocks import block_format

_QUANTIZABLE = (Linear, Embedding)


def block_parameter(weight: torch.Tensor, qtype: int, name: str) -> nn.Parameter:
    """The uint8 parameter ``[..., rows, row_bytes]`` that holds float ``weight``
    ``[..., rows, K]`` (unmaterialised, e.g. on the meta device) as ``qtype`` blocks, on
    its device. ``ValueError`` naming checkpoint tensor ``name`` when K (this rank's part of
    a row under tensor parallelism) is not whole blocks."""
    k = weight.shape[-1]
    fmt = block_format(qtype)
    if k % fmt.block_weights:  # whole in the file (the reader checks): a TP split's part
        raise ValueError(
            f"checkpoint tensor {name!r}: this rank's part of a row, {k} weights, would cut "
            f"through a {fmt.name} block of {fmt.block_weights}; pick a tensor-parallel "
            f"size that splits it at block boundaries, or load with quantization='none'")
    shape = (*weight.shape[:-1], fmt.row_bytes(k, name=name))
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=weight.device),
                        requires_grad=False)


def keep_quantized(module: nn.Module, qtype: int, name: str) -> None:
    """Make ``module`` (a Linear or Embedding, weight still unmaterialised, e.g. on the
    meta device) hold its weight as ``qtype`` blocks: uint8 ``[out, row_bytes]``.
    ``ValueError`` naming checkpoint tensor ``name`` when its rows (this rank's part of
    them under tensor parallelism) are not whole blocks."""
    if not isinstance(module, _QUANTIZABLE):
        raise TypeError(f"{name}: a {type(module).__name__} cannot hold GGUF blocks")
    module.weight = block_parameter(module.weight, qtype, name)
    module.qtype = int(qtype)


def bind_quantized_kernels(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every layer holding GGUF blocks its kernels (after its weight is loaded):
    ``gguf_matmul`` for products, and for embeddings ``gguf_rows``, which dequantizes
    gathered rows to ``dtype`` (the model's activations)."""
    for module in model.modules():
        if getattr(module, "experts_qtypes", None) is not None:  # a SparseMoeBlock's experts
            module.bind_expert_kernels()
        if not isinstance(module, _QUANTIZABLE) or module.qtype is None:
            continue
        module.gguf_matmul = gguf_kernels.bind_gguf_matmul(module.weight, module.qtype)
        if isinstance(module, Embedding):
            module.gguf_rows = gguf_kernels.bind_dequantize(module.qtype, dtype,
                                                            module.weight.device)


def quantized_layers(model: nn.Module) -> dict[str, int]:
    """``{module name: ggml type id}`` of the layers holding GGUF blocks (a mixture-of-
    experts block's stacks as ``<block>.w13`` and ``<block>.w2``)."""
    out = {name: m.qtype for name, m in model.named_modules()
           if isinstance(m, _QUANTIZABLE) and m.qtype is not None}
    for name, m in model.named_modules():
        if getattr(m, "experts_qtypes", None) is not None:
            out[f"{name}.w13"], out[f"{name}.w2"] = m.experts_qtypes
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
