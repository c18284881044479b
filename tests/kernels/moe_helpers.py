"""Builders for the mixture-of-experts kernel tests: random routings and expert weights."""

from __future__ import annotations

import torch

from tests.kernels.helpers import DEVICE, randn


def routing(num_tokens: int, num_experts: int, top_k: int, g: torch.Generator,
            hot: list[int] | None = None, only: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int32): k distinct experts per token.

    ``hot``: experts most tokens pick (routed to many times); ``only``: the experts that
    may be picked at all (the others get no token). Weights are random and positive.
    """
    logits = torch.randn((num_tokens, num_experts), generator=g)
    if hot:
        logits[:, hot] += 6.0
    if only is not None:
        mask = torch.full((num_experts,), float("-inf"))
        mask[only] = 0.0
        logits = logits + mask
    probs = torch.softmax(logits, dim=-1)
    ids = torch.multinomial(probs, top_k, replacement=False, generator=g) if num_tokens \
        else torch.empty((0, top_k), dtype=torch.long)
    weights = torch.rand((num_tokens, top_k), generator=g) + 0.1
    return weights.to(DEVICE), ids.int().to(DEVICE)


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
            g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) scaled so activations stay O(1)."""
    w13 = randn((num_experts, 2 * inter, hidden), torch.float32, g) * hidden**-0.5
    w2 = randn((num_experts, hidden, inter), torch.float32, g) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def dense_oracle(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Per-(token, k) MoE in fp64 through gathered weights: an oracle independent of
    any grouping (small shapes only)."""
    inter = w2.shape[2]
    ids = topk_ids.long()
    g13 = w13.double()[ids]  # [T, k, 2I, H]
    h = torch.einsum("th,tkih->tki", x.double(), g13)
    h = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
    y = torch.einsum("tki,tkhi->tkh", h, w2.double()[ids])
    return (y * topk_weights.double()[..., None]).sum(1)
