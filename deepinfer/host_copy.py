"""Host-to-device copies that never stall the host behind the device's queue.

A ``non_blocking`` copy from pageable host memory is staged by the CUDA driver
synchronously: the host waits until the copy runs, which in an overlapped loop is after
the step already in flight. Pinned memory makes it a real asynchronous copy. The
scheduler's batch buffers are pinned already; the small lists a step also carries (new
state slots, fork pairs, penalty tokens, hand-off block ids) are pinned here first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (any shape and dtype) on ``device``, enqueued without a host stall: a
    pageable CPU tensor bound for CUDA is pinned first (a host copy into the caching
    pinned allocator, which keeps the block until the transfer has run). Elsewhere a
    plain ``.to``."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def values_to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """A host list as a 1-D ``dtype`` tensor ``[len(values)]`` on ``device``, copied
    asynchronously (``torch.tensor(values, device=cuda)`` is a blocking copy)."""
    return to_device(torch.tensor(values, dtype=dtype), device)
