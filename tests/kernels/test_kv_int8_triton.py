"""The Triton kernels over an int8 KV cache (``kv_cache_dtype="int8"`` with
``attention_backend="triton"``): ``store_kv`` quantizes into the same bytes as the torch
reference (``kv_quant.quantize_kv``), and decode (unsplit and split) and prefill read it as
the reference does on the same int8 caches.

Interpreted on CPU (``TRITON_INTERPRET=1``, set by tests/conftest.py), compiled on a GPU.
Fresh random data per case; attention caches are make_paged_kv's float caches (NaN outside
the live tokens and in the spare table columns' blocks) quantized whole, so a read past a
sequence's end shows as NaN; outputs are NaN-poisoned; store caches start as random bytes.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.kv_quant import kv_row_width, quantize_kv
from tests.kernels.helpers import (
    DEVICE,
    assert_close,
    generator,
    make_paged_kv,
    randn,
    seed_for,
)

F32, BF16, F16, I8 = torch.float32, torch.bfloat16, torch.float16, torch.int8


def _random_bytes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=g, dtype=I8).to(DEVICE)


def _groups_of_many_sizes(t: int, hkv: int, d: int, dtype: torch.dtype,
                          g: torch.Generator) -> torch.Tensor:
    """K/V rows whose 32-value groups span ~1e-6..1e4 in size, one group all negative."""
    x = torch.randn((t, hkv, d), generator=g)
    mags = torch.tensor([1e4, 1.0, 3e-3, 1e-6, 0.25, 7e2, 40.0, 2.0])[:d // 32]
    x = (x.unflatten(-1, (-1, 32)) * mags[:, None]).flatten(-2)
    x[..., :32] = -x[..., :32].abs()
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("d, hkv, bs", [pytest.param(64, 2, 16, id="d64-hkv2-bs16"),
                                        pytest.param(96, 1, 8, id="d96-bs8"),
                                        pytest.param(128, 3, 16, id="d128-hkv3")])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_store_writes_the_reference_bytes(dtype, d, hkv, bs):
    g = generator(seed_for("kv-int8-triton-store", dtype, d, hkv, bs))
    t, nb = 11, 4
    k = _groups_of_many_sizes(t, hkv, d, dtype, g)
    v = randn((t, hkv, d), dtype, g)
    # A tie (2.5 steps) and a NaN group in token 0, a zero group in token 1, a subnormal
    # one in token 2 (its scale rounds coarsely, so x / scale passes 127: the clamp);
    # padding (-1) and an out-of-range slot (dropped on the device) among real ones.
    k[0, 0, 32:64] = torch.linspace(-1, 1, 32, device=DEVICE).to(dtype)
    k[0, 0, 33] = 2.5 / 127
    k[0, 0, 34] = 1.0
    v[0, hkv - 1, 40] = float("nan")
    v[1, 0, :32] = 0.0
    k[2, 0, 32:64] = (torch.randn(32, generator=g) * 1e-42).to(dtype).to(DEVICE)
    slots = torch.tensor([5, 0, 63, -1, 17, 2, 40, 9, 31, 1000, 48], device=DEVICE)
    shape = (nb, bs, hkv, kv_row_width(d, "int8"))
    caches = [_random_bytes(shape, g) for _ in range(2)]
    want = [c.clone() for c in caches]
    deepinfer_kernels.store_kv(k, v, caches[0], caches[1], slots)
    live = (slots >= 0) & (slots < nb * bs)
    reference.store_kv(k[live], v[live], want[0], want[1], slots[live])
    assert torch.equal(caches[0], want[0])
    assert torch.equal(caches[1], want[1])
    # The NaN group reads back as NaN, exactly there.
    row = caches[1].view(-1, hkv, shape[-1])[5, hkv - 1].cpu()
    scales = row[d:].contiguous().view(F32)
    assert torch.isnan(scales[1]) and not torch.isnan(scales[torch.arange(d // 32) != 1]).any()


def test_store_refuses_a_head_dim_that_is_not_whole_groups():
    g = generator(seed_for("kv-int8-triton-store-bad"))
    k = randn((2, 1, 48), F32, g)
    cache = _random_bytes((2, 8, 1, 54), g)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"k_cache: .*multiple of 32"):
        deepinfer_kernels.store_kv(k, k, cache, cache.clone(),
                                   torch.tensor([0, 1], device=DEVICE))
    assert torch.equal(cache, before)


def _int8_paged_kv(lens, bs, hkv, d, dtype, g):
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g)
    kv.k_cache, kv.v_cache = quantize_kv(kv.k_cache), quantize_kv(kv.v_cache)
    return kv


@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split3"])
@pytest.mark.parametrize("d, hq, hkv, bs", [pytest.param(64, 6, 2, 16, id="d64-gqa3"),
                                            pytest.param(128, 4, 4, 8, id="d128-mha-bs8"),
                                            pytest.param(96, 2, 1, 16, id="d96-gqa2")])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_decode_matches_reference(dtype, d, hq, hkv, bs, num_splits):
    g = generator(seed_for("kv-int8-triton-decode", dtype, d, hq, hkv, bs, num_splits))
    lens = [70, 1, 0, 2 * bs + 3]
    kv = _int8_paged_kv(lens, bs, hkv, d, dtype, g)
    q = randn((len(lens), hq, d), dtype, g)
    outs = []
    for fn in (deepinfer_kernels.paged_decode_attention, reference.paged_decode_attention):
        out = torch.full_like(q, float("nan"))
        fn(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out=out,
           num_splits=num_splits)
        outs.append(out)
    assert torch.equal(outs[0][2], torch.zeros_like(outs[0][2]))  # seq_len 0: zeros
    assert_close(outs[0], outs[1], dtype)


@pytest.mark.parametrize("hq, hkv, d, bs, q_lens, prefix", [
    pytest.param(4, 2, 64, 16, [37, 1], [70, 5], id="d64-gqa2-bs16"),
    pytest.param(2, 2, 96, 8, [9, 33], [0, 16], id="d96-mha-bs8"),
])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_prefill_matches_reference(dtype, hq, hkv, d, bs, q_lens, prefix):
    g = generator(seed_for("kv-int8-triton-prefill", dtype, hq, hkv, d, bs, q_lens, prefix))
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = _int8_paged_kv(lens, bs, hkv, d, dtype, g)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    q = randn((int(starts[-1]), hq, d), dtype, g)
    outs = []
    for fn in (deepinfer_kernels.paged_prefill_attention, reference.paged_prefill_attention):
        out = torch.full_like(q, float("nan"))
        fn(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, out=out)
        outs.append(out)
    assert_close(outs[0], outs[1], dtype)


def test_attention_refuses_a_cache_row_that_does_not_fit_the_head_dim():
    g = generator(seed_for("kv-int8-triton-bad-width"))
    kv = _int8_paged_kv([5], 8, 1, 64, F32, g)
    q = randn((1, 2, 64), F32, g)
    narrow = kv.k_cache[..., :70].contiguous()
    with pytest.raises(ValueError, match=r"k_cache: expected last dim 72"):
        deepinfer_kernels.paged_decode_attention(q, narrow, narrow, kv.block_tables,
                                                 kv.seq_lens)
