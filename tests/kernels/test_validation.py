"""Bad inputs raise ValueError naming the argument, before anything is written."""

from __future__ import annotations

import inspect

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, bits, generator, make_paged_kv, randn

F32 = torch.float32


def _decode_args():
    g = generator(21)
    kv = make_paged_kv([5, 9], 8, 2, 64, F32, g)
    return dict(q=randn((2, 4, 64), F32, g), k_cache=kv.k_cache, v_cache=kv.v_cache,
                block_tables=kv.block_tables, seq_lens=kv.seq_lens)


def _prefill_args():
    args = _decode_args()
    args["q"] = randn((7, 4, 64), F32, generator(22))
    args["query_start_loc"] = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    return args


def _store_args():
    g = generator(23)
    return dict(k=randn((3, 2, 64), F32, g), v=randn((3, 2, 64), F32, g),
                k_cache=randn((4, 8, 2, 64), F32, g), v_cache=randn((4, 8, 2, 64), F32, g),
                slot_mapping=torch.tensor([0, 9, 31], device=DEVICE))


ATTN_BAD = [
    ("q", lambda a: a["q"].to(torch.float16)),  # dtype differs from the cache
    ("q", lambda a: a["q"][:, :3]),  # 3 q heads, 2 kv heads
    ("q", lambda a: a["q"][..., ::2]),  # non-unit last stride
    ("q", lambda a: a["q"][0]),  # wrong rank
    ("k_cache", lambda a: a["k_cache"][..., :32]),
    ("v_cache", lambda a: a["v_cache"].to(torch.float16)),
    ("block_tables", lambda a: a["block_tables"].long()),
    ("block_tables", lambda a: a["block_tables"][:1]),
    ("seq_lens", lambda a: a["seq_lens"].long()),
    ("scale", lambda a: -1.0),
    ("out", lambda a: torch.empty_like(a["q"])[:, :2]),
]


@pytest.mark.parametrize("name, mutate", ATTN_BAD + [
    # q rows must match seq_lens: the grid is q's rows, each reading its row's tables.
    ("q", lambda a: torch.cat([a["q"], a["q"][:1]])),
    ("q", lambda a: a["q"][:1]),
    ("num_splits", lambda a: 0),
    ("max_seq_len", lambda a: torch.tensor(5)),
])
def test_decode_rejects(name, mutate):
    args = _decode_args()
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=name):
        deepinfer_kernels.paged_decode_attention(**args)


@pytest.mark.parametrize("fn, make", [(lambda **a: deepinfer_kernels.paged_decode_attention(**a),
                                       _decode_args),
                                      (lambda **a: deepinfer_kernels.paged_prefill_attention(**a),
                                       _prefill_args)])
def test_caches_of_block_size_zero_are_refused(fn, make):
    """The kernels divide positions by the block size: 0 is named, never launched."""
    args = make()
    args["k_cache"], args["v_cache"] = args["k_cache"][:, :0], args["v_cache"][:, :0]
    with pytest.raises(ValueError, match=r"k_cache: expected block_size >= 1"):
        fn(**args)


@pytest.mark.parametrize("name, mutate", ATTN_BAD + [
    ("query_start_loc", lambda a: a["query_start_loc"].long()),
    ("query_start_loc", lambda a: a["query_start_loc"][:2]),
    ("max_query_len", lambda a: -1),
])
def test_prefill_rejects(name, mutate):
    args = _prefill_args()
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=name):
        deepinfer_kernels.paged_prefill_attention(**args)


@pytest.mark.parametrize("name, mutate", [
    ("slot_mapping", lambda a: a["slot_mapping"].int()),
    ("slot_mapping", lambda a: a["slot_mapping"][:2]),
    ("k", lambda a: a["k"].int()),
    ("v", lambda a: a["v"][:2]),
    ("k_cache", lambda a: a["k_cache"][:, :, :1]),
    ("k_cache", lambda a: a["k_cache"].transpose(0, 1)),
    ("v_cache", lambda a: a["v_cache"].to(torch.bfloat16)),
])
def test_store_kv_rejects_and_writes_nothing(name, mutate):
    args = _store_args()
    args[name] = mutate(args)
    before = [bits(args["k_cache"]).clone(), bits(args["v_cache"]).clone()]
    with pytest.raises(ValueError, match=name):
        deepinfer_kernels.store_kv(**args)
    assert torch.equal(bits(args["k_cache"]), before[0])
    assert torch.equal(bits(args["v_cache"]), before[1])


@pytest.mark.parametrize("bad_pairs", [
    torch.tensor([[0.0, 1.0]]),
    torch.tensor([0, 1]),
    torch.tensor([[0, 1, 2]]),
])
def test_clone_blocks_rejects_and_writes_nothing(bad_pairs):
    cache = randn((2, 2, 4, 8, 1, 64), F32, generator(24))
    before = cache.clone()
    with pytest.raises(ValueError, match="pairs"):
        deepinfer_kernels.clone_blocks(cache, bad_pairs.to(DEVICE))
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="kv_cache"):
        deepinfer_kernels.clone_blocks(cache[0], torch.tensor([[0, 1]], device=DEVICE))
    # K and V: a cache without both planes would be copied past its end, or in part.
    for planes in (1, 3):
        odd = randn((2, planes, 4, 8, 1, 64), F32, generator(26))
        kept = odd.clone()
        with pytest.raises(ValueError, match="^kv_cache: expected"):
            deepinfer_kernels.clone_blocks(odd, torch.tensor([[0, 1]], device=DEVICE))
        assert torch.equal(odd, kept)


def test_states_reject():
    states = [randn((4, 3), F32, generator(25))]
    with pytest.raises(ValueError, match="slots"):
        deepinfer_kernels.zero_states(states, torch.tensor([0.5], device=DEVICE))
    with pytest.raises(ValueError, match="pairs"):
        deepinfer_kernels.clone_states(states, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match=r"states\[1\]"):
        deepinfer_kernels.zero_states([states[0], states[0].t()], torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="states"):
        deepinfer_kernels.zero_states(states[0], torch.tensor([0], device=DEVICE))


def test_public_api_matches_reference():
    assert sorted(deepinfer_kernels.__all__) == sorted([
        "store_kv", "paged_decode_attention", "paged_prefill_attention", "clone_blocks",
        "zero_states", "clone_states", "moe_route", "moe_align", "fused_moe_gemm",
        "fused_moe", "fused_moe_gguf", "rms_norm", "add_rms_norm", "rotary_qk",
        "silu_and_mul", "sample_tokens", "sample_tokens_filtered", "gguf_matmul",
        "bind_decoder_stack"])
    for name in deepinfer_kernels.__all__:
        ours = inspect.signature(getattr(deepinfer_kernels, name))
        ref = inspect.signature(getattr(reference, name))
        assert list(ours.parameters) == list(ref.parameters), name
        for p in ours.parameters.values():
            assert p.default == ref.parameters[p.name].default, (name, p.name)
