"""SiLU-and-mul of the gated MLP: ``silu(gate) * up`` from the fused gate+up projection,
in one pass (torch takes three kernels: chunk views, silu, multiply, with the silu result
written out and read back)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, next_pow2, run_launches
from deepinfer_kernels.validation import FLOAT_DTYPES, check_runnable_device, check_tensor


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, num_rows, width, stride_x, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + r64 * stride_x + width + cols[None, :], mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounded to the model dtype before the multiply, as torch's two ops round.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last dim.

    gate_up: ``[T, 2I]`` float (fp32/fp16/bf16), unit stride in the last dim. Returns a
    new contiguous ``[T, I]`` tensor in its dtype.
    """
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError("gate_up: expected an even last dim (gate then up), got shape "
                         f"{tuple(gate_up.shape)}")
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype,
                      device=device)
    if out.numel():
        run_launches(silu_and_mul_launches(gate_up, out, Target.of(device)))
    return out


def silu_and_mul_launches(gate_up: torch.Tensor, out: torch.Tensor,
                          target: Target) -> list[Launch]:
    """The launch of ``silu_and_mul`` for validated, non-empty arguments (a pure function
    of shapes, strides, dtypes and ``target``)."""
    rows, width = out.shape
    block_i = min(next_pow2(width), 1024)
    per_program = 16384 if target.interpret else 2048
    block_t = max(1, min(next_pow2(rows), per_program // block_i))
    grid = (triton.cdiv(rows, block_t), triton.cdiv(width, block_i))
    return [Launch(_silu_and_mul_kernel, grid, (
        gate_up, out, rows, width, gate_up.stride(0), out.stride(0),
    ), dict(BLOCK_T=block_t, BLOCK_I=block_i, num_warps=4))]
