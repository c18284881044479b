"""paged_prefill_attention (Triton) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import assert_close, generator, make_paged_kv, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (q heads, kv heads, head_dim, block_size, dtype, [(q_len, kv_len) per sequence])
CASES = [
    pytest.param(4, 4, 64, 16, F32, [(5, 18), (1, 1), (16, 16), (1, 40)],
                 id="mha-d64-bs16-f32-mixed"),
    pytest.param(5, 1, 128, 16, BF16, [(129, 463)], id="gqa5-d128-bs16-bf16-129x463"),
    pytest.param(5, 1, 80, 32, F32, [(1, 1328), (3, 3)], id="gqa5-d80-bs32-f32-1x1328"),
    # Chunks starting and ending on block (8) and tile boundaries; q_len == kv_len.
    pytest.param(8, 2, 96, 8, F16, [(32, 64), (17, 17), (8, 24)], id="gqa4-d96-bs8-f16"),
    pytest.param(8, 2, 128, 32, BF16, [(64, 64), (65, 130), (2, 33)],
                 id="gqa4-d128-bs32-bf16-tiles"),
    pytest.param(4, 2, 256, 16, BF16, [(20, 50)], id="gqa2-d256-bs16-bf16"),
    pytest.param(6, 2, 80, 64, F32, [(40, 100), (0, 7), (33, 33)], id="gqa3-d80-bs64-f32"),
]


def _run(hq, hkv, d, bs, dtype, pairs, seed, max_query_len="exact", num_blocks=None):
    g = generator(seed)
    kv = make_paged_kv([kv_len for _, kv_len in pairs], bs, hkv, d, dtype, g,
                       num_blocks=num_blocks)
    q_lens = [q_len for q_len, _ in pairs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32,
                       device=kv.seq_lens.device)
    q = randn((sum(q_lens), hq, d), dtype, g)
    out = torch.full_like(q, float("nan"))
    hint = max(q_lens) if max_query_len == "exact" else max_query_len
    got = deepinfer_kernels.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                          kv.seq_lens, out=out, max_query_len=hint)
    assert got is out
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                             kv.seq_lens)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("hq, hkv, d, bs, dtype, pairs", CASES)
def test_prefill_matches_reference(hq, hkv, d, bs, dtype, pairs):
    _run(hq, hkv, d, bs, dtype, pairs, seed_for(hq, hkv, d, bs, dtype, pairs),
         num_blocks=3000 if d == 80 else None)


def test_prefill_without_hint():
    """No max_query_len: the grid is sized by T and extra programs exit early."""
    _run(4, 2, 64, 16, F32, [(7, 30), (20, 20)], 5, max_query_len=None)


def test_prefill_custom_scale_and_strided_q():
    g = generator(3)
    pairs = [(10, 25), (4, 4)]
    kv = make_paged_kv([25, 4], 16, 2, 64, F32, g)
    qsl = torch.tensor([0, 10, 14], dtype=torch.int32, device=kv.seq_lens.device)
    qkv = randn((14, 8, 64), F32, g)
    q = qkv[:, :4]  # 4 q heads, then k/v heads in the same fused tensor
    got = deepinfer_kernels.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                          kv.seq_lens, scale=0.2, max_query_len=10)
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                             kv.seq_lens, scale=0.2)
    assert_close(got, want, F32)
    del pairs
