"""A bfloat16 weight's copy in oneDNN's blocked layout, for the products of batched steps
on the CPU (torch's ``mkldnn._linear_pointwise`` with a weight packed once).

Why: ``F.linear`` with a plain ``[N, K]`` bf16 weight hands oneDNN a layout its GEMM
does not compute from, so every call first reorders the whole weight into blocks. In a
real step the weights come from memory, not cache (the default model's bf16 weights are
270 MB), and that reorder is a second pass over them. Measured on 2 cores (AVX512-BF16,
SmolLM2-135M's four projections x 30 layers, each weight read once per step): 68 ms a
step at 64 rows through ``F.linear``, 45 ms packed (1.5x), 53 ms through the in-place
kernel of :mod:`deepinfer_kernels.cpu_dense`; at 8 rows packed and in-place are even and
below that the in-place kernel wins (no call overhead of oneDNN's).

The copy is made on first use (a model that only ever decodes one sequence never holds
it) and made again when the weight it copies changes: its storage swapped or written in
place (the parameter's version counter).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PACK_ROWS_HINT", "PackedWeight", "prepack_available"]

#: Rows oneDNN is told to expect when it picks the blocked layout (a hint only: any row
#: count runs; 64 is the CPU default batch of decode steps).
PACK_ROWS_HINT = 64


def _linear_ops():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (getattr(mkldnn, "_reorder_linear_weight", None),
            getattr(mkldnn, "_linear_pointwise", None))


@functools.cache
def prepack_available() -> bool:
    """Whether this torch build packs bf16 linear weights for oneDNN (an x86 build with
    mkldnn), checked once on a small random product."""
    reorder, linear = _linear_ops()
    if reorder is None or linear is None or not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g).bfloat16()
    try:
        got = linear(x, reorder(w, PACK_ROWS_HINT), None, "none", [], "")
    except RuntimeError:
        return False
    want = x.float() @ w.float().T
    return bool(torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max()))


class PackedWeight:
    """The blocked copy of one bf16 weight ``[N, K]`` (a layer's parameter, followed when
    its storage is swapped or written in place)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_cpu:
            raise ValueError(f"PackedWeight: a 2-D bfloat16 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        if not prepack_available():
            raise RuntimeError("PackedWeight: this torch build has no oneDNN bf16 packed "
                               "linear (see prepack_available)")
        self._weight = weight
        self._reorder, self._linear = _linear_ops()
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds now (0 before its first use)."""
        p = self._packed
        return 0 if p is None else p.numel() * p.element_size()

    def _current(self) -> torch.Tensor:
        w = self._weight
        key = (w.data_ptr(), w._version)
        if key != self._key:
            self._packed = None  # the stale copy freed before the new one is made
            self._packed = self._reorder(w.detach(), PACK_ROWS_HINT)
            self._key = key
        return self._packed

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, K]`` bf16 -> ``x @ weight.T`` ``[M, N]`` bf16 (fp32 accumulation)."""
        return self._linear(x, self._current(), None, "none", [], "")
