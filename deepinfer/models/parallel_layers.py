"""Linear and Embedding without random init, and the layers that end or start a
tensor-parallel split: a row-parallel Linear (partial
sums all-reduced, bias added once after) and a vocab-parallel embedding (each rank looks
up the ids in its vocabulary block, zeros elsewhere, all-reduced). With a TP group of one
both are the plain layers, with no collective."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.tensor_parallel import SINGLE, TPGroup


class Linear(nn.Linear):
    """``nn.Linear`` whose weights are only ever filled from a checkpoint: no random init
    (on the meta device it would also pull in torch's decompositions, seconds of
    imports at start-up)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random init (see ``Linear``)."""

    def reset_parameters(self) -> None:
        pass


class RowParallelLinear(Linear):
    """``Linear(in / tp, out)`` over this rank's block of input columns; the output is
    the all-reduced sum over the group, then the bias (held whole, added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in / tp]`` -> ``[T, out]`` (same on every rank)."""
        y = self.tp.all_reduce(F.linear(x, self.weight))
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
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
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
