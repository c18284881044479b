"""The native CPU prefill attention (``deepinfer_kernels.cpu_prefill``) against the torch
reference: fresh random data per case, caches NaN outside the live tokens and spare
table columns pointing at NaN blocks (any read past a sequence's end shows as NaN),
``out`` NaN-poisoned; shapes across its 16-query items and 16-key tiles, prefixes, GQA
groups 1-8, head dims 16-128, fp32/bf16 q and caches, int32/int64 and strided tables; and
bad input, named, with nothing written."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import cpu_backend, cpu_prefill, reference
from tests.kernels.helpers import assert_close, generator, make_paged_kv, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

pytestmark = pytest.mark.skipif(
    not cpu_prefill.can_prefill(torch.zeros(1, 1, 16), torch.zeros(1, 1, 1, 16),
                                torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, dtype=torch.int32)),
    reason="native CPU kernels not built (no C compiler)")


def _case(hq, hkv, d, bs, cache_dtype, q_lens, prefix, q_dtype=None, seed=()):
    g = generator(seed_for("cpu-prefill-native", hq, hkv, d, bs, cache_dtype, q_lens, prefix,
                           q_dtype, *seed))
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = make_paged_kv(lens, bs, hkv, d, cache_dtype, g)
    kv.k_cache, kv.v_cache = kv.k_cache.cpu(), kv.v_cache.cpu()
    kv.block_tables, kv.seq_lens = kv.block_tables.cpu(), kv.seq_lens.cpu()
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = randn((int(starts[-1]), hq, d), q_dtype or cache_dtype, g).cpu()
    return q, kv, starts


# (q heads, kv heads, head dim, block size, cache dtype, new tokens, cached prefix)
CASES = [
    pytest.param(4, 4, 32, 16, F32, [16, 1, 40], [0, 0, 0], id="mha-three-items"),
    pytest.param(9, 3, 64, 16, BF16, [37, 5, 1], [70, 11, 0], id="smollm2-shape-prefix"),
    pytest.param(8, 1, 128, 8, BF16, [17, 2], [3, 45], id="gqa8-d128"),
    pytest.param(6, 2, 16, 4, F32, [33, 16, 15], [0, 1, 31], id="gqa3-d16-bs4"),
    pytest.param(2, 2, 64, 32, BF16, [0, 20, 0], [5, 0, 9], id="empty-sequences"),
]


@pytest.mark.parametrize("hq, hkv, d, bs, dtype, q_lens, prefix", CASES)
def test_native_prefill_matches_reference(hq, hkv, d, bs, dtype, q_lens, prefix):
    q, kv, starts = _case(hq, hkv, d, bs, dtype, q_lens, prefix)
    assert cpu_prefill.can_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables)
    out = torch.full_like(q, float("nan"))
    got = cpu_prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                              starts, kv.seq_lens, out=out)
    assert got is out
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                             starts, kv.seq_lens)
    assert_close(got, want, dtype)
    torch.testing.assert_close(  # the backend's entry point takes the same kernel
        cpu_backend.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            starts, kv.seq_lens), got, rtol=0, atol=0)


def test_mixed_dtypes_int64_and_strided_tables_and_scale():
    """fp32 queries over a bf16 cache, int64 tables taken as a column slice of a wider
    tensor (rows further apart than their width), an explicit scale, an out that is not
    contiguous."""
    q, kv, starts = _case(9, 3, 64, 16, BF16, [21, 3], [40, 6], q_dtype=F32)
    wide = torch.full((2, kv.block_tables.shape[1] + 5), 10**6, dtype=torch.int64)
    wide[:, :kv.block_tables.shape[1]] = kv.block_tables
    tables = wide[:, :kv.block_tables.shape[1]]
    assert tables.stride(0) != tables.shape[1]
    base = torch.full((q.shape[0], 2 * q.shape[1], q.shape[2]), float("nan"))
    out = base[:, ::2]  # every other head row of a wider buffer: not contiguous
    assert not out.is_contiguous()
    got = cpu_prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, tables, starts,
                                              kv.seq_lens, scale=0.3, out=out)
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                             starts, kv.seq_lens, scale=0.3)
    assert got is out
    assert_close(got, want, F32)


def test_what_it_does_not_take_goes_to_torch():
    q, kv, starts = _case(4, 1, 32, 16, F16, [9, 2], [0, 7])
    assert not cpu_prefill.can_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables)
    wide = torch.zeros(3, 2, 24)  # head dim 24: not a multiple of 16
    assert not cpu_prefill.can_prefill(wide, torch.zeros(4, 4, 1, 24), torch.zeros(4, 4, 1, 24),
                                       torch.zeros(1, 1, dtype=torch.int32))
    got = cpu_backend.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                              starts, kv.seq_lens)
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                             starts, kv.seq_lens)
    assert_close(got, want, F16)


def test_bad_input_is_named_and_nothing_is_written():
    q, kv, starts = _case(4, 2, 32, 8, F32, [5, 12], [0, 30])
    out = torch.full_like(q, float("nan"))
    short = kv.block_tables[:, :2].contiguous()  # sequence 1 needs 6 blocks
    with pytest.raises(IndexError, match=r"sequence 1 \(seq_len 42\) needs 6 blocks"):
        cpu_prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, short, starts,
                                            kv.seq_lens, out=out)
    outside = kv.block_tables.clone()
    outside[0, 0] = kv.k_cache.shape[0]
    with pytest.raises(IndexError, match="sequence 0 .*outside the cache"):
        cpu_prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, outside, starts,
                                            kv.seq_lens, out=out)
    with pytest.raises(ValueError, match="sequence 1 has 12 new tokens but seq_lens 10"):
        cpu_prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            starts, torch.tensor([5, 10], dtype=torch.int32),
                                            out=out)
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu_prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            starts[:2], kv.seq_lens, out=out)
    assert torch.isnan(out).all()
