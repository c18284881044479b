"""kernels.cpu_backend (the engine's CPU ops) against the torch reference.

Decode runs through both of its paths: ``paged_decode_attention`` (the native C kernel
where it takes the inputs, see tests/kernels/test_cpu_native.py) and the torch fallback
``gathered_decode_attention``.

Every case draws fresh random data; caches are NaN outside the live tokens and spare
block-table columns point at NaN blocks (tests.kernels.helpers.make_paged_kv), so any read
past a sequence's end shows up as NaN in the output; ``out`` is NaN-poisoned before a call.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import cpu_backend, reference
from tests.kernels.helpers import assert_close, bits, generator, make_paged_kv, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU = torch.device("cpu")


def _paged_kv(lens: list[int], bs: int, hkv: int, d: int, dtype: torch.dtype,
              g: torch.Generator, extra_cols: int = 2):
    """make_paged_kv on the CPU (this backend's device) whatever the test device is."""
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g, extra_cols=extra_cols)
    kv.k_cache, kv.v_cache = kv.k_cache.cpu(), kv.v_cache.cpu()
    kv.block_tables, kv.seq_lens = kv.block_tables.cpu(), kv.seq_lens.cpu()
    return kv


# The engine's entry point (native kernel where it applies) and the torch fallback.
IMPLS = [pytest.param(cpu_backend.paged_decode_attention, id="dispatch"),
         pytest.param(cpu_backend.gathered_decode_attention, id="gathered")]


def _decode_both(q, kv, impl=cpu_backend.paged_decode_attention, **kwargs):
    out = torch.full_like(q, float("nan"))
    got = impl(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out=out, **kwargs)
    assert got is out
    kwargs.pop("max_seq_len", None)
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens, **kwargs)
    return got, want


# (q heads, kv heads, head_dim, block_size, dtype, seq_lens)
DECODE_CASES = [
    pytest.param(4, 4, 32, 16, F32, [1, 16, 17, 40, 32], id="mha-bs16-f32-boundaries"),
    pytest.param(9, 3, 64, 16, F32, [100, 3, 64, 1, 77], id="gqa3-smollm-f32"),
    pytest.param(8, 2, 16, 8, F32, [8, 9, 24, 1, 50, 16], id="gqa4-bs8-f32"),
    pytest.param(4, 2, 16, 16, BF16, [33, 1, 48, 20], id="gqa2-tiny-bf16"),
    pytest.param(9, 3, 64, 8, BF16, [7, 64, 65], id="gqa3-bs8-bf16"),
    pytest.param(8, 2, 32, 16, F16, [5, 31, 32], id="gqa4-f16"),
    pytest.param(3, 1, 32, 16, F32, [48, 48, 48], id="gqa3-uniform-blockmultiple"),
    pytest.param(4, 2, 16, 16, F32, [37, 37, 37, 37], id="gqa2-uniform-partialblock"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq, hkv, d, bs, dtype, lens", DECODE_CASES)
def test_decode_matches_reference(hq, hkv, d, bs, dtype, lens, impl):
    g = generator(seed_for("cpu-decode", hq, hkv, d, bs, dtype, lens))
    kv = _paged_kv(lens, bs, hkv, d, dtype, g)
    q = randn((len(lens), hq, d), dtype, g).cpu()
    got, want = _decode_both(q, kv, impl)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("chunk_bytes", [1, 6000, 40000])
def test_decode_many_chunks(monkeypatch, chunk_bytes):
    """Small chunk budgets: one sequence per chunk, and chunks mixing ragged and equal
    lengths (masked and unmasked paths, sorted order scattered back)."""
    monkeypatch.setattr(cpu_backend, "_CHUNK_BYTES", chunk_bytes)
    g = generator(seed_for("cpu-decode-chunks", chunk_bytes))
    lens = [int(x) for x in torch.randint(1, 90, (40,), generator=g)] + [32] * 6 + [1] * 3
    kv = _paged_kv(lens, 16, 2, 16, F32, g)
    q = randn((len(lens), 4, 16), F32, g).cpu()
    got, want = _decode_both(q, kv, cpu_backend.gathered_decode_attention)
    assert_close(got, want, F32)


def test_decode_chunk_holds_one_sequence_per_thread(monkeypatch):
    """More threads than kv heads with a tiny chunk budget: chunks grow to several of the
    longest sequences, and the workspace with them."""
    monkeypatch.setattr(cpu_backend, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    g = generator(13)
    lens = [70, 70, 3, 64, 65, 1, 70]
    kv = _paged_kv(lens, 16, 1, 16, F32, g)
    q = randn((len(lens), 3, 16), F32, g).cpu()
    got, want = _decode_both(q, kv, cpu_backend.gathered_decode_attention)
    assert_close(got, want, F32)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_hints_scale_and_strided_q(impl):
    """A custom scale, a non-contiguous q (a slice of a fused qkv tensor) and a too-small
    max_seq_len hint (ignored: lengths come from seq_lens)."""
    g = generator(3)
    lens = [300, 1, 77]
    kv = _paged_kv(lens, 16, 2, 64, F32, g)
    qkv = randn((len(lens), 8 + 2 * 2, 64), F32, g).cpu()
    got, want = _decode_both(qkv[:, :8], kv, impl, scale=0.3, max_seq_len=10)
    assert_close(got, want, F32)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_garbage_table_padding_never_read(impl):
    """Table columns past a sequence's last block may be stale or out of range."""
    g = generator(5)
    lens = [5, 40, 17]
    kv = _paged_kv(lens, 16, 1, 32, F32, g, extra_cols=3)
    num_blocks = kv.k_cache.shape[0]
    garbage = torch.tensor([-1, num_blocks + 7, 2**30], dtype=torch.int32)
    for b, n in enumerate(lens):
        need = -(-n // 16)
        spare = kv.block_tables.shape[1] - need
        kv.block_tables[b, need:] = garbage.repeat(spare)[:spare]
    q = randn((3, 2, 32), F32, g).cpu()
    got, want = _decode_both(q, kv, impl)
    assert_close(got, want, F32)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_zero_length_sequence_and_empty_batch(impl):
    g = generator(9)
    kv = _paged_kv([20, 1, 1], 8, 2, 16, F32, g)
    kv.seq_lens[1] = 0  # an empty sequence: attention over nothing is 0, as the reference
    q = randn((3, 4, 16), F32, g).cpu()
    got, want = _decode_both(q, kv, impl)
    assert_close(got, want, F32)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    # Its table row may be all padding (-1): never dereferenced, by either path.
    kv.block_tables[1] = -1
    for dtype in (F32, F16):  # fp32: the C kernel where built; fp16: the gathered path
        c = (kv.k_cache.to(dtype), kv.v_cache.to(dtype))
        out = torch.full_like(q, float("nan")).to(dtype)
        got = impl(q.to(dtype), *c, kv.block_tables, kv.seq_lens, out=out)
        want = reference.paged_decode_attention(q.to(dtype), *c, kv.block_tables,
                                                kv.seq_lens)
        assert_close(got, want, dtype)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    empty = q[:0]
    out = impl(empty, kv.k_cache, kv.v_cache, kv.block_tables[:0], kv.seq_lens[:0])
    assert out.shape == (0, 4, 16)


# (q heads, kv heads, head_dim, block_size, dtype, q_lens, prefix_lens)
PREFILL_CASES = [
    pytest.param(4, 4, 32, 16, F32, [16, 1, 40], [0, 0, 0], id="mha-noprefix-f32"),
    pytest.param(9, 3, 64, 16, F32, [5, 20, 1, 0], [11, 16, 30, 7], id="gqa3-prefix-f32"),
    pytest.param(8, 2, 16, 8, BF16, [9, 3, 24], [0, 8, 5], id="gqa4-bs8-bf16"),
    pytest.param(4, 1, 32, 16, F16, [33, 2], [0, 31], id="gqa4-f16"),
]


# The entry point (native kernel where it applies, see test_cpu_prefill.py) and torch's.
PREFILL_IMPLS = [pytest.param(cpu_backend.paged_prefill_attention, id="dispatch"),
                 pytest.param(cpu_backend.gathered_prefill_attention, id="gathered")]


@pytest.mark.parametrize("impl", PREFILL_IMPLS)
@pytest.mark.parametrize("hq, hkv, d, bs, dtype, q_lens, prefix", PREFILL_CASES)
def test_prefill_matches_reference(hq, hkv, d, bs, dtype, q_lens, prefix, impl):
    g = generator(seed_for("cpu-prefill", hq, hkv, d, bs, dtype, q_lens, prefix))
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = _paged_kv(lens, bs, hkv, d, dtype, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = randn((int(starts[-1]), hq, d), dtype, g).cpu()
    out = torch.full_like(q, float("nan"))
    got = impl(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, out=out,
               max_query_len=max(q_lens))
    assert got is out
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                             starts, kv.seq_lens)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("src", ["fp32", "cache_dtype_fused_rows"])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_store_kv_bit_exact(dtype, padding, src):
    """K/V in the cache's dtype as head views of a fused q/k/v row take the C store; fp32
    K/V into a bf16 cache take torch's (a cast first)."""
    g = generator(seed_for("cpu-store", dtype, padding, src))
    shape = (30, 8, 2, 16)
    k_cache, v_cache = randn(shape, dtype, g).cpu(), randn(shape, dtype, g).cpu()
    if src == "fp32":
        k, v = randn((12, 2, 16), F32, g).cpu(), randn((12, 2, 16), F32, g).cpu()
    else:
        qkv = randn((12, 5 * 32), dtype, g).cpu()
        _, k, v = qkv.split([96, 32, 32], dim=-1)
        k, v = k.view(12, 2, 16), v.view(12, 2, 16)
    slots = torch.randperm(30 * 8, generator=g)[:12]
    if padding:
        slots[[0, 5, 11]] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, want_k, want_v, slots)
    cpu_backend.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(bits(k_cache), bits(want_k))
    assert torch.equal(bits(v_cache), bits(want_v))
    cpu_backend.store_kv(k[:0], v[:0], k_cache, v_cache, slots[:0])  # nothing to store
    assert torch.equal(bits(k_cache), bits(want_k))


def test_store_kv_slot_past_the_cache_is_named():
    g = generator(seed_for("cpu-store-bad"))
    k_cache, v_cache = randn((4, 8, 2, 16), F32, g).cpu(), randn((4, 8, 2, 16), F32, g).cpu()
    k, v = randn((2, 2, 16), F32, g).cpu(), randn((2, 2, 16), F32, g).cpu()
    before = k_cache.clone()
    with pytest.raises(IndexError, match=r"token 1's slot 32 is past the cache's 32 slots"):
        cpu_backend.store_kv(k, v, k_cache, v_cache, torch.tensor([3, 32]))
    assert torch.equal(k_cache, before)  # nothing written


def test_same_ops_as_reference():
    """The reference's ops, plus the torch decode and prefill paths the native kernels
    fall back to (the elementwise layer ops are cpu_layer_ops', tested in test_cpu_layer_ops.py; the
    draws cpu_sampling's, tested in test_cpu_sampling.py)."""
    torch_ops = ["clone_blocks", "zero_states", "clone_states", "moe_route", "fused_moe",
                 "fused_moe_gguf"]
    layer_ops = ["rms_norm", "add_rms_norm", "rotary_qk", "silu_and_mul"]
    sampling_ops = ["sample_tokens", "sample_tokens_filtered"]
    names = ["store_kv", "paged_decode_attention", "paged_prefill_attention", *torch_ops,
             *layer_ops, *sampling_ops]
    # Plus its own: the fused decode stack (tests/models/test_decoder_stack.py).
    assert sorted(cpu_backend.__all__) == sorted(
        names + ["gathered_decode_attention", "gathered_prefill_attention",
                 "bind_decoder_stack"])
    for name in torch_ops:
        assert getattr(cpu_backend, name) is getattr(reference, name)


def test_workspace_grown_under_inference_mode_is_usable_outside():
    """The engine's first decode runs under inference_mode and grows the per-thread
    workspace there; a later call outside it (a test, a user) must still write into it."""
    import threading

    g = generator(seed_for("workspace-inference-mode"))
    kv = _paged_kv([37, 5, 20], 4, 2, 16, F32, g)
    errors: list[BaseException] = []

    def run() -> None:  # a fresh thread: an empty workspace, grown under inference_mode
        try:
            for mode in (True, False):
                with torch.inference_mode(mode):
                    q = randn((3, 4, 16), F32, g).cpu()
                    got, want = _decode_both(q, kv, cpu_backend.gathered_decode_attention)
                    assert_close(got, want, F32)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
