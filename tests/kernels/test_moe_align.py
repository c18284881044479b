"""moe_align (Triton, interpreted on CPU): exact layout against the reference, plus the
layout's invariants checked directly."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.moe_align import moe_align_size
from tests.kernels.helpers import DEVICE, generator, seed_for
from tests.kernels.moe_helpers import routing


def _check_layout(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids, block_expert,
                  num_padded) -> None:
    pairs = ids.numel()
    flat = ids.reshape(-1).long().cpu()
    s, b, total = sorted_ids.cpu().long(), block_expert.cpu().long(), int(num_padded[0])
    assert s.numel() == moe_align_size(pairs, num_experts, block_m)
    assert b.numel() * block_m == s.numel()
    assert total % block_m == 0 and total <= s.numel()
    assert (s[total:] == pairs).all() and (b[total // block_m:] == -1).all()
    # Every valid pair exactly once, in the block of its expert, ascending within it.
    valid = s[:total][s[:total] < pairs]
    keep = torch.arange(pairs)[(flat >= 0) & (flat < num_experts)]
    assert torch.equal(valid.sort().values, keep)
    block_of = b.repeat_interleave(block_m)[:total]
    real = s[:total] < pairs
    assert torch.equal(flat[s[:total][real]], block_of[real])
    for e in range(num_experts):
        rows = s[:total][(block_of == e) & real]
        assert torch.equal(rows, rows.sort().values)
        count = int((flat == e).sum())
        assert int((block_of == e).sum()) == -(-count // block_m) * block_m


def _compare(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    got = deepinfer_kernels.moe_align(ids, num_experts, block_m)
    want = reference.moe_align(ids, num_experts, block_m)
    for name, a, b in zip(("sorted_ids", "block_expert", "num_padded"), got, want):
        assert a.dtype == torch.int32, name
        assert torch.equal(a, b), name
    _check_layout(ids, num_experts, block_m, *got)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, kind", [
    (9, 5, 2, 16, "random"),
    (13, 7, 1, 16, "random"),
    (6, 9, 8, 16, "random"),  # top-8
    (40, 7, 2, 16, "hot"),  # 80 pairs over several chunks, one expert takes most
    (11, 7, 2, 32, "only"),  # experts 0, 2, 3, 5 get no token
    (5, 1, 1, 16, "random"),
    (3, 128, 8, 16, "random"),  # decode-like: more experts than pairs
])
def test_align_matches_reference(num_tokens, num_experts, top_k, block_m, kind):
    g = generator(seed_for("align", num_tokens, num_experts, top_k, block_m, kind))
    _, ids = routing(num_tokens, num_experts, top_k, g,
                     hot=[3] if kind == "hot" else None,
                     only=[1, 4, 6] if kind == "only" else None)
    _compare(ids, num_experts, block_m)


def test_align_all_pairs_on_one_expert_and_duplicates():
    """Every pair on expert 2 (more than a block of them), and repeated ids in a row."""
    ids = torch.full((20, 2), 2, dtype=torch.int32, device=DEVICE)
    _compare(ids, 5, 16)
    ids[::3, 1] = 4
    _compare(ids, 5, 16)


def test_align_drops_out_of_range_ids():
    ids = torch.tensor([[0, 5], [-1, 2], [4, 7]], dtype=torch.int32, device=DEVICE)
    _compare(ids, 5, 16)


def test_align_no_tokens():
    ids = torch.empty((0, 2), dtype=torch.int32, device=DEVICE)
    s, b, n = deepinfer_kernels.moe_align(ids, 4, 16)
    assert s.numel() == 0 and b.numel() == 0 and int(n[0]) == 0
