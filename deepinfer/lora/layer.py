"""The per-step side of LoRA: which of the step's tokens run with which adapter
(``LoRAStep``, planned once per step), and the hook each adapted Linear calls with its
input and output (``LoRALinearHook``).

Tokens are grouped by adapter rather than gathered per token: a batch holds a few
adapters, so a group is a pair of small dense products over its rows (the whole batch
when one adapter has every token, with no gather at all), instead of an adapter's
weights copied per token."""

from __future__ import annotations

import torch

__all__ = ["LoRALinearHook", "LoRAStep"]

#: One group of a step: (adapter id, its rows of the step's tokens ``[n]`` int64 on the
#: device, or None for every row).
Group = tuple[int, torch.Tensor | None]


class LoRAStep:
    """This step's tokens by adapter (``groups``; empty when no token has one). Shared
    by every hook of a model; rewritten before each forward."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: tuple[Group, ...] = ()


class LoRALinearHook:
    """A Linear's adapters: ``weights`` maps an adapter id to its ``(a [R, in],
    b [out, R])`` (scale folded into ``b``, the model's dtype); called with the layer's
    input and output, it adds ``x @ a.T @ b.T`` to the rows of each group whose adapter
    adapts this layer."""

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]``, y ``[T, out]`` (the base product; updated in place) -> y."""
        for adapter, rows in self.step.groups:
            w = self.weights.get(adapter)
            if w is None:
                continue
            a, b = w
            if rows is None:
                y.addmm_(x @ a.t(), b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y
