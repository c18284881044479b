"""Randomised shapes (hypothesis, derandomised so CI is reproducible) vs the reference."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, assert_close, generator, make_paged_kv, randn

HEADS = [(4, 4), (8, 2), (5, 1), (6, 3), (7, 7)]
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

shape = st.fixed_dictionaries({
    "heads": st.sampled_from(HEADS),
    "d": st.sampled_from([64, 80, 96]),
    "bs": st.sampled_from([8, 16, 32, 64]),
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "seed": st.integers(0, 2**20),
})


@SETTINGS
@given(shape=shape, lens=st.lists(st.integers(1, 150), min_size=1, max_size=3),
       splits=st.sampled_from([None, 1, 2, 5]))
def test_decode_random(shape, lens, splits):
    (hq, hkv), d, bs, dtype = shape["heads"], shape["d"], shape["bs"], shape["dtype"]
    g = generator(shape["seed"])
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g)
    q = randn((len(lens), hq, d), dtype, g)
    got = deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                         kv.seq_lens, num_splits=splits)
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens)
    assert_close(got, want, dtype)


@st.composite
def _pairs(draw):
    n = draw(st.integers(1, 3))
    out = []
    for _ in range(n):
        q_len = draw(st.integers(0, 70))
        out.append((q_len, q_len + draw(st.integers(0, 90))))
    return out


@SETTINGS
@given(shape=shape, pairs=_pairs())
def test_prefill_random(shape, pairs):
    (hq, hkv), d, bs, dtype = shape["heads"], shape["d"], shape["bs"], shape["dtype"]
    g = generator(shape["seed"])
    kv = make_paged_kv([kv_len for _, kv_len in pairs], bs, hkv, d, dtype, g)
    q_lens = [q_len for q_len, _ in pairs]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = randn((starts[-1], hq, d), dtype, g)
    out = torch.full_like(q, float("nan"))
    deepinfer_kernels.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                    kv.seq_lens, out=out, max_query_len=max(q_lens))
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                             kv.seq_lens)
    assert_close(out, want, dtype)
