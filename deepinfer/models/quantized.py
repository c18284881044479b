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

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.models.parallel_layers import Embedding, Linear, MatmulFn
from deepinfer_kernels import gguf_kernels
from deepinfer_kernels.cpu_gguf_rows16 import (
    bind_rows16_lookup,
    bind_rows16_matmul,
    pack_rows16,
    rows16_usable,
)
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


@dataclass(frozen=True)
class BlockPart:
    """One part of a fused Linear (q, k or v; gate or up) whose parts differ in block
    type: its rows ``row_offset .. + rows`` of the output, held as ``rows`` block rows of
    ``row_bytes`` at ``byte_offset`` of the layer's flat uint8 weight."""

    row_offset: int
    rows: int
    byte_offset: int
    row_bytes: int
    qtype: int


def keep_quantized_parts(module: nn.Module, parts: list[tuple[int, int, int, str]]) -> None:
    """Make fused Linear ``module`` (weight unmaterialised, ``[out, K]``) hold its parts
    as blocks of different types (llama.cpp's mixed presets store ``attn_v`` or
    ``ffn_down`` a type above the rest): ``weight`` becomes flat uint8, the parts one
    after the other, and ``block_parts`` their :class:`BlockPart` layout. ``parts``:
    ``(row offset, rows, ggml type id, checkpoint name)`` covering every output row.
    ``ValueError`` naming the tensor as :func:`block_parameter`."""
    if not isinstance(module, Linear):
        raise TypeError(f"{parts[0][3]}: a {type(module).__name__} cannot hold GGUF parts")
    out, k = module.weight.shape
    layout, at, row = [], 0, 0
    for offset, rows, qtype, name in sorted(parts):
        if offset != row:
            raise ValueError(f"checkpoint tensor {name!r}: rows {offset}..{offset + rows} "
                             f"of a fused weight leave rows {row}..{offset} without a part")
        row_bytes = block_parameter(module.weight[:1], qtype, name).shape[-1]
        layout.append(BlockPart(offset, rows, at, row_bytes, int(qtype)))
        at, row = at + rows * row_bytes, offset + rows
    if row != out:
        raise ValueError(f"checkpoint tensor {parts[-1][3]!r}: the parts cover {row} of "
                         f"{out} rows of the fused weight")
    module.weight = nn.Parameter(torch.empty(at, dtype=torch.uint8,
                                             device=module.weight.device), requires_grad=False)
    module.block_parts = layout


def part_blocks(module: nn.Module, row_offset: int) -> torch.Tensor:
    """The uint8 ``[rows, row_bytes]`` view of the part of ``module.block_parts`` that
    starts at output row ``row_offset`` (where the loader writes it); ``KeyError`` when
    none does."""
    for p in module.block_parts:
        if p.row_offset == row_offset:
            return module.weight.data[p.byte_offset:p.byte_offset + p.rows * p.row_bytes
                                      ].view(p.rows, p.row_bytes)
    raise KeyError(row_offset)


def _bind_parts(module: nn.Module) -> MatmulFn:
    """One product per part, concatenated along the output (a copy of the activations
    only: the weights stay where they are)."""
    fns = [gguf_kernels.bind_gguf_matmul(part_blocks(module, p.row_offset), p.qtype)
           for p in module.block_parts]
    return lambda x: torch.cat([f(x) for f in fns], dim=1)


def _repacks(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a layer's blocks go to the CPU's row-group int8 kernel: 16-bit
    activations (fp32 ones keep the exact kernels) and a weight it takes; always once
    packed (its bytes are then only readable by that kernel)."""
    return module.rows16 or (dtype in (torch.bfloat16, torch.float16)
                             and rows16_usable(module.weight, module.qtype))


def bind_quantized_kernels(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every layer holding GGUF blocks its kernels (after its weight is loaded):
    ``bound_matmul`` for products, and for embeddings ``gguf_rows``, which dequantizes
    gathered rows to ``dtype`` (the model's activations). With 16-bit activations, a
    Linear or Embedding whose blocks the CPU's row-group kernel takes
    (``cpu_gguf_rows16.rows16_usable``) is repacked in place for it first (``rows16``;
    once: binding again keeps the packing)."""
    for module in model.modules():
        if getattr(module, "experts_qtypes", None) is not None:  # a SparseMoeBlock's experts
            module.bind_expert_kernels()
        if isinstance(module, Linear) and module.block_parts is not None:
            module.bound_matmul = _bind_parts(module)
            continue
        if not isinstance(module, _QUANTIZABLE) or module.qtype is None:
            continue
        if _repacks(module, dtype):
            if not module.rows16:
                pack_rows16(module.weight.data, module.qtype)
                module.rows16 = True
            module.bound_matmul = bind_rows16_matmul(module.weight.data, module.qtype)
            if isinstance(module, Embedding):  # a tied head: its lookups gather from groups
                module.bound_lookup = bind_rows16_lookup(module.weight.data, module.qtype,
                                                         dtype)
            continue
        module.bound_matmul = gguf_kernels.bind_gguf_matmul(module.weight, module.qtype)
        if isinstance(module, Embedding):
            module.gguf_rows = gguf_kernels.bind_dequantize(module.qtype, dtype,
                                                            module.weight.device)


def quantized_layers(model: nn.Module) -> dict[str, int]:
    """``{module name: ggml type id}`` of the layers holding GGUF blocks (a mixture-of-
    experts block's stacks as ``<block>.w13`` and ``<block>.w2``; the parts of a fused
    layer of mixed types as ``<layer>#<first row>``)."""
    out = {name: m.qtype for name, m in model.named_modules()
           if isinstance(m, _QUANTIZABLE) and m.qtype is not None}
    for name, m in model.named_modules():
        if getattr(m, "experts_qtypes", None) is not None:
            out[f"{name}.w13"], out[f"{name}.w2"] = m.experts_qtypes
        if isinstance(m, Linear) and m.block_parts is not None:
            out.update({f"{name}#{p.row_offset}": p.qtype for p in m.block_parts})
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (a tied embedding counted once), plus the
    packed copies of dense weights made so far (``deepinfer.models.dense_kernels``)."""
    packed = sum(m.packed_weight.nbytes for m in model.modules()
                 if getattr(m, "packed_weight", None) is not None)
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())
