"""A step's token bitmask and its application to the logits (the model runner's side of
structured output; the host side that fills it is ``deepinfer.structured.matchers``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.host_copy import to_device, values_to_device


@dataclass
class TokenMask:
    """Allowed tokens of some rows of a step's logits.

    ``bitmask``: host int32 ``[N, ceil(V / 32)]`` (xgrammar's layout: bit ``j % 32`` of
    word ``j // 32`` set = token ``j`` allowed), one row per sample row of the step;
    only the rows in ``rows`` are filled and applied (the constrained samples).
    ``bans``: ``(rows, token ids)`` set to -inf besides (multi-token bad words)."""

    bitmask: torch.Tensor | None
    rows: list[int]
    bans: tuple[list[int], list[int]] | None = None


class BitmaskStaging:
    """Pinned host copies of the step bitmask, two used in turn, so its upload to a CUDA
    device never waits for the device.

    A host-to-device copy from pageable memory may wait for the work queued before it on
    the stream (the forward the host is overlapping with); from pinned memory it is
    queued and returns at once. Two buffers: the one filled for step k+1 is never the one
    step k's copy may still be reading (an event recorded after each copy says when its
    buffer is free again)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[Any] = [None, None]
        self._next = 0

    def upload(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Queue the copy of ``bitmask`` (host int32 ``[N, W]``) to ``device`` (CUDA) on
        the current stream; returns the device tensor ``[N, W]``."""
        i, self._next = self._next, self._next ^ 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # two steps ago: long done in practice
        buf = self._buffers[i]
        if buf is None or buf.shape[0] < bitmask.shape[0] or buf.shape[1] != bitmask.shape[1]:
            buf = self._buffers[i] = torch.empty(bitmask.shape, dtype=bitmask.dtype,
                                                 pin_memory=True)
        host = buf[: bitmask.shape[0]]
        host.copy_(bitmask)
        out = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[i] = event
        return out


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None,
                     staging: BitmaskStaging | None = None) -> torch.Tensor:
    """Set the disallowed tokens of ``mask.rows`` to -inf on ``logits``' device.

    ``logits``: ``[N, V]`` (any float dtype; a non-float32 tensor is cast to a float32
    copy first). Returns the masked float32 logits (``logits`` itself, modified in
    place, when it was float32); unchanged when ``mask`` is None. ``staging``: the
    caller's reused pinned buffers for a CUDA ``logits`` (without them the mask is pinned
    afresh for the copy)."""
    if mask is None or not (mask.rows or mask.bans):
        return logits
    if logits.dtype != torch.float32:
        logits = logits.float()
    if mask.rows:
        import xgrammar as xgr

        indices: list[int] | torch.Tensor = mask.rows
        if logits.device.type == "cuda":
            bitmask = (staging.upload(mask.bitmask, logits.device) if staging is not None
                       else to_device(mask.bitmask, logits.device))
            # xgrammar's CUDA path turns a list into a tensor with a pageable copy.
            indices = values_to_device(mask.rows, torch.int32, logits.device)
        else:
            bitmask = mask.bitmask.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                        indices=indices)
    if mask.bans:
        rows, cols = (values_to_device(x, torch.int64, logits.device) for x in mask.bans)
        logits.index_put_((rows, cols), logits.new_full((), float("-inf")))
    return logits
