"""No op reads device data on the host (no .item()/.tolist()/.cpu() syncs)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import deepinfer_kernels
from tests.kernels.helpers import DEVICE, generator, make_paged_kv, randn


def _calls():
    g = generator(31)
    kv = make_paged_kv([20, 3], 16, 2, 64, torch.float32, g)
    q = randn((2, 4, 64), torch.float32, g)
    qp = randn((5, 4, 64), torch.float32, g)
    qsl = torch.tensor([0, 4, 5], dtype=torch.int32, device=DEVICE)
    k = randn((5, 2, 64), torch.float32, g)
    slots = torch.tensor([0, 1, 2, -1, 40], device=DEVICE)
    cache = randn((2, 2, 8, 16, 2, 64), torch.float32, g)
    pairs = torch.tensor([[0, 5], [1, 6]], device=DEVICE)
    states = [randn((4, 3), torch.float32, g)]
    # Inputs made here, not in the calls: torch.tensor(list, device="cuda") is itself a
    # blocking copy, which the sync-debug mode below would rightly reject.
    clone_pairs = torch.tensor([[1, 2]], device=DEVICE)
    x, w = randn((5, 96), torch.float32, g), randn((96,), torch.float32, g)
    rope = randn((32, 64), torch.float32, g)
    pos = torch.tensor([0, 3, 31, 7, 2], device=DEVICE)
    norm_w = randn((64,), torch.float32, g)
    temps, uniforms = w[:5].abs() + 0.5, w[5:10].abs() % 1
    # A MoE layer: 4 experts, top-2, H = 64, I = 32; float and Q8_0-block experts (each
    # block's fp16 scale set to 1.0, so no NaN from random bytes).
    moe_x = randn((3, 64), torch.float32, g)
    w13, w2 = randn((4, 64, 64), torch.float32, g), randn((4, 64, 32), torch.float32, g)
    topk_ids = torch.tensor([[0, 2], [1, 3], [2, 0]], dtype=torch.int32, device=DEVICE)
    topk_w = w[:6].abs().view(3, 2).contiguous()
    b13 = torch.randint(0, 256, (4, 64, 2, 34), generator=g, dtype=torch.uint8)
    b2 = torch.randint(0, 256, (4, 64, 1, 34), generator=g, dtype=torch.uint8)
    for b in (b13, b2):
        b[..., 0], b[..., 1] = 0x00, 0x3C
    b13, b2 = b13.reshape(4, 64, 68).to(DEVICE), b2.reshape(4, 64, 34).to(DEVICE)
    return [
        lambda: deepinfer_kernels.fused_moe(moe_x, w13, w2, topk_w, topk_ids),
        lambda: deepinfer_kernels.fused_moe_gguf(moe_x, b13, b2, 8, 8, topk_w, topk_ids),
        lambda: deepinfer_kernels.rms_norm(x, w, 1e-6),
        lambda: deepinfer_kernels.add_rms_norm(x, x, w, 1e-6),
        lambda: deepinfer_kernels.rotary_qk(qp, k, rope, pos),
        lambda: deepinfer_kernels.rotary_qk(qp, k, rope, pos, norm_w, norm_w),
        lambda: deepinfer_kernels.silu_and_mul(x),
        lambda: deepinfer_kernels.sample_tokens(x, temps, uniforms),
        lambda: deepinfer_kernels.sample_tokens_filtered(
            x, temps, uniforms, top_k=pos, top_p=temps.clamp(max=0.9),
            min_p=uniforms * 0.1, max_top_k=31),
        lambda: deepinfer_kernels.store_kv(k, k, kv.k_cache, kv.v_cache, slots),
        lambda: deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                               kv.seq_lens),
        lambda: deepinfer_kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                               kv.seq_lens, num_splits=2),
        lambda: deepinfer_kernels.paged_prefill_attention(qp, kv.k_cache, kv.v_cache,
                                                          kv.block_tables, qsl, kv.seq_lens),
        lambda: deepinfer_kernels.clone_blocks(cache, pairs),
        lambda: deepinfer_kernels.zero_states(states, pairs[:, 0]),
        lambda: deepinfer_kernels.clone_states(states, clone_pairs),
    ]


@contextlib.contextmanager
def _forbid_host_reads(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("host read of device data inside a kernel op")

    with monkeypatch.context() as m:
        for name in ("item", "tolist"):
            m.setattr(torch.Tensor, name, boom)
        yield


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CUDA uses sync debug mode below")
def test_no_host_reads_cpu(monkeypatch):
    calls = _calls()
    with _forbid_host_reads(monkeypatch):
        for call in calls:
            call()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
def test_no_sync_cuda():
    calls = _calls()
    for call in calls:  # compile first: the JIT may legitimately sync
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
