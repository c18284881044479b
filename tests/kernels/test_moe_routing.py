"""moe_route (Triton, interpreted on CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, generator, randn, seed_for


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize, dtype", [
    (5, 7, 1, False, torch.float32),
    (9, 5, 2, True, torch.bfloat16),
    (33, 60, 8, True, torch.float32),  # several programs; E not a power of two
    (4, 128, 8, False, torch.bfloat16),  # bf16 logits: ties are likely among 128
    (3, 1, 1, True, torch.float32),
    (6, 8, 8, False, torch.float16),  # k = E: every expert, in order
])
def test_route_matches_reference(num_tokens, num_experts, top_k, renormalize, dtype):
    g = generator(seed_for("route", num_tokens, num_experts, top_k, renormalize, dtype))
    logits = randn((num_tokens, num_experts), torch.float32, g).mul(3).to(dtype)
    weights, ids = deepinfer_kernels.moe_route(logits, top_k, renormalize)
    ref_w, ref_i = reference.moe_route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(num_tokens, device=DEVICE))
    # Descending, and the chosen experts' logits are the largest ones.
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    kth = logits.float().gather(1, ids.long()).min(1).values
    others = logits.float().scatter(1, ids.long(), float("-inf")).max(1).values
    assert (kth >= others).all()


def test_route_ties_pick_lowest_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]],
                          device=DEVICE)
    weights, ids = deepinfer_kernels.moe_route(logits, 2, False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights[1], torch.full((2,), 0.2, device=DEVICE))


def test_route_nan_logits_keep_ids_in_range():
    """A NaN logit (a NaN hidden state) makes its row's probabilities NaN: the ids still
    name real experts (the lowest, like the reference's), never a padding column, which
    fused_moe's alignment would drop."""
    for num_experts in (5, 8, 16):  # E below its padded width, and equal to it
        logits = randn((3, num_experts), torch.float32, generator(num_experts))
        logits[1, 2] = float("nan")
        _, ids = deepinfer_kernels.moe_route(logits, 2, True)
        _, ref_ids = reference.moe_route(logits, 2, True)
        assert ((ids >= 0) & (ids < num_experts)).all(), ids
        assert ids[1].tolist() == [0, 1]
        assert torch.equal(ids[[0, 2]], ref_ids[[0, 2]])


def test_route_strided_rows_and_no_tokens():
    g = generator(7)
    wide = randn((4, 20), torch.float32, g)
    logits = wide[:, :9]  # row stride 20
    w, i = deepinfer_kernels.moe_route(logits, 3, True)
    rw, ri = reference.moe_route(logits, 3, True)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw)
    w0, i0 = deepinfer_kernels.moe_route(wide[:0], 2, True)
    assert w0.shape == i0.shape == (0, 2)


def test_route_torch_fallback_many_experts():
    """Past MAX_TRITON_EXPERTS the op uses torch.topk: same results on untied data."""
    from deepinfer_kernels.moe_routing import MAX_TRITON_EXPERTS

    g = generator(8)
    logits = randn((3, MAX_TRITON_EXPERTS + 5), torch.float32, g)
    w, i = deepinfer_kernels.moe_route(logits, 4, True)
    rw, ri = reference.moe_route(logits, 4, True)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw)
