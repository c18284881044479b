"""Small ``triton.jit`` helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.

    UPCAST works around the interpreter multiplying bf16 operands as raw bits; it is
    False for compiled kernels, which keep 16-bit operands for the tensor cores.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def load_kv(cache_ptr, row, d, n_ok, mask, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
            KV_INT8: tl.constexpr, DTYPE: tl.constexpr):
    """A ``[N, D_PAD]`` tile of K or V rows starting at element offsets ``row`` (``[N]``):
    the cache's own values, or (KV_INT8) int8 codes times their fp32 scale per 32 values
    (stored after the row's ``HEAD_DIM`` codes, see ``kv_quant``), cast to DTYPE for the
    ``tl.dot``. ``n_ok`` ``[N]`` marks real rows; ``mask`` ``[N, D_PAD]`` (or broadcast)
    the elements to read; masked elements read 0."""
    if KV_INT8:
        GROUPS: tl.constexpr = D_PAD // 32
        rows: tl.constexpr = row.shape[0]
        codes = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0)
        g = tl.arange(0, GROUPS)
        # Row offsets are multiples of 4 bytes: rows are HEAD_DIM * 9 / 8 bytes.
        scale_ptr = (cache_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptr[:, None] + g[None, :],
                        mask=n_ok[:, None] & (g < HEAD_DIM // 32)[None, :], other=0.0)
        vals = tl.reshape(codes.to(tl.float32), [rows, GROUPS, 32]) * scale[:, :, None]
        return tl.reshape(vals, [rows, D_PAD]).to(DTYPE)
    else:
        return tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
