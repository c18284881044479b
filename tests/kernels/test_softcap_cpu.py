"""Attention logit soft-capping (Gemma 2: each scaled score ``s`` becomes ``softcap *
tanh(s / softcap)`` before the softmax) on the CPU: the torch reference against a softmax
written out here in fp64; the C kernels' vectorised tanh against torch's; the C decode
kernels (wide and general, float and int8 caches) and the C prefill kernel against the
reference, with and without a sliding window; cpu_backend's fallback for what the C
kernels do not take; bad caps refused by name.

Queries are scaled up so that ``|s|`` reaches several times the cap, and every case checks
that the capped result is far (many tolerances) from the uncapped one, so a kernel that
ignored the cap would fail. Caches are make_paged_kv's (NaN outside the live tokens),
outputs NaN-poisoned, fresh random data per case.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_kernels import cpu_backend, cpu_native, cpu_prefill, reference
from tests.kernels.helpers import (
    TOLERANCES,
    assert_close,
    cache_rows,
    cpu_paged_kv,
    generator,
    randn,
    seed_for,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CAPS = [0.5, 20.0]


def _query(shape, dtype, cap, g):
    """Random queries whose scores ``q . k / sqrt(D)`` (k ~ N(0, 1)) have a standard
    deviation of twice the cap: the largest reach several caps, where tanh bends."""
    return (torch.randn(shape, generator=g) * (2 * cap)).to(dtype)


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, cap: float,
           scale: float) -> torch.Tensor:
    """One query ``[Hq, D]`` at position ``pos`` over keys ``0 .. pos`` of ``k``/``v``
    ``[n, Hkv, D]``, scores capped: a softmax written out, fp64."""
    group = q.shape[0] // k.shape[1]
    kk = k[:pos + 1].double().repeat_interleave(group, dim=1)  # [m, Hq, D]
    vv = v[:pos + 1].double().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,mhd->hm", q.double(), kk) * scale
    s = cap * torch.tanh(s / cap)
    p = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return torch.einsum("hm,mhd->hd", p / p.sum(dim=-1, keepdim=True), vv)


def _decode(fn, q, kv, window=None, softcap=None):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out=out,
             window=window, softcap=softcap)
    assert got is out
    return got


def _prefill(fn, q, kv, starts, window=None, softcap=None):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, out=out,
             window=window, softcap=softcap)
    assert got is out
    return got


def _cap_matters(capped: torch.Tensor, uncapped: torch.Tensor, dtype: torch.dtype) -> None:
    """The cap moves the result by far more than the tolerance the kernels are held to:
    a kernel ignoring it could not pass."""
    gap = (capped.float() - uncapped.float()).abs().max().item()
    assert gap > 10 * TOLERANCES[dtype]["atol"], gap


@pytest.mark.parametrize("cap", [0.5, 50.0])
def test_reference_caps_scores_before_the_softmax(cap):
    g = generator(seed_for("softcap-reference", cap))
    hq, hkv, d, bs = 4, 2, 16, 4
    q_lens, prefix = [5, 9, 1], [0, 11, 20]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = cpu_paged_kv(lens, bs, hkv, d, F32, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = _query((int(starts[-1]), hq, d), F32, cap, g)
    got = _prefill(reference.paged_prefill_attention, q, kv, starts, softcap=cap)
    qd = _query((len(lens), hq, d), F32, cap, g)
    dec = _decode(reference.paged_decode_attention, qd, kv, softcap=cap)
    for b, n in enumerate(lens):
        k = cache_rows(kv.k_cache, kv.block_tables[b], n)
        v = cache_rows(kv.v_cache, kv.block_tables[b], n)
        for i in range(q_lens[b]):
            want = _naive(q[starts[b] + i], k, v, prefix[b] + i, cap, d**-0.5)
            torch.testing.assert_close(got[starts[b] + i].double(), want, atol=1e-5, rtol=0)
        want = _naive(qd[b], k, v, n - 1, cap, d**-0.5)
        torch.testing.assert_close(dec[b].double(), want, atol=1e-5, rtol=0)
    _cap_matters(dec, _decode(reference.paged_decode_attention, qd, kv), F32)


needs_cc = pytest.mark.skipif(cpu_native.native_library() is None,
                              reason="needs the native CPU kernels (a C compiler)")


@needs_cc
def test_vector_tanh_matches_torch():
    """The C kernels' vectorised cap (``softcap_scores``) against fp64 tanh, over both of
    its ranges (polynomial below |s / cap| = 0.625, exponential above), the infinities,
    NaN and a length that leaves a partial vector."""
    lib = cpu_native.native_library()
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 0.6249999, 0.625, -0.625, 45.0, -45.0, 1e4])])
    for cap in (0.5, 50.0):
        s = (x * cap).float()
        want = cap * torch.tanh(s.double() / cap)
        lib.softcap_scores(s.data_ptr(), s.numel(), cap)
        torch.testing.assert_close(s.double(), want, rtol=1e-6, atol=1e-30)
    ends = torch.tensor([float("inf"), -float("inf"), float("nan")])
    lib.softcap_scores(ends.data_ptr(), 3, 2.0)
    assert ends[:2].tolist() == [2.0, -2.0] and math.isnan(ends[2])


@needs_cc
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("d, hq, hkv, kind", [
    pytest.param(64, 9, 3, "f32", id="wide-d64-f32"),
    pytest.param(128, 8, 2, "bf16", id="wide-d128-bf16"),
    pytest.param(64, 4, 4, "int8", id="wide-d64-int8"),
    pytest.param(32, 4, 2, "f32", id="narrow-d32-f32"),
    pytest.param(16, 2, 1, "bf16", id="narrow-d16-bf16")])
def test_c_decode_matches_reference(d, hq, hkv, kind, window, cap):
    g = generator(seed_for("softcap-c-decode", d, hq, hkv, kind, window, cap))
    dtype = BF16 if kind == "bf16" else F32
    lens = [300, 1, 21, 32, 37, 0, 16]
    kv = cpu_paged_kv(lens, 16, hkv, d, dtype, g, int8=kind == "int8")
    q = _query((len(lens), hq, d), dtype, cap, g)
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got = _decode(cpu_backend.paged_decode_attention, q, kv, window, cap)
    want = _decode(reference.paged_decode_attention, q, kv, window, cap)
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # length 0: zeros
    assert_close(got, want, dtype)
    _cap_matters(want, _decode(reference.paged_decode_attention, q, kv, window), dtype)


@needs_cc
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("d, hq, hkv, kind", [
    pytest.param(64, 6, 2, "f32", id="d64-f32"),
    pytest.param(128, 4, 1, "bf16", id="d128-bf16"),
    pytest.param(64, 4, 2, "int8", id="d64-int8"),
    pytest.param(16, 8, 1, "f32", id="d16-f32")])
def test_c_prefill_matches_reference(d, hq, hkv, kind, window, cap):
    g = generator(seed_for("softcap-c-prefill", d, hq, hkv, kind, window, cap))
    dtype = BF16 if kind == "bf16" else F32
    # A whole prompt over several 16-key tiles, and chunks after a cached prefix that
    # start mid-tile and cross into the next.
    q_lens, prefix = [40, 1, 17, 3], [0, 50, 9, 70]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = cpu_paged_kv(lens, 16, hkv, d, dtype, g, int8=kind == "int8")
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = _query((int(starts[-1]), hq, d), dtype, cap, g)
    assert cpu_prefill.can_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables)
    got = _prefill(cpu_backend.paged_prefill_attention, q, kv, starts, window, cap)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts, window, cap)
    assert_close(got, want, dtype)
    _cap_matters(want, _prefill(reference.paged_prefill_attention, q, kv, starts, window),
                 dtype)


@pytest.mark.parametrize("window", [None, 6])
def test_backend_falls_back_to_the_reference(window):
    """fp16, which neither C kernel takes: cpu_backend's gathered paths know no cap, so a
    capped call must reach the reference."""
    g = generator(seed_for("softcap-fallback", window))
    cap = 1.5
    q_lens, prefix = [9, 1], [0, 20]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = cpu_paged_kv(lens, 8, 2, 32, F16, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = _query((int(starts[-1]), 4, 32), F16, cap, g)
    assert not cpu_prefill.can_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables)
    got = _prefill(cpu_backend.paged_prefill_attention, q, kv, starts, window, cap)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts, window, cap)
    assert_close(got, want, F16)
    _cap_matters(got, _prefill(cpu_backend.paged_prefill_attention, q, kv, starts, window),
                 F16)
    qd = _query((len(lens), 4, 32), F16, cap, g)
    assert not cpu_native.can_decode(qd, kv.k_cache, kv.v_cache, kv.block_tables,
                                     kv.seq_lens)
    got = _decode(cpu_backend.paged_decode_attention, qd, kv, window, cap)
    want = _decode(reference.paged_decode_attention, qd, kv, window, cap)
    assert_close(got, want, F16)
    _cap_matters(got, _decode(cpu_backend.paged_decode_attention, qd, kv, window), F16)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["native", "fallback"])
def test_a_bad_softcap_is_named(dtype):
    g = generator(seed_for("softcap-bad", dtype))
    kv = cpu_paged_kv([5], 4, 1, 16, dtype, g)
    q = randn((1, 2, 16), dtype, g).cpu()
    starts = torch.tensor([0, 1], dtype=torch.int32)
    kv_prefill = cpu_paged_kv([1], 4, 1, 16, dtype, g)
    for bad in (0, -1, float("inf"), float("nan"), True, "2"):
        for fn in (cpu_backend.paged_decode_attention, reference.paged_decode_attention):
            with pytest.raises(ValueError, match="softcap"):
                _decode(fn, q, kv, softcap=bad)
        for fn in (cpu_backend.paged_prefill_attention, reference.paged_prefill_attention):
            with pytest.raises(ValueError, match="softcap"):
                _prefill(fn, q[:1], kv_prefill, starts, softcap=bad)


@needs_cc
@pytest.mark.parametrize("cap", [1e-50, 1e-20, 1e39])
def test_extreme_caps(cap):
    """Valid caps past fp32's range (the C kernels take the cap as fp32): a tiny cap
    flattens the softmax (as the reference's), a cap past fp32's largest is no cap (the
    reference's fp32 math gives NaN there, so compare with it uncapped); never NaN."""
    g = generator(seed_for("softcap-extreme", cap))
    want_cap = None if cap > 1e38 else cap
    q_lens, prefix = [20, 3], [0, 30]
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = cpu_paged_kv(lens, 16, 2, 64, F32, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = randn((int(starts[-1]), 4, 64), F32, g).cpu()
    assert_close(_prefill(cpu_backend.paged_prefill_attention, q, kv, starts, softcap=cap),
                 _prefill(reference.paged_prefill_attention, q, kv, starts,
                          softcap=want_cap), F32)
    for d, hq in ((64, 4), (32, 4)):  # the wide and the general decode kernels
        kvd = cpu_paged_kv(lens, 16, 2, d, F32, g)
        qd = randn((len(lens), hq, d), F32, g).cpu()
        assert_close(_decode(cpu_backend.paged_decode_attention, qd, kvd, softcap=cap),
                     _decode(reference.paged_decode_attention, qd, kvd, softcap=want_cap),
                     F32)
