"""Attention logit soft-capping (Gemma 2: each scaled score ``s`` taken as ``softcap *
tanh(s / softcap)`` before the softmax) in the Triton decode (unsplit and split) and
prefill kernels, interpreted on CPU, against the torch reference; with and without a
sliding window, on fp32, bf16 and int8 caches.

q is scaled up so that the scores reach several times the cap (checked), where tanh
saturates, and each case checks that the cap moves the reference output by far more than
the tolerance: a kernel that ignored it would fail. A cap far above the scores must
leave them as they are (tanh keeps its relative precision near 0); a bad cap is a
ValueError naming ``softcap``. Caches are make_paged_kv's (NaN
outside the live tokens and in the spare table columns' blocks), outputs are
NaN-poisoned, fresh random data per case.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.kv_quant import kv_values, quantize_kv
from tests.kernels.helpers import (
    DEVICE,
    TOLERANCES,
    assert_close,
    generator,
    make_paged_kv,
    randn,
    seed_for,
)

# Found, not imported: importing triton before deepinfer_kernels sets TRITON_INTERPRET
# would leave it uninterpreted where a script (not pytest's conftest) loads this module.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton (the interpreter on CPU)")

F32, BF16 = torch.float32, torch.bfloat16
CAPS = [0.5, 50.0]  # a cap below the typical score, and Gemma 2's attention cap
HQ, HKV, D, BS = 4, 2, 32, 16  # GQA 2; 16-token blocks, so several per sequence


def _q(tokens: int, cap: float, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Queries whose scores (unit-normal keys, scale D^-0.5) have a standard deviation of
    twice the cap: the largest are several caps."""
    return (torch.randn((tokens, HQ, D), generator=g) * (2 * cap)).to(dtype=dtype,
                                                                     device=DEVICE)


def _kv(lens: list[int], dtype: torch.dtype, g: torch.Generator, int8: bool = False):
    kv = make_paged_kv(lens, BS, HKV, D, dtype, g)
    if int8:
        kv.k_cache, kv.v_cache = quantize_kv(kv.k_cache), quantize_kv(kv.v_cache)
    return kv


def _peak_score(q: torch.Tensor, kv, b: int, n: int) -> float:
    """The largest ``|scale * q . k|`` of rows ``q`` ``[m, Hq, D]`` over sequence ``b``'s
    first ``n`` keys."""
    pos = torch.arange(n, device=DEVICE)
    k = kv_values(kv.k_cache[kv.block_tables[b, pos // BS].long(), pos % BS]).float()
    k = k.repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
    return (torch.einsum("mhd,nhd->mhn", q.float(), k).abs().max() * D**-0.5).item()


def _check_cap_matters(want: torch.Tensor, uncapped: torch.Tensor, dtype: torch.dtype):
    """The cap moves the output far past the tolerance: ignoring it cannot pass."""
    gap = (want.float() - uncapped.float()).abs().max().item()
    assert gap > 10 * TOLERANCES[dtype]["atol"], gap


def _decode(fn, q, kv, **kw):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out=out, **kw)
    assert got is out
    return got


def _prefill(fn, q, kv, starts, **kw):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, out=out, **kw)
    assert got is out
    return got


DECODE_LENS = [75, 1, 20, 0]  # three 32-key tiles, one key, a part tile, nothing

DECODE_CASES = [
    pytest.param(dtype, window, False, id=f"{name}-{wname}")
    for dtype, name in ((F32, "f32"), (BF16, "bf16"))
    for window, wname in ((None, "nowindow"), (7, "window7"))
] + [pytest.param(F32, None, True, id="int8-nowindow")]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype, window, int8", DECODE_CASES)
def test_triton_decode_matches_reference(dtype, window, int8, cap, splits):
    g = generator(seed_for("softcap-triton-decode", dtype, window, int8, cap, splits))
    kv = _kv(DECODE_LENS, dtype, g, int8)
    q = _q(len(DECODE_LENS), cap, dtype, g)
    assert _peak_score(q[:1], kv, 0, DECODE_LENS[0]) > 4 * cap
    got = _decode(deepinfer_kernels.paged_decode_attention, q, kv, window=window,
                  softcap=cap, num_splits=splits)
    want = _decode(reference.paged_decode_attention, q, kv, window=window, softcap=cap)
    assert torch.equal(got[3], torch.zeros_like(got[3]))  # length 0: zeros
    assert_close(got.cpu(), want.cpu(), dtype)
    uncapped = _decode(reference.paged_decode_attention, q, kv, window=window)
    _check_cap_matters(want, uncapped, dtype)


# Sequence 0: a fresh 70-token prompt (three query tiles of 32, two key tiles of 64);
# 1: one token after a 30-token prefix; 2: a 40-token chunk after a 60-token cached
# prefix (two query tiles, keys across two key tiles, the first one unmasked for the
# second query tile without a window).
PREFILL_Q_LENS, PREFILL_PREFIX = [70, 1, 40], [0, 30, 60]

PREFILL_CASES = [
    pytest.param(dtype, window, False, id=f"{name}-{wname}")
    for dtype, name in ((F32, "f32"), (BF16, "bf16"))
    for window, wname in ((None, "nowindow"), (9, "window9"))
] + [pytest.param(F32, 9, True, id="int8-window9")]


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype, window, int8", PREFILL_CASES)
def test_triton_prefill_matches_reference(dtype, window, int8, cap):
    g = generator(seed_for("softcap-triton-prefill", dtype, window, int8, cap))
    lens = [a + b for a, b in zip(PREFILL_Q_LENS, PREFILL_PREFIX)]
    kv = _kv(lens, dtype, g, int8)
    starts = torch.tensor([0] + PREFILL_Q_LENS).cumsum(0).int().to(DEVICE)
    q = _q(int(starts[-1]), cap, dtype, g)
    last = int(starts[-1]) - 1  # sequence 2's last query sees all of its keys
    assert _peak_score(q[last:], kv, 2, lens[2]) > 4 * cap
    got = _prefill(deepinfer_kernels.paged_prefill_attention, q, kv, starts, window=window,
                   softcap=cap)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts, window=window,
                    softcap=cap)
    assert_close(got.cpu(), want.cpu(), dtype)
    uncapped = _prefill(reference.paged_prefill_attention, q, kv, starts, window=window)
    _check_cap_matters(want, uncapped, dtype)


@pytest.mark.parametrize("cap", [1e3, 1e6])
def test_triton_cap_far_above_the_scores(cap):
    """A cap thousands of times the scores leaves them (almost) as they are: tanh near 0
    must keep its relative precision (``1 - exp(-2x)`` alone would blur scores ~1 by
    ~1e-7 * cap), in decode and in prefill."""
    g = generator(seed_for("softcap-triton-far", cap))
    lens = [a + b for a, b in zip(PREFILL_Q_LENS, PREFILL_PREFIX)]
    kv = _kv(lens, F32, g)
    starts = torch.tensor([0] + PREFILL_Q_LENS).cumsum(0).int().to(DEVICE)
    q = _q(int(starts[-1]), 1.0, F32, g)  # scores of a few units
    for splits in (1, 3):
        got = _decode(deepinfer_kernels.paged_decode_attention, q[:3], kv, softcap=cap,
                      num_splits=splits)
        want = _decode(reference.paged_decode_attention, q[:3], kv, softcap=cap)
        assert_close(got.cpu(), want.cpu(), F32)
    got = _prefill(deepinfer_kernels.paged_prefill_attention, q, kv, starts, softcap=cap)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts, softcap=cap)
    assert_close(got.cpu(), want.cpu(), F32)


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("inf"), float("nan"), True, "50"])
def test_a_bad_softcap_is_named(bad):
    g = generator(seed_for("softcap-bad"))
    kv = _kv([5], F32, g)
    q = randn((1, HQ, D), F32, g)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="softcap"):
        _decode(deepinfer_kernels.paged_decode_attention, q, kv, softcap=bad)
    with pytest.raises(ValueError, match="softcap"):
        _prefill(deepinfer_kernels.paged_prefill_attention, q, kv, starts, softcap=bad)
