"""clone_blocks / zero_states / clone_states (Triton) must match the reference exactly."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, bits, generator, randn


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_clone_blocks_exact(dtype, index_dtype):
    g = generator(2)
    cache = randn((3, 2, 40, 16, 2, 64), dtype, g)
    cache[1, 0, 5, 3] = float("nan")  # NaN payloads copy bit-exactly
    # One src to several dsts; dsts are never srcs (copy-on-write targets are fresh blocks).
    pairs = torch.tensor([[5, 30], [5, 31], [7, 32], [0, 39], [12, 20]], dtype=index_dtype,
                         device=DEVICE)
    want = cache.clone()
    reference.clone_blocks(want, pairs)
    deepinfer_kernels.clone_blocks(cache, pairs)
    assert torch.equal(bits(cache), bits(want))


def test_clone_blocks_many_pairs_and_empty():
    g = generator(4)
    cache = randn((2, 2, 3000, 8, 1, 80), torch.float16, g)
    perm = torch.randperm(3000, generator=g)
    pairs = torch.stack([perm[:300], perm[300:600]], dim=1).to(DEVICE)
    want = cache.clone()
    reference.clone_blocks(want, pairs)
    deepinfer_kernels.clone_blocks(cache, pairs)
    assert torch.equal(cache, want)
    deepinfer_kernels.clone_blocks(cache, pairs[:0])
    assert torch.equal(cache, want)


def _states(g: torch.Generator) -> list[torch.Tensor]:
    return [
        randn((9, 3, 5), torch.float32, g),
        randn((9, 7), torch.bfloat16, g),
        torch.randint(1, 100, (9,), generator=g).to(DEVICE),  # int64, 8-byte rows
        (torch.rand((9, 3), generator=g) > 0.5).to(DEVICE),  # bool, 3-byte rows
        randn((9, 2, 2, 33), torch.float16, g),
    ]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_zero_states_exact(index_dtype):
    g = generator(5)
    states = _states(g)
    want = [s.clone() for s in states]
    slots = torch.tensor([0, 4, 8], dtype=index_dtype, device=DEVICE)
    deepinfer_kernels.zero_states(states, slots)
    reference.zero_states(want, slots)
    for got, exp in zip(states, want):
        assert torch.equal(got, exp)
    deepinfer_kernels.zero_states(states, slots[:0])
    deepinfer_kernels.zero_states([], slots)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_clone_states_exact(index_dtype):
    g = generator(6)
    states = _states(g)
    want = [s.clone() for s in states]
    pairs = torch.tensor([[1, 2], [1, 3], [7, 0]], dtype=index_dtype, device=DEVICE)
    deepinfer_kernels.clone_states(states, pairs)
    reference.clone_states(want, pairs)
    for got, exp in zip(states, want):
        assert torch.equal(got, exp)
