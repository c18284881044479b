"""store_kv (Triton) must match the reference bit for bit."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, bits, generator, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "num_tokens, hkv, d, bs, src_dtype, cache_dtype, num_blocks",
    [
        (37, 2, 128, 16, BF16, BF16, 3000),
        (5, 1, 80, 8, F32, F32, 64),
        (64, 4, 64, 32, F32, BF16, 500),  # cast on store
        (19, 5, 96, 64, F16, F16, 40),
        (3, 2, 256, 16, BF16, BF16, 2000),
    ],
)
def test_store_kv_exact(num_tokens, hkv, d, bs, src_dtype, cache_dtype, num_blocks):
    g = generator(seed_for(num_tokens, hkv, d, bs, src_dtype, cache_dtype))
    k = randn((num_tokens, hkv, d), src_dtype, g)
    v = randn((num_tokens, hkv, d), src_dtype, g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:num_tokens]
    slots[::4] = -1  # padding tokens are skipped
    slots = slots.to(DEVICE)
    shape = (num_blocks, bs, hkv, d)
    k_cache = randn(shape, cache_dtype, g)
    v_cache = randn(shape, cache_dtype, g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    deepinfer_kernels.store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    if src_dtype != cache_dtype and DEVICE.type == "cpu":
        # The interpreter (triton 3.9) truncates fp32 -> bf16 where torch and compiled
        # Triton round to nearest even: allow one bf16 ulp there, exact everywhere else.
        for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
        return
    assert torch.equal(bits(k_cache), bits(k_ref))
    assert torch.equal(bits(v_cache), bits(v_ref))


def test_store_kv_strided_inputs_and_empty():
    """k/v as head slices of a fused qkv tensor (non-contiguous rows); T == 0 is a no-op."""
    g = generator(1)
    qkv = randn((9, 8 + 2 + 2, 64), F32, g)
    k, v = qkv[:, 8:10], qkv[:, 10:12]
    k_cache = randn((10, 16, 2, 64), F32, g)
    v_cache = randn((10, 16, 2, 64), F32, g)
    slots = torch.tensor([0, 15, 16, 17, 159, -5, 40, 41, 100], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    deepinfer_kernels.store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    deepinfer_kernels.store_kv(k[:0], v[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, k_ref)
