"""Per-thread scratch tensors for the CPU kernels, kept across calls.

A fresh multi-MB tensor per call costs more in page faults than the work done in it, so
the CPU paths (the decode gather, the dequantized weight tiles of the GGUF matmul) reuse
one buffer per name and dtype.
"""

from __future__ import annotations

import threading

import torch

_workspace = threading.local()


def scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat per-thread CPU tensor of ``numel`` elements of ``dtype``, kept across calls.

    Grown (never shrunk) on demand; per thread so that calls running concurrently in two
    threads never share one. Its contents are garbage on entry, and it is overwritten by
    the next call asking for the same ``name``: use it only within one call.
    """
    bufs: dict[tuple[str, torch.dtype], torch.Tensor] | None = getattr(
        _workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    buf = bufs.get((name, dtype))
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first asked for under inference_mode: an inference
        # tensor could not be written by a later call outside it.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype)
        bufs[(name, dtype)] = buf
    return buf[:numel]
