"""Which kernels compute on GGUF-quantized weights on which device, and the per-call
functions a layer keeps (checked once when bound).

CPU: the native C kernels (``cpu_gguf``), every block type, where the library builds.
A device without kernels for a type gets none here: the loader then dequantizes that
type's tensors at load time, as before (and says so).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kernels import cpu_gguf

__all__ = ["bind_dequantize", "bind_gguf_matmul", "kernel_types"]


def kernel_types(device: torch.device | str) -> frozenset[int]:
    """ggml type ids whose weights can stay quantized on ``device``."""
    if torch.device(device).type == "cpu":
        return cpu_gguf.kernel_types()
    return frozenset()


def bind_gguf_matmul(blocks: torch.Tensor, qtype: int
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(x)`` = ``x @ W.T`` for the weight held as ``blocks`` (uint8 ``[N, row_bytes]``,
    on its device): x ``[M, K]`` -> ``[M, N]`` in x's dtype, fp32 accumulation.
    ``ValueError`` naming the argument on bad blocks or a type ``blocks``' device has no
    kernel for."""
    if blocks.device.type == "cpu":
        return cpu_gguf.bind_gguf_matmul(blocks, qtype)
    raise ValueError(f"blocks: no GGUF matmul kernel on {blocks.device} (type {qtype})")


def bind_dequantize(qtype: int, dtype: torch.dtype, device: torch.device | str
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(rows)``: block rows uint8 ``[T, row_bytes]`` of type ``qtype`` on ``device`` ->
    their weights ``[T, K]`` in ``dtype`` (an embedding's gathered rows)."""
    if torch.device(device).type == "cpu":
        return lambda rows: cpu_gguf.dequantize_gguf(rows, qtype, dtype)
    raise ValueError(f"qtype: no GGUF dequantization kernel on {device} (type {qtype})")
