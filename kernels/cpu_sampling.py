"""Token sampling on the CPU through the native library (``kernels/csrc/sampling_cpu.c``):
``sample_tokens`` and ``sample_tokens_filtered`` with the signatures and semantics of
``deepinfer_kernels.reference``, one C call for the whole batch.

Why: the torch version sorts the whole vocabulary of every row for top-p (256 rows of a
49k vocabulary: ~0.7 s a step on 2 cores, more than the model's own decode step) and
makes several ``[N, V]`` temporaries even for plain temperature sampling. The C kernel
reads each row once into a per-thread buffer, selects (no full sort) among the tokens
near the maximum that a filter can keep, and sums in float64, so a draw is the
reference's up to rounding at a CDF boundary (``reference.inverse_cdf_draw_ok`` is the
oracle its tests use).

float32 logits whose last dim is contiguous take the C path; anything else (other
dtypes, no native library) runs the reference.
"""

from __future__ import annotations

import torch

from deepinfer_kernels import reference
from deepinfer_kernels.cpu_native import native_library
from deepinfer_kernels.validation import check_sampling_args

__all__ = ["sample_tokens", "sample_tokens_filtered"]


def _native(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
            top_k: torch.Tensor | None, top_p: torch.Tensor | None,
            min_p: torch.Tensor | None) -> torch.Tensor | None:
    """The C kernel's draws, or None where it does not apply."""
    lib = native_library()
    if (lib is None or not logits.is_cpu or logits.dtype != torch.float32
            or logits.stride(1) != 1 or logits.shape[1] >= 2**31):
        return None
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return out
    args = [t if t is None else t.contiguous()
            for t in (temperatures, uniforms, top_k, top_p, min_p)]
    ptrs = [None if t is None else t.data_ptr() for t in args]
    if lib.sample_tokens_cpu(logits.data_ptr(), logits.stride(0), n, vocab, *ptrs,
                             out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"sample_tokens: no memory for the per-thread buffers of a "
                          f"{vocab}-token vocabulary")
    return out


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``softmax(logits / temperature)`` (logits ``[N, V]``, not
    modified) by inverting the CDF at ``uniforms`` (``[N]`` fp32); returns ``[N]`` int64
    (see ``reference.sample_tokens``)."""
    check_sampling_args(logits, temperatures=temperatures, uniforms=uniforms)
    out = _native(logits, temperatures, uniforms, None, None, None)
    return reference.sample_tokens(logits, temperatures, uniforms) if out is None else out


def sample_tokens_filtered(logits: torch.Tensor, temperatures: torch.Tensor,
                           uniforms: torch.Tensor, top_k: torch.Tensor | None = None,
                           top_p: torch.Tensor | None = None,
                           min_p: torch.Tensor | None = None,
                           max_top_k: int | None = None) -> torch.Tensor:
    """One draw per row of ``logits`` ``[N, V]`` (not modified) after top-k (``[N]``
    int64), top-p and min-p (``[N]`` fp32 each; None: off), at ``uniforms`` ``[N]`` fp32;
    returns ``[N]`` int64 (see ``reference.sample_tokens_filtered``; ``max_top_k`` is only
    the reference's hint)."""
    check_sampling_args(logits, temperatures=temperatures, uniforms=uniforms, top_k=top_k,
                        top_p=top_p, min_p=min_p)
    out = _native(logits, temperatures, uniforms, top_k, top_p, min_p)
    if out is None:
        return reference.sample_tokens_filtered(logits, temperatures, uniforms, top_k,
                                                top_p, min_p, max_top_k)
    return out
