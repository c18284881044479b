"""Which kernels compute on GGUF-quantized weights on which device, and the per-call
functions a layer keeps (checked once when bound).

CPU: the native C kernels (``cpu_gguf``), every block type, where the library builds.
CUDA: the Triton kernels (``gguf_matmul``), every block type, where triton imports;
embedding rows are dequantized by the torch reference there (a few rows a step).
A device without kernels for a type gets none here: the loader then dequantizes that
type's tensors at load time, as before (and says so).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kernels import cpu_gguf
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
from deepinfer_kernels.gguf_reference import dequantize_gguf
from deepinfer_kernels.validation import check_gguf_blocks

__all__ = ["bind_dequantize", "bind_gguf_matmul", "expert_kernel_types", "kernel_types"]


def kernel_types(device: torch.device | str) -> frozenset[int]:
    """ggml type ids whose weights can stay quantized on ``device``."""
    kind = torch.device(device).type
    if kind == "cpu":
        return cpu_gguf.kernel_types()
    if kind == "cuda" and _triton_matmul() is not None:
        return frozenset(BLOCK_FORMATS)
    return frozenset()


def expert_kernel_types(device: torch.device | str) -> frozenset[int]:
    """ggml type ids whose mixture-of-experts weights can stay quantized on ``device``.

    The CPU: every type with a kernel; a model multiplies such experts one at a time
    through :func:`bind_gguf_matmul` (grouped by expert, as the reference ``fused_moe``).
    CUDA: every type, through the Triton ``fused_moe_gguf`` (no host sync: the per-expert
    counts a grouping on the host needs would sync each layer inside a decode graph)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return kernel_types(device)
    if kind == "cuda" and _triton_matmul() is not None:
        return frozenset(BLOCK_FORMATS)
    return frozenset()


def _triton_matmul() -> Callable | None:
    """The Triton ``gguf_matmul``, or None where triton does not import."""
    try:
        from deepinfer_kernels.gguf_matmul import gguf_matmul
    except ImportError:
        return None
    return gguf_matmul


def bind_gguf_matmul(blocks: torch.Tensor, qtype: int
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(x)`` = ``x @ W.T`` for the weight held as ``blocks`` (uint8 ``[N, row_bytes]``,
    on its device): x ``[M, K]`` -> ``[M, N]`` in x's dtype, fp32 accumulation.
    ``ValueError`` naming the argument on bad blocks or a type ``blocks``' device has no
    kernel for."""
    if blocks.device.type == "cpu":
        return cpu_gguf.bind_gguf_matmul(blocks, qtype)
    triton_matmul = _triton_matmul() if blocks.device.type == "cuda" else None
    if triton_matmul is not None:
        check_gguf_blocks(blocks, qtype, blocks.device)  # once, as the CPU binding does
        return lambda x: triton_matmul(x, blocks, qtype)
    raise ValueError(f"blocks: no GGUF matmul kernel on {blocks.device} (type {qtype})")


def bind_dequantize(qtype: int, dtype: torch.dtype, device: torch.device | str
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(rows)``: block rows uint8 ``[T, row_bytes]`` of type ``qtype`` on ``device`` ->
    their weights ``[T, K]`` in ``dtype`` (an embedding's gathered rows)."""
    if torch.device(device).type == "cpu":
        return lambda rows: cpu_gguf.dequantize_gguf(rows, qtype, dtype)
    if torch.device(device).type == "cuda":
        return lambda rows: dequantize_gguf(rows, qtype).to(dtype)
    raise ValueError(f"qtype: no GGUF dequantization kernel on {device} (type {qtype})")
