"""paged_decode_attention (Triton) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, assert_close, generator, make_paged_kv, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (q heads, kv heads, head_dim, block_size, dtype, seq_lens); each runs split and unsplit.
CASES = [
    pytest.param(4, 4, 64, 16, F32, [1, 16, 17, 40], id="mha-d64-bs16-f32-boundaries"),
    pytest.param(8, 2, 128, 32, BF16, [32, 33, 5], id="gqa4-d128-bs32-bf16"),
    pytest.param(5, 1, 80, 16, F32, [2000], id="gqa5-d80-bs16-f32-2000"),
    pytest.param(5, 1, 128, 32, BF16, [1328, 3], id="gqa5-d128-bs32-bf16-1328"),
    pytest.param(8, 2, 96, 8, F16, [9, 8, 100], id="gqa4-d96-bs8-f16"),
    pytest.param(4, 2, 256, 16, BF16, [70], id="gqa2-d256-bs16-bf16"),
    pytest.param(6, 2, 64, 64, F32, [64, 65, 130], id="gqa3-d64-bs64-f32"),
]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("hq, hkv, d, bs, dtype, lens", CASES)
def test_decode_matches_reference(hq, hkv, d, bs, dtype, lens, num_splits):
    g = generator(seed_for(hq, hkv, d, bs, dtype, lens, num_splits))
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g, num_blocks=3000 if d <= 80 else None)
    q = randn((len(lens), hq, d), dtype, g)
    out = torch.full_like(q, float("nan"))
    got = deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                         kv.seq_lens, out=out, num_splits=num_splits)
    assert got is out
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens)
    assert_close(got, want, dtype)


def test_decode_auto_splits_and_hints():
    """Default split choice, a tight max_seq_len hint, a too-small hint (still correct),
    a custom scale and a non-contiguous q (a slice of a fused qkv tensor)."""
    g = generator(7)
    lens = [300, 1, 77]
    hq, hkv, d, bs = 8, 2, 64, 16
    kv = make_paged_kv(lens, bs, hkv, d, F32, g)
    qkv = randn((len(lens), hq + 2 * hkv, d), F32, g)
    q = qkv[:, :hq]
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens, scale=0.3)
    for hint in (None, 300, 100):
        got = deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                             kv.seq_lens, scale=0.3, max_seq_len=hint)
        assert_close(got, want, F32)


def test_decode_many_splits_some_empty():
    """More splits than the sequence needs: empty splits must merge with weight 0."""
    g = generator(11)
    kv = make_paged_kv([5, 40], 8, 1, 64, BF16, g, extra_cols=10)
    q = randn((2, 3, 64), BF16, g)
    got = deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                         kv.seq_lens, num_splits=6)
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens)
    assert_close(got, want, BF16)


def test_decode_splits_follow_each_sequence_length():
    """A launch planned for a long bound (a CUDA graph's is max_model_len) still spreads
    a short sequence's keys over every split: each split of a 200-token sequence holds
    keys (its partial's lse is finite), a 7-token one fills the first split only; the
    merged result matches the reference."""
    from deepinfer_kernels.decode_attention import decode_launches
    from deepinfer_kernels.runtime import Target, run_launches

    g = generator(13)
    kv = make_paged_kv([200, 7], 16, 1, 64, F32, g, extra_cols=300)
    q = randn((2, 2, 64), F32, g)
    out = torch.full_like(q, float("nan"))
    launches = decode_launches(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out,
                               0.125, 3, 8192, Target.of(q.device))
    lse = launches[0].args[7]  # [B, splits, Hq], log2 domain
    lse.fill_(float("nan"))
    run_launches(launches)
    assert torch.isfinite(lse[0]).all()
    assert torch.isfinite(lse[1, 0]).all() and torch.isneginf(lse[1, 1:]).all()
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens, scale=0.125)
    assert_close(out, want, F32)


def test_decode_choose_num_splits():
    from deepinfer_kernels.decode_attention import choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(64, 8, 4096, 64, cpu) == 1  # grid already covers the "SMs"
    assert choose_num_splits(1, 1, 32768, 64, cpu) > 1
    assert choose_num_splits(1, 1, 64, 64, cpu) == 1  # too short to be worth splitting
    # An H100's 132 SMs given as a count (what deepinfer_compile_grid.check plans with).
    assert choose_num_splits(1, 8, 32768, 64, 132) == 33
    assert choose_num_splits(256, 8, 4096, 64, 132) == 1
    if DEVICE.type == "cuda":
        assert choose_num_splits(1, 8, 32768, 64, DEVICE) > 1
        assert choose_num_splits(256, 8, 512, 64, DEVICE) == 1
