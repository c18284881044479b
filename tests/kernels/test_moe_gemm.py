"""fused_moe_gemm (the grouped GEMM, interpreted on CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, assert_close, generator, randn, seed_for
from tests.kernels.moe_helpers import routing

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("num_tokens, num_experts, top_k, n, k, per_token, mul, gated, dtype", [
    (7, 5, 2, 40, 48, True, True, False, F32),  # K and N not multiples of the tiles
    (7, 5, 2, 24, 32, True, False, True, F32),  # gated (gate+up, SiLU-and-mul)
    (5, 7, 1, 32, 40, False, True, False, BF16),
    (4, 9, 8, 16, 24, False, True, False, F32),  # top-8, per-pair input
    (12, 6, 2, 20, 64, True, True, True, BF16),
])
def test_gemm_matches_reference(num_tokens, num_experts, top_k, n, k, per_token, mul, gated,
                                dtype):
    g = generator(seed_for("gemm", num_tokens, num_experts, top_k, n, k, per_token, gated,
                           dtype))
    weights, ids = routing(num_tokens, num_experts, top_k, g)
    pairs = num_tokens * top_k
    a = randn((num_tokens if per_token else pairs, k), dtype, g)
    w = (randn((num_experts, 2 * n if gated else n, k), F32, g) * k**-0.5).to(dtype)
    align = deepinfer_kernels.moe_align(ids, num_experts, 16)
    out = torch.full((pairs, n), float("nan"), dtype=dtype, device=DEVICE)
    got = deepinfer_kernels.fused_moe_gemm(a, w, *align, weights if mul else None, out, top_k, mul,
                                 gated=gated)
    assert got is out
    want = reference.fused_moe_gemm(a, w, *align, weights, torch.empty_like(out), top_k, mul,
                                    gated=gated)
    assert_close(out, want, dtype)


def test_gemm_leaves_rows_of_dropped_pairs_alone():
    """A pair whose expert id is out of range is dropped by the alignment; its row of out
    keeps what it held (nothing reads or writes out of bounds)."""
    g = generator(3)
    ids = torch.tensor([[0, 9], [1, 2]], dtype=torch.int32, device=DEVICE)
    a = randn((2, 32), F32, g)
    w = randn((3, 16, 32), F32, g)
    out = torch.full((4, 16), float("nan"), device=DEVICE)
    aligned = deepinfer_kernels.moe_align(ids, 3, 16)
    deepinfer_kernels.fused_moe_gemm(a, w, *aligned, None, out, 2, False)
    assert torch.isnan(out[1]).all()
    torch.testing.assert_close(out[[0, 2, 3]], torch.stack([a[0] @ w[0].T, a[1] @ w[1].T,
                                                            a[1] @ w[2].T]))


def test_gemm_strided_activation_rows():
    """a with a row stride wider than K (a view into a bigger buffer)."""
    g = generator(4)
    weights, ids = routing(6, 4, 2, g)
    big = randn((6, 80), F32, g)
    a = big[:, 8:40]
    w = randn((4, 24, 32), F32, g)
    align = deepinfer_kernels.moe_align(ids, 4, 32)
    out = torch.full((12, 24), float("nan"), device=DEVICE)
    deepinfer_kernels.fused_moe_gemm(a, w, *align, weights, out, 2, True)
    want = reference.fused_moe_gemm(a, w, *align, weights, torch.empty_like(out), 2, True)
    assert_close(out, want, F32)
