"""RMSNorm, alone or fused with the residual add before it.

A decoder layer normalises twice and adds its residual twice; in plain torch that is about
eight small kernels each time (cast, square, mean, add, rsqrt, two multiplies, cast back).
On a GPU decode step, where the activations are a few hundred KB, each of those kernels
costs its launch and a pass over memory, so one kernel per norm (which also does the add)
is what keeps the layer bound by its weight reads.

The arithmetic is the model's: statistics in fp32, the normalised row cast to the input
dtype before the weight multiplies it (as Hugging Face's RMSNorm does), the residual sum
rounded to the input dtype before it is normalised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, next_pow2, run_launches
from deepinfer_kernels.validation import (
    FLOAT_DTYPES,
    check_positive_float,
    check_runnable_device,
    check_shape,
    check_tensor,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    num_rows, num_cols, eps,
    stride_x, stride_res, stride_out, stride_sum,
    HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < num_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=mask, other=0.0)
        # Rounded to the input dtype first: the model adds in its own dtype.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + r64 * stride_sum + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / num_cols
    normed = (xf * tl.rsqrt(var + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (normed.to(tl.float32) * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y, mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.device:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("x", x)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=device,
                 contiguous=True)
    check_shape("weight", weight, (x.shape[1],))
    check_positive_float("eps", eps)
    return device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over each row, statistics in fp32.

    x: ``[T, H]`` float (fp32/fp16/bf16), unit stride in the last dim (any row stride, so
    a column slice of a fused projection works). weight: ``[H]`` float. Returns a new
    contiguous ``[T, H]`` tensor in x's dtype.
    """
    device = _check(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    if x.numel():
        run_launches(rms_norm_launches(x, None, weight, out, None, eps, Target.of(device)))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x's dtype), then ``rms_norm(s, weight, eps)``.

    x, residual: ``[T, H]`` float of one dtype, unit stride in the last dim. weight:
    ``[H]``. Returns ``(normed, s)``, both new contiguous ``[T, H]`` tensors in x's dtype:
    ``s`` is the next residual.
    """
    device = _check(x, weight, eps)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=device,
                 last_dim_contiguous=True)
    check_shape("residual", residual, x.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=device)
    if x.numel():
        run_launches(rms_norm_launches(x, residual, weight, out, summed, eps,
                                       Target.of(device)))
    return out, summed


def rms_norm_launches(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    summed: torch.Tensor | None,
    eps: float,
    target: Target,
) -> list[Launch]:
    """The launch of ``rms_norm`` / ``add_rms_norm`` for validated, non-empty arguments
    (a pure function of shapes, strides, dtypes and ``target``)."""
    rows, cols = x.shape
    block_h = next_pow2(cols)
    # A whole row per program (the sum needs it); small rows are packed several to a
    # program. ~4K elements per program on GPU, larger ones for the interpreter. The
    # packing depends on the width alone, never on the number of rows, so a row's sum
    # is reduced in the same order whatever the batch: a token's result does not depend
    # on what else is in the step (CUDA-graph padding, other requests).
    per_program = 16384 if target.interpret else 4096
    block_t = max(1, per_program // block_h)
    res = x if residual is None else residual
    dst = out if summed is None else summed
    return [Launch(_rms_norm_kernel, (triton.cdiv(rows, block_t),), (
        x, res, weight, out, dst,
        rows, cols, float(eps),
        x.stride(0), res.stride(0), out.stride(0), dst.stride(0),
    ), dict(
        HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_H=block_h,
        # Whole rows of 4K+ elements: 16 warps keep ~8 fp32 values a thread per tensor
        # (8 warps spilled in fp32 with the residual on Triton 3.6, sm_90).
        num_warps=16 if block_h >= 4096 else 4,
    ))]
