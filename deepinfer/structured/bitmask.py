"""A step's token bitmask and its application to the logits (the model runner's side of
structured output; the host side that fills it is ``deepinfer.structured.matchers``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenMask:
    """Allowed tokens of some rows of a step's logits.

    ``bitmask``: host int32 ``[N, ceil(V / 32)]`` (xgrammar's layout: bit ``j % 32`` of
    word ``j // 32`` set = token ``j`` allowed), one row per sample row of the step;
    only the rows in ``rows`` are filled and applied (the constrained samples)."""

    bitmask: torch.Tensor
    rows: list[int]


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """Set the disallowed tokens of ``mask.rows`` to -inf on ``logits``' device.

    ``logits``: ``[N, V]`` (any float dtype; a non-float32 tensor is cast to a float32
    copy first). Returns the masked float32 logits (``logits`` itself, modified in
    place, when it was float32); unchanged when ``mask`` is None."""
    if mask is None or not mask.rows:
        return logits
    import xgrammar as xgr

    if logits.dtype != torch.float32:
        logits = logits.float()
    # non_blocking: a blocking host-to-device copy would wait for the forward enqueued
    # before it (a stream sync each constrained step). From pageable memory the driver
    # stages the bytes before returning, so the host may refill the mask right after.
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                    indices=mask.rows)
    return logits
