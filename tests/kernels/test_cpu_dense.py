"""The dense bf16 GEMM (``deepinfer_kernels.cpu_dense``: a plain bf16 weight read in
place) against fp32 products on random data: every row count of the micro-kernels, a
last group of fewer than four weight rows, strided x and weight rows; the binding's
fall-backs and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels import cpu_dense, cpu_gguf

pytestmark = pytest.mark.skipif(not cpu_gguf.bf16_gemm(),
                                reason="no AVX512-BF16 build of the native kernels")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16 output: one rounding of the fp32 sum (2^-8 relative) plus the sum order.
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("n", [4, 37, 70])
def test_dense_matmul_matches_fp32(m, n):
    g = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, 96, generator=g).bfloat16()
    w = (torch.randn(n, 96, generator=g) * 0.1).bfloat16()
    _close(cpu_dense.dense_matmul(x, w), _reference(x, w))


def test_strided_rows_of_x_and_weight():
    g = torch.Generator().manual_seed(5)
    xw = torch.randn(7, 160, generator=g).bfloat16()
    ww = torch.randn(33, 192, generator=g).bfloat16()
    x, w = xw[:, :128], ww[:, 32:160]  # rows 160 and 192 elements apart
    assert cpu_dense.dense_gemm_usable(w)
    _close(cpu_dense.dense_matmul(x, w), _reference(x, w))


def test_binding_uses_the_kernel_below_dense_max_m_and_torch_above():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 64, generator=g).bfloat16()
    fn = cpu_dense.bind_dense_matmul(w)
    assert fn is not None
    small = torch.randn(3, 64, generator=g).bfloat16()
    assert torch.equal(fn(small), cpu_dense.dense_matmul(small, w))
    big = torch.randn(cpu_dense.DENSE_MAX_M, 64, generator=g).bfloat16()
    assert torch.equal(fn(big), F.linear(big, w))
    with pytest.raises(RuntimeError, match="same dtype"):  # as F.linear itself
        fn(torch.randn(2, 64, generator=g))
    _close(fn(small), _reference(small, w))


def test_binding_follows_a_swapped_parameter_storage():
    g = torch.Generator().manual_seed(11)
    layer = torch.nn.Linear(64, 24, bias=False).to(torch.bfloat16).requires_grad_(False)
    fn = cpu_dense.bind_dense_matmul(layer.weight)
    new = torch.randn(24, 64, generator=g).bfloat16()
    layer.weight.data = new  # what loading with adopt=True does
    x = torch.randn(2, 64, generator=g).bfloat16()
    _close(fn(x), _reference(x, new))


@pytest.mark.parametrize("weight", [
    torch.randn(8, 64),  # fp32
    torch.randn(8, 48).bfloat16(),  # K not a multiple of 32
    torch.randn(64, 8).bfloat16().T,  # columns not contiguous
    torch.randn(2, 8, 64).bfloat16(),  # not 2-D
])
def test_weights_the_kernel_does_not_read_are_left_to_torch(weight):
    assert not cpu_dense.dense_gemm_usable(weight)
    assert cpu_dense.bind_dense_matmul(weight) is None
