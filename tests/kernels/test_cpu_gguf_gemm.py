"""The bf16 GEMM that decodes GGUF weight panels in place (``kernels/csrc/
gguf_gemm_bf16_cpu.c``, taken by bf16 activations of 2+ rows): every block type, random
blocks with negative and subnormal fp16 scales, row counts that leave every remainder of
its register tiles (dot form below 8 x rows: 6 rows x 4 columns; outer form from 8: 12
rows x 32 columns) and of its 32-row panels, fresh data per case, poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize

from deepinfer_kernels import cpu_gguf
from deepinfer_kernels.cpu_native import native_library
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
from tests.kernels.gguf_helpers import make_blocks, ragged_k, rng_for

NAMES = [f.name for f in BLOCK_FORMATS.values()]

pytestmark = pytest.mark.skipif(not cpu_gguf.bf16_gemm(),
                                reason="no AVX512-BF16 GEMM in this CPU's native build")

# 53 weight rows: one full 32-row panel, then 21 (five 4-column tiles and a 1-column one
# in the dot form; 16 + 5 masked columns in the outer form).
N = 53


def _case(name: str, m: int, tag: str, n: int = N):
    fmt = BLOCK_FORMATS[GQ[name].value]
    rng = rng_for("cpu-gemm", tag, name, m, n)
    k = ragged_k(fmt)
    raw = make_blocks(fmt, n, k, rng)
    # x rows ldx = k + 32 apart: a view of a wider buffer, as a fused projection's part.
    wide = torch.from_numpy(rng.standard_normal((m, k + 32)).astype(np.float32))
    x = wide.to(torch.bfloat16)[:, 32:]
    # The weights as the kernel multiplies them: decoded, rounded to bf16 once.
    w16 = torch.from_numpy(gguf_dequantize(raw, GQ(fmt.type_id))).to(torch.bfloat16)
    return fmt, raw, x, w16


def _bound(x: torch.Tensor, w16: torch.Tensor, out_rounding: float) -> tuple:
    """The product in float64 and the allowed error: fp32 sums (24 bits, K terms, in any
    order) of exact bf16 x bf16 products, then the output's own rounding."""
    xd, wd = x.double(), w16.double()
    want = xd @ wd.T
    bound = (xd.abs() @ wd.abs().T) * (x.shape[1] * 2.0**-24) + want.abs() * out_rounding
    return want, bound


@pytest.mark.parametrize("m, n", [(2, N), (5, N), (7, N), (8, N), (13, N), (32, N),
                                  (37, N), (47, N), (50, N), (40, 63), (3, 63)])
@pytest.mark.parametrize("name", NAMES)
def test_gemm_fp32_out_matches_the_bf16_weights_product(name: str, m: int, n: int):
    """The C entry point, fp32 out: within fp32 summation error of x @ W16.T, where W16
    is the weight rounded to bf16 once (the rounding the tile path makes too). n = 63:
    a last panel of 31 rows, one short of full."""
    fmt, raw, x, w16 = _case(name, m, "fp32", n)
    out = torch.full((m, n + 3), float("nan"))  # rows ldo = n + 3 apart, the tail unwritten
    blocks = torch.from_numpy(raw)
    rc = native_library().gguf_gemm_bf16_cpu(
        x.data_ptr(), m, x.shape[1], x.stride(0), blocks.data_ptr(), n, blocks.stride(0),
        fmt.type_id, out.data_ptr(), out.stride(0), 0, torch.get_num_threads())
    assert rc == 0
    want, bound = _bound(x, w16, 0.0)
    got = out[:, :n].double()
    assert not bool(torch.isnan(got).any())
    assert bool(((got - want).abs() <= bound).all())
    assert bool(torch.isnan(out[:, n:]).all())  # nothing written past n


@pytest.mark.parametrize("m", [3, 4, 6, 40])
@pytest.mark.parametrize("name", NAMES)
def test_bf16_matmul_through_the_gemm(name: str, m: int):
    """``gguf_matmul`` with bf16 x of 2+ rows (up to ``INT8_MAX_M`` rows only for the
    types without the int8 path): the GEMM's bf16 output, one rounding to nearest of the
    fp32 result, into a poisoned ``out``."""
    fmt, raw, x, w16 = _case(name, m, "bf16")
    if m <= cpu_gguf.INT8_MAX_M and fmt.type_id in cpu_gguf.int8_types():
        pytest.skip("up to INT8_MAX_M rows this type takes the int8 path")
    out = torch.full((m, N), float("nan"), dtype=torch.bfloat16)
    y = cpu_gguf.gguf_matmul(x, torch.from_numpy(raw), fmt.type_id, out=out)
    assert y is out
    want, bound = _bound(x, w16, 2.0**-8)
    assert not bool(torch.isnan(y).any())
    assert bool(((y.double() - want).abs() <= bound).all())
    bound_fn = cpu_gguf.bind_gguf_matmul(torch.from_numpy(raw), fmt.type_id)
    assert torch.equal(bound_fn(x), y)


def test_gemm_refuses_a_type_it_does_not_know():
    x = torch.ones(4, 32, dtype=torch.bfloat16)
    out = torch.empty(4, 2)
    w = torch.ones(2, 34, dtype=torch.uint8)
    rc = native_library().gguf_gemm_bf16_cpu(x.data_ptr(), 4, 32, 32, w.data_ptr(), 2, 34,
                                             99, out.data_ptr(), 2, 0, 1)
    assert rc == 1  # BAD_TYPE, as every GGUF kernel
