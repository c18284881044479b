"""oneDNN-packed copies of bf16 weights (``deepinfer_kernels.cpu_prepacked``) and the
dense binding's use of them (``cpu_dense.bind_dense_matmul(weight, packed)``), against
fp32 products on random data: made on first use, made again when the weight changes (a
swapped storage, an in-place write), the row counts each path takes, what is refused."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import cpu_dense, cpu_gguf
from deepinfer_kernels.cpu_prepacked import PackedWeight, prepack_available

pytestmark = pytest.mark.skipif(not prepack_available(),
                                reason="no oneDNN bf16 packed linear in this torch")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().T


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16 output: one rounding of the fp32 sum (2^-8 relative) plus the sum order.
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 7, 64, 200])
@pytest.mark.parametrize("n,k", [(24, 64), (70, 96)])
def test_packed_product_matches_fp32(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = PackedWeight(w)
    assert packed.nbytes == 0  # nothing held before the first product
    _close(packed.matmul(x), _reference(x, w))
    assert packed.nbytes >= n * k * 2


def test_a_swapped_storage_and_an_in_place_write_are_followed():
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(64, 40, bias=False).to(torch.bfloat16).requires_grad_(False)
    packed = PackedWeight(layer.weight)
    x = torch.randn(9, 64, generator=g).bfloat16()
    _close(packed.matmul(x), _reference(x, layer.weight))
    new = torch.randn(40, 64, generator=g).bfloat16()
    layer.weight.data = new  # what loading with adopt=True does
    _close(packed.matmul(x), _reference(x, new))
    with torch.no_grad():
        layer.weight.mul_(-3.0)  # written in place: the version counter moves
    _close(packed.matmul(x), _reference(x, new))
    assert torch.equal(new, layer.weight)


@pytest.mark.parametrize("weight", [
    torch.randn(8, 64),  # fp32
    torch.randn(2, 8, 64).bfloat16(),  # not 2-D
])
def test_weights_it_does_not_pack_are_refused(weight):
    with pytest.raises(ValueError, match="2-D bfloat16 CPU weight"):
        PackedWeight(weight)


@pytest.mark.skipif(not cpu_gguf.bf16_gemm(), reason="no AVX512-BF16 build of the kernels")
def test_binding_sends_batched_rows_to_the_packed_copy():
    g = torch.Generator().manual_seed(17)
    w = torch.randn(48, 64, generator=g).bfloat16()
    packed = PackedWeight(w)
    fn = cpu_dense.bind_dense_matmul(w, packed)
    assert fn is not None
    few = torch.randn(cpu_dense.PACKED_MIN_M - 1, 64, generator=g).bfloat16()
    assert torch.equal(fn(few), cpu_dense.dense_matmul(few, w))
    assert packed.nbytes == 0  # the few rows never made the copy
    for m in (cpu_dense.PACKED_MIN_M, cpu_dense.DENSE_MAX_M + 30):
        many = torch.randn(m, 64, generator=g).bfloat16()
        assert torch.equal(fn(many), packed.matmul(many))
        _close(fn(many), _reference(many, w))
    assert packed.nbytes > 0
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    assert fn(empty).shape == (0, 48)
