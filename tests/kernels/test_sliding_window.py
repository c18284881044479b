"""Sliding-window attention (``window``: query position ``p`` sees keys ``p - window + 1 ..
p``) in every backend: the torch reference against a per-query softmax written out here;
the C decode kernels (wide and general) and the C prefill kernel, and the Triton decode
(unsplit and split) and prefill kernels (interpreted on CPU), against the reference; on
float and int8 caches, windows from 1 to past the longest sequence, windows that start
mid-block and mid-tile.

Caches are make_paged_kv's (NaN outside the live tokens and in the spare table columns'
blocks), so a read past a sequence's end shows as NaN; outputs are NaN-poisoned; fresh
random data per case.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import cpu_backend, cpu_native, cpu_prefill, reference
from deepinfer_kernels.kv_quant import quantize_kv
from tests.kernels.helpers import (
    DEVICE,
    assert_close,
    cache_rows,
    cpu_paged_kv,
    generator,
    make_paged_kv,
    randn,
    seed_for,
)

F32, BF16 = torch.float32, torch.bfloat16
WINDOWS = [1, 5, 16, 37, 1000]


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int,
           scale: float) -> torch.Tensor:
    """One query ``[Hq, D]`` at position ``pos`` over keys ``max(0, pos - window + 1) ..
    pos`` of ``k``/``v`` ``[n, Hkv, D]``: a softmax written out, fp64."""
    lo = max(0, pos - window + 1)
    group = q.shape[0] // k.shape[1]
    kk = k[lo:pos + 1].double().repeat_interleave(group, dim=1)  # [m, Hq, D]
    vv = v[lo:pos + 1].double().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,mhd->hm", q.double(), kk) * scale
    return torch.einsum("hm,mhd->hd", torch.softmax(s, dim=-1), vv)


def _decode(fn, q, kv, window, **kw):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out=out,
             window=window, **kw)
    assert got is out
    return got


def _prefill(fn, q, kv, starts, window):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, out=out,
             window=window)
    assert got is out
    return got


@pytest.mark.parametrize("window", [1, 6, 13])
def test_reference_sees_the_last_window_keys(window):
    g = generator(seed_for("window-reference", window))
    hq, hkv, d, bs = 4, 2, 16, 4
    q_lens, prefix = [5, 9, 1], [0, 11, 20]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = cpu_paged_kv(lens, bs, hkv, d, F32, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = randn((int(starts[-1]), hq, d), F32, g).cpu()
    got = _prefill(reference.paged_prefill_attention, q, kv, starts, window)
    for b, n in enumerate(lens):
        k = cache_rows(kv.k_cache, kv.block_tables[b], n)
        v = cache_rows(kv.v_cache, kv.block_tables[b], n)
        for i in range(q_lens[b]):
            want = _naive(q[starts[b] + i], k, v, prefix[b] + i, window, d**-0.5)
            torch.testing.assert_close(got[starts[b] + i].double(), want, atol=1e-5, rtol=0)
    qd = torch.randn((3, hq, d), generator=generator(1))
    dec = _decode(reference.paged_decode_attention, qd, kv, window)
    for b, n in enumerate(lens):
        k = cache_rows(kv.k_cache, kv.block_tables[b], n)
        v = cache_rows(kv.v_cache, kv.block_tables[b], n)
        torch.testing.assert_close(dec[b].double(), _naive(qd[b], k, v, n - 1, window,
                                                           d**-0.5), atol=1e-5, rtol=0)


needs_cc = pytest.mark.skipif(cpu_native.native_library() is None,
                              reason="needs the native CPU kernels (a C compiler)")


@needs_cc
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("d, hq, hkv, kind", [
    pytest.param(64, 9, 3, "f32", id="wide-d64-f32"),
    pytest.param(128, 8, 2, "bf16", id="wide-d128-bf16"),
    pytest.param(64, 4, 4, "int8", id="wide-d64-int8"),
    pytest.param(40, 6, 2, "f32", id="narrow-d40-f32"),
    pytest.param(24, 2, 1, "bf16", id="narrow-d24-bf16")])
def test_c_decode_matches_reference(d, hq, hkv, kind, window):
    g = generator(seed_for("window-c-decode", d, hq, hkv, kind, window))
    dtype = BF16 if kind == "bf16" else F32
    lens = [300, 1, 21, 32, 37, 0, 16]
    kv = cpu_paged_kv(lens, 16, hkv, d, dtype, g, int8=kind == "int8")
    q = randn((len(lens), hq, d), dtype, g).cpu()
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got = _decode(cpu_backend.paged_decode_attention, q, kv, window)
    want = _decode(reference.paged_decode_attention, q, kv, window)
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # length 0: zeros
    assert_close(got, want, dtype)


@needs_cc
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("d, hq, hkv, kind", [
    pytest.param(64, 6, 2, "f32", id="d64-f32"),
    pytest.param(128, 4, 1, "bf16", id="d128-bf16"),
    pytest.param(64, 4, 2, "int8", id="d64-int8")])
def test_c_prefill_matches_reference(d, hq, hkv, kind, window):
    g = generator(seed_for("window-c-prefill", d, hq, hkv, kind, window))
    dtype = BF16 if kind == "bf16" else F32
    q_lens, prefix = [40, 1, 17, 3], [0, 50, 9, 70]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = cpu_paged_kv(lens, 16, hkv, d, dtype, g, int8=kind == "int8")
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = randn((int(starts[-1]), hq, d), dtype, g).cpu()
    assert cpu_prefill.can_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables)
    got = _prefill(cpu_backend.paged_prefill_attention, q, kv, starts, window)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts, window)
    assert_close(got, want, dtype)


def test_a_bad_window_is_named():
    g = generator(seed_for("window-bad"))
    kv = cpu_paged_kv([5], 4, 1, 16, F32, g)
    q = randn((1, 2, 16), F32, g).cpu()
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="window"):
            _decode(reference.paged_decode_attention, q, kv, bad)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [1, 7, 40, 1000])
@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_triton_decode_matches_reference(window, splits, int8):
    g = generator(seed_for("window-triton-decode", window, splits, int8))
    lens = [75, 1, 20, 0]
    kv = make_paged_kv(lens, 16, 2, 32, F32, g)
    if int8:
        kv.k_cache, kv.v_cache = quantize_kv(kv.k_cache), quantize_kv(kv.v_cache)
    q = randn((len(lens), 4, 32), F32, g)
    got = _decode(deepinfer_kernels.paged_decode_attention, q, kv, window, num_splits=splits)
    want = _decode(reference.paged_decode_attention, q, kv, window)
    assert_close(got.cpu(), want.cpu(), F32)


@pytest.mark.parametrize("window", [1, 9, 40, 1000])
def test_triton_prefill_matches_reference(window):
    g = generator(seed_for("window-triton-prefill", window))
    q_lens, prefix = [70, 1, 12], [0, 30, 45]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = make_paged_kv(lens, 16, 2, 32, F32, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int().to(DEVICE)
    q = randn((int(starts[-1]), 4, 32), F32, g)
    got = _prefill(deepinfer_kernels.paged_prefill_attention, q, kv, starts, window)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts, window)
    assert_close(got.cpu(), want.cpu(), F32)
