"""Linear and Embedding without random init, and the layers that end or start a
tensor-parallel split: a row-parallel Linear (partial
sums all-reduced, bias added once after) and a vocab-parallel embedding (each rank looks
up the ids in its vocabulary block, zeros elsewhere, all-reduced). With a TP group of one
both are the plain layers, with no collective.

Either layer's weight may be kept as GGUF blocks (:mod:`deepinfer.models.quantized`):
``weight`` is then uint8 ``[out, row_bytes]`` and ``qtype`` its ggml type id, and the
products go through the kernel bound to it (``bound_matmul``, ``gguf_rows``). A dense
bfloat16 weight on the CPU gets a ``bound_matmul`` too (:mod:`deepinfer.models.dense_kernels`).

A ``Linear`` may carry a ``lora`` hook (``deepinfer.lora.layer``): ``(x, y) -> y`` plus
this step's adapter deltas, applied to the product before a row-parallel all-reduce (the
delta of this rank's input columns is a partial sum like the product's)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.tensor_parallel import SINGLE, TPGroup
from deepinfer_kernels.cpu_dense import dense_linear

#: ``x [M, K]`` -> ``x @ W.T`` ``[M, N]`` for a weight kept as GGUF blocks.
MatmulFn = Callable[[torch.Tensor], torch.Tensor]
#: block rows uint8 ``[T, row_bytes]`` -> their weights ``[T, K]`` in the model dtype.
RowsFn = Callable[[torch.Tensor], torch.Tensor]
#: ``(x [M, K], y [M, N])`` -> ``y`` with LoRA adapter deltas added (may be in place).
LoRAHook = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear`` whose weights are only ever filled from a checkpoint: no random init
    (on the meta device it would also pull in torch's decompositions, seconds of
    imports at start-up)."""

    #: ggml type id when ``weight`` holds GGUF blocks, else None.
    qtype: int | None = None
    #: A fused layer's parts when they are blocks of different types (``weight`` is then
    #: flat uint8; ``deepinfer.models.quantized.BlockPart``), else None.
    block_parts: list | None = None
    #: True once ``weight``'s blocks are repacked in 16-row groups for the CPU's int8
    #: kernel (``deepinfer_kernels.cpu_gguf_rows16``): same bytes, rearranged. Only the
    #: bound kernels read them then.
    rows16: bool = False
    bound_matmul: MatmulFn | None = None
    #: LoRA adapters' deltas for this step's tokens (``deepinfer.lora``), else None.
    lora: LoRAHook | None = None

    def reset_parameters(self) -> None:
        pass

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, in]`` -> ``x @ W.T`` ``[M, out]`` in x's dtype (plus the LoRA deltas),
        without the bias."""
        y = dense_linear(x, self.weight) if self.bound_matmul is None else self.bound_matmul(x)
        return y if self.lora is None else self.lora(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, in]`` -> ``[M, out]``."""
        if self.bound_matmul is None:
            y = dense_linear(x, self.weight, self.bias)
        else:
            y = self.bound_matmul(x)
            y = y if self.bias is None else y + self.bias
        return y if self.lora is None else self.lora(x, y)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random init (see ``Linear``)."""

    qtype: int | None = None
    #: As ``Linear.rows16``: the blocks are repacked in 16-row groups.
    rows16: bool = False
    bound_matmul: MatmulFn | None = None
    gguf_rows: RowsFn | None = None
    #: ids ``[T]`` -> rows ``[T, hidden]``, where the weight's layout needs its own
    #: gather (repacked blocks); else None.
    bound_lookup: RowsFn | None = None

    def reset_parameters(self) -> None:
        pass

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[T]`` int64 (each in range) -> their rows ``[T, hidden]``; GGUF blocks
        are gathered first, then only those rows dequantized."""
        if self.bound_lookup is not None:
            return self.bound_lookup(ids)
        if self.gguf_rows is None:
            return F.embedding(ids, self.weight)
        return self.gguf_rows(self.weight.index_select(0, ids))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[T]`` int64 -> ``[T, hidden]``."""
        return self.lookup(ids)

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output projection: hidden ``[N, hidden]`` -> ``[N, vocab]`` scores
        (``hidden @ weight.T``) in hidden's dtype."""
        if self.bound_matmul is None:
            return dense_linear(hidden, self.weight)
        return self.bound_matmul(hidden)


class RowParallelLinear(Linear):
    """``Linear(in / tp, out)`` over this rank's block of input columns; the output is
    the all-reduced sum over the group, then the bias (held whole, added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in / tp]`` -> ``[T, out]`` (same on every rank)."""
        y = self.tp.all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias


def row_parallel_linear(in_features: int, out_features: int, bias: bool = False,
                        tp: TPGroup = SINGLE) -> Linear:
    """A ``RowParallelLinear`` over a TP group, or a plain ``Linear`` without one (same
    parameter names): alone, the decoder's per-layer calls skip the split's Python."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias=bias, tp=tp)


class VocabParallelEmbedding(Embedding):
    """``Embedding(vocab / tp, hidden)`` holding rows ``start .. start + vocab / tp``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int = 0,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[T]`` int64 (global vocabulary) -> ``[T, hidden]`` (same on every rank)."""
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across the TP group (OLMoE's q/k norm over all heads):
    each rank holds ``size`` columns and its weights; the mean of squares is all-reduced.
    A KV head replicated on several ranks counts once per holder, which leaves the mean
    unchanged: every head is held the same number of times."""

    def __init__(self, size: int, eps: float, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, size]`` (this rank's columns) -> same shape and dtype."""
        dtype = x.dtype
        xf = x.float()
        total = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        xf = xf * torch.rsqrt(total / (xf.shape[-1] * self.tp.size) + self.eps)
        return self.weight * xf.to(dtype)
