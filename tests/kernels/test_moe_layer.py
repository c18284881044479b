"""fused_moe (alignment + two grouped GEMMs + sum over k) against the per-expert torch loop
(``deepinfer_kernels.reference.fused_moe``), which is itself checked against a dense fp64 oracle."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, assert_close, generator, randn, seed_for
from tests.kernels.moe_helpers import dense_oracle, experts, routing

F32, BF16 = torch.float32, torch.bfloat16


def _run(x, w13, w2, weights, ids, dtype):
    out = torch.full_like(x, float("nan"))
    got = deepinfer_kernels.fused_moe(x, w13, w2, weights, ids, out=out)
    assert got is out
    want = reference.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, want, dtype)
    return out


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter, kind, dtype", [
    (6, 5, 2, 48, 40, "random", F32),
    (3, 7, 1, 32, 24, "random", BF16),
    (4, 16, 8, 32, 16, "random", F32),  # top-8
    (20, 7, 2, 32, 32, "hot", F32),  # expert 2 gets most of the 40 pairs (3 blocks)
    (9, 7, 2, 40, 24, "only", BF16),  # four experts get no token
])
def test_fused_moe_matches_per_expert_loop(num_tokens, num_experts, top_k, hidden, inter,
                                           kind, dtype):
    g = generator(seed_for("moe", num_tokens, num_experts, top_k, hidden, inter, kind, dtype))
    weights, ids = routing(num_tokens, num_experts, top_k, g,
                           hot=[2] if kind == "hot" else None,
                           only=[0, 3, 5] if kind == "only" else None)
    x = randn((num_tokens, hidden), dtype, g)
    w13, w2 = experts(num_experts, hidden, inter, dtype, g)
    _run(x, w13, w2, weights, ids, dtype)


def test_reference_matches_dense_oracle():
    g = generator(11)
    weights, ids = routing(7, 6, 3, g, hot=[1])
    x = randn((7, 24), F32, g)
    w13, w2 = experts(6, 24, 16, F32, g)
    want = dense_oracle(x, w13, w2, weights, ids)
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, weights, ids).double(), want,
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_then_fused_moe(renormalize):
    """The whole layer as a model runs it: router logits -> moe_route -> fused_moe."""
    g = generator(seed_for("chain", renormalize))
    x = randn((5, 32), F32, g)
    router = randn((32, 7), F32, g)
    w13, w2 = experts(7, 32, 24, F32, g)
    logits = x @ router
    weights, ids = deepinfer_kernels.moe_route(logits, 2, renormalize)
    out = deepinfer_kernels.fused_moe(x, w13, w2, weights, ids)
    rw, ri = reference.moe_route(logits, 2, renormalize)
    assert_close(out, reference.fused_moe(x, w13, w2, rw, ri), F32)


@pytest.mark.parametrize("seed", range(4))
def test_property_random_routings(seed):
    """Random shapes and skewed random routings: the fused path equals the per-expert
    loop (fp32) and the dense oracle."""
    g = generator(seed_for("property", seed))
    num_experts = int(torch.randint(1, 10, (1,), generator=g))
    top_k = int(torch.randint(1, min(num_experts, 4) + 1, (1,), generator=g))
    num_tokens = int(torch.randint(1, 25, (1,), generator=g))
    hidden = int(torch.randint(8, 49, (1,), generator=g))
    inter = int(torch.randint(8, 33, (1,), generator=g))
    hot = [int(torch.randint(0, num_experts, (1,), generator=g))] if seed % 2 else None
    weights, ids = routing(num_tokens, num_experts, top_k, g, hot=hot)
    x = randn((num_tokens, hidden), F32, g)
    w13, w2 = experts(num_experts, hidden, inter, F32, g)
    out = _run(x, w13, w2, weights, ids, F32)
    torch.testing.assert_close(out.double(), dense_oracle(x, w13, w2, weights, ids),
                               atol=2e-5, rtol=1e-5)


def test_fused_moe_no_tokens():
    w13, w2 = experts(3, 16, 16, F32, generator(1))
    x = torch.empty((0, 16), device=DEVICE)
    out = deepinfer_kernels.fused_moe(x, w13, w2, torch.empty((0, 2), device=DEVICE),
                            torch.empty((0, 2), dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 16)
