"""``deepinfer_kernels.cpu_dense.dense_linear``: fp32 products of 2 to
``F32_SWAPPED_MAX_M`` rows run with the operands swapped, everything else through
``F.linear``; both give ``F.linear``'s values (to fp32 sum order), contiguous, with the
bias added once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.models.parallel_layers import Embedding, Linear
from deepinfer_kernels.cpu_dense import F32_SWAPPED_MAX_M, dense_linear


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("m", [1, 2, 7, F32_SWAPPED_MAX_M, F32_SWAPPED_MAX_M + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_rows_match_f_linear(m: int, with_bias: bool):
    x, w, b = _inputs(m, 37, 96, torch.float32, seed=m)
    bias = b if with_bias else None
    got = dense_linear(x, w, bias)
    want = F.linear(x, w, bias)
    assert got.shape == (m, 37) and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_shapes_are_f_linear_itself():
    x, w, b = _inputs(5, 16, 32, torch.bfloat16, seed=1)
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))
    x3 = torch.randn(2, 3, 32)  # not [M, K]
    w32 = torch.randn(16, 32)
    assert torch.equal(dense_linear(x3, w32), F.linear(x3, w32))


def test_layers_take_it_for_fp32_weights():
    """Linear.forward / product and the tied output projection give F.linear's values
    through the swapped product (fp32, 6 rows)."""
    x, w, b = _inputs(6, 24, 40, torch.float32, seed=3)
    lin = Linear(40, 24, bias=True)
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    emb = Embedding(24, 40)
    emb.weight.data.copy_(w)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.product(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(emb.attend(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
