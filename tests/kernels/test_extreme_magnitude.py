"""Attention with scores far outside exp2's range must still match the reference.

randn q/K give scores of a few units, where even a softmax (or a split-KV merge) that
skips the running-max subtraction stays finite. Here q (and K) are scaled so the scores
reach hundreds to thousands in the exp2 domain: exp2 of a raw score or of a raw
log-sum-exp overflows fp32, so only max-subtracted arithmetic gives finite, correct
outputs. The reference (torch SDPA in fp32) is stable at these magnitudes.

Tolerances: an exp2 argument of magnitude S carries an fp32 rounding error of about
S * 2**-24, which becomes a relative error of the softmax weights, so both the kernel and
the reference sit ~1e-4 (scores ~500) from an fp64 softmax. The absolute tolerance grows
with the score magnitude accordingly; a missing max subtraction gives inf/NaN or O(1)
errors, far outside it.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import (
    DEVICE,
    TOLERANCES,
    generator,
    make_paged_kv,
    randn,
    seed_for,
)

F32, BF16 = torch.float32, torch.bfloat16

# (q multiplier, K multiplier, scale, atol floor): scores of std ~60 (default scale) and
# ~200 (scale > 1); the floor is the score-magnitude rounding error described above.
MAGNITUDES = [
    pytest.param(60.0, 1.0, None, 1e-4, id="q60"),
    pytest.param(4.0, 4.0, 1.5, 1e-3, id="qk4-scale1.5"),
]
DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")]


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, atol: float) -> None:
    assert not torch.isnan(want).any(), "reference overflowed: test data too large"
    assert torch.isfinite(got).all(), "inf/NaN in output (exp2 overflow: no max subtraction?)"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"],
                               atol=max(tol["atol"], atol))


def _scaled_kv(lens, bs, hkv, d, dtype, g, k_mult):
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g)
    kv.k_cache.mul_(k_mult)  # NaN padding stays NaN
    return kv


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("q_mult, k_mult, scale, atol", MAGNITUDES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_large_scores(dtype, q_mult, k_mult, scale, atol, num_splits):
    g = generator(seed_for("decode-large", dtype, q_mult, num_splits))
    lens = [200, 37]
    hq, hkv, d, bs = 4, 2, 64, 16
    kv = _scaled_kv(lens, bs, hkv, d, dtype, g, k_mult)
    q = (randn((len(lens), hq, d), F32, g) * q_mult).to(dtype)
    out = torch.full_like(q, float("nan"))
    got = deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                         kv.seq_lens, scale=scale, out=out,
                                         num_splits=num_splits)
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens, scale=scale)
    _check(got, want, dtype, atol)


@pytest.mark.parametrize("q_mult, k_mult, scale, atol", MAGNITUDES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_large_scores(dtype, q_mult, k_mult, scale, atol):
    """A chunk with a cached prefix and a fresh prompt: the first query of the fresh one
    sees a single key, the rest cross several key tiles."""
    g = generator(seed_for("prefill-large", dtype, q_mult))
    q_lens, kv_lens = [40, 9], [90, 9]
    hq, hkv, d, bs = 4, 2, 64, 16
    kv = _scaled_kv(kv_lens, bs, hkv, d, dtype, g, k_mult)
    q = (randn((sum(q_lens), hq, d), F32, g) * q_mult).to(dtype)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    got = deepinfer_kernels.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                          kv.seq_lens, scale=scale, out=out)
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                             qsl, kv.seq_lens, scale=scale)
    _check(got, want, dtype, atol)
