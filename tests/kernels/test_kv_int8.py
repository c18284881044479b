"""The int8 KV cache (``deepinfer_kernels.kv_quant``): its rounding (a scale per 32 values,
read back from the row's bytes), the C store (``store_kv_int8_cpu``) against the torch
reference byte for byte, the C decode and prefill kernels reading it against the torch
reference on the same int8 caches, and the reference on an int8 cache against the
reference on float caches holding its dequantized values.

Fresh random data per case (seeded with ``seed_for``); the attention caches start as
make_paged_kv's float caches (NaN outside the live tokens, spare table columns pointing at
NaN blocks) quantized whole, so every row past a sequence's end has NaN scales and any
read of it shows as NaN; outputs are NaN-poisoned before each call; store caches start as
random int8 bytes, so an unwritten slot is seen to keep them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from deepinfer_kernels import cpu_backend, cpu_native, cpu_prefill, reference
from deepinfer_kernels.kv_quant import (
    cache_head_dim,
    dequantize_kv,
    is_int8_cache,
    kv_row_width,
    quantize_kv,
)
from tests.kernels.helpers import assert_close, generator, make_paged_kv, randn, seed_for

F32, BF16, I8 = torch.float32, torch.bfloat16, torch.int8
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the native kernels cannot "
                                                  "be built (the torch path runs instead)")
EPS32 = torch.finfo(F32).eps


def _scales(rows: torch.Tensor, d: int) -> torch.Tensor:
    """The fp32 scales stored in int8 rows ``[..., D * 9 / 8]``: ``[..., D / 32]``."""
    return rows[..., d:].contiguous().view(F32)


def _spread_rows(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator):
    """Random rows whose 32-value groups differ in magnitude by up to ~1e24: large, O(1),
    small, tiny, one group all negative (its amax a negative value's size)."""
    x = torch.randn(shape, generator=g)
    groups = shape[-1] // 32
    mags = torch.tensor([1e4, 1.0, 3e-3, 1e-20, 0.25, 7e2, 1e-6, 40.0])[:groups]
    x = (x.unflatten(-1, (groups, 32)) * mags[:, None]).flatten(-2)
    x[..., 4 * 32:5 * 32] = -x[..., 4 * 32:5 * 32].abs()  # an all-negative group
    return x.to(dtype)


# --- the layout and its rounding ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_quantize_scale_is_group_amax_over_127_and_error_within_half_a_step(dtype):
    g = generator(seed_for("kv-int8-quantize", dtype))
    x = _spread_rows((7, 3, 256), dtype, g)
    rows = quantize_kv(x)
    assert rows.dtype == I8 and rows.shape == (7, 3, 256 * 9 // 8)
    xf = x.float()
    amax = xf.unflatten(-1, (-1, 32)).abs().amax(-1)
    scale = _scales(rows, 256)
    assert torch.equal(scale, amax / 127)  # exactly, read from the row's bytes
    assert (scale > 0).all()
    codes = rows[..., :256].unflatten(-1, (-1, 32))
    assert (codes.abs() <= 127).all()  # never -128
    assert torch.equal(codes.abs().amax(-1), torch.full_like(amax, 127, dtype=I8))
    back = dequantize_kv(rows)
    assert back.dtype == F32 and back.shape == x.shape
    step = scale.repeat_interleave(32, dim=-1)
    err = (xf - back).abs()
    bound = step * (0.5 + 4 * EPS32) + xf.abs() * 2 * EPS32
    assert (err <= bound).all(), float((err - bound).max())
    # Not a vacuous bound: the tiny groups come back at their own size, not as zeros.
    tiny = back[..., 3 * 32:4 * 32]
    assert (tiny.abs().amax(-1) > 1e-21).all()


def test_quantize_rounds_ties_to_even():
    """amax 127 makes the scale exactly 1: codes are the values rounded half to even."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.6, 126.5]
                     + [10.0] * 22)
    rows = quantize_kv(x)
    assert _scales(rows, 32).item() == 1.0
    assert rows[:10].tolist() == [127, 0, 2, 2, 0, -2, -2, 3, -127, 126]


def test_all_zero_group_reads_back_zeros():
    g = generator(seed_for("kv-int8-zero-group"))
    x = torch.randn((4, 2, 96), generator=g)
    x[1, 0, 32:64] = 0.0
    rows = quantize_kv(x)
    assert _scales(rows, 96)[1, 0, 1].item() == 0.0
    assert (rows[1, 0, 32:64] == 0).all()
    back = dequantize_kv(rows)
    assert torch.equal(back[1, 0, 32:64], torch.zeros(32))  # zeros, not NaN
    step = _scales(rows, 96).repeat_interleave(32, dim=-1)
    assert ((x - back).abs() <= step * (0.5 + 4 * EPS32)).all()  # the other groups as usual
    assert (_scales(rows, 96) > 0).sum() == 4 * 2 * 3 - 1


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_nan_makes_exactly_its_group_nan(dtype):
    g = generator(seed_for("kv-int8-nan", dtype))
    x = randn((3, 2, 128), dtype, g).cpu()
    x[2, 1, 70] = float("nan")  # group 2 of row (2, 1)
    rows = quantize_kv(x)
    scale = _scales(rows, 128)
    assert torch.isnan(scale[2, 1, 2]) and torch.isnan(scale).sum() == 1
    back = dequantize_kv(rows)
    assert torch.isnan(back[2, 1, 64:96]).all()
    nan = torch.isnan(back)
    assert nan.sum() == 32  # nothing else: the row's other groups, other rows finite
    ok = ~nan
    step = scale.repeat_interleave(32, dim=-1)
    assert ((x.float() - back).abs()[ok] <= (step * (0.5 + 4 * EPS32))[ok] + 1e-30).all()


def test_head_dim_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match=r"rows of 48 values.*multiple of 32"):
        quantize_kv(torch.ones(2, 48))


def test_row_width_and_head_dim_helpers():
    assert kv_row_width(64, "int8") == 72
    assert kv_row_width(128, "int8") == 144
    assert kv_row_width(64, "auto") == 64
    int8_cache = torch.zeros((3, 8, 2, 72), dtype=I8)
    float_cache = torch.zeros((3, 8, 2, 72), dtype=BF16)
    assert cache_head_dim(int8_cache) == 64
    assert cache_head_dim(torch.zeros((3, 8, 2, 144), dtype=I8)) == 128
    assert cache_head_dim(float_cache) == 72
    assert is_int8_cache(int8_cache) and not is_int8_cache(float_cache)
    assert quantize_kv(torch.randn(5, 2, 64)).shape[-1] == kv_row_width(64, "int8")


# --- the C store ---------------------------------------------------------------------------


def _kv_sources(layout: str, t: int, hkv: int, d: int, dtype: torch.dtype,
                g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[T, Hkv, D]``: separate contiguous tensors, or head views of a fused
    q/k/v row (rows ``(Hq + 2 Hkv) D`` apart), as the model passes them."""
    if layout == "contiguous":
        return randn((t, hkv, d), dtype, g).cpu(), randn((t, hkv, d), dtype, g).cpu()
    hq = 3 * hkv
    qkv = randn((t, (hq + 2 * hkv) * d), dtype, g).cpu()
    a, b = hq * d, (hq + hkv) * d
    k = qkv[:, a:b].view(t, hkv, d)
    v = qkv[:, b:].view(t, hkv, d)
    assert not k.is_contiguous() and k.stride(0) == (hq + 2 * hkv) * d
    return k, v


@needs_cc
@pytest.mark.parametrize("layout", ["contiguous", "qkv-views"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_c_store_writes_the_reference_bytes(dtype, layout, monkeypatch):
    """Padding slots skipped (their would-be rows and every other slot keep their random
    bytes), a NaN value's group stored with a NaN scale, ties rounded to even, bit for bit
    as reference.store_kv (the C path is forced: the reference is unplugged for the call)."""
    g = generator(seed_for("kv-int8-store", dtype, layout))
    t, hkv, d, nb, bs = 11, 2, 64, 6, 8
    k, v = _kv_sources(layout, t, hkv, d, dtype, g)
    k[4, 1, 40] = float("nan")
    v[7, 0, 3] = float("nan")
    k[2, 0, :10] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -4.5, 5.5])
    shape = (nb, bs, hkv, kv_row_width(d, "int8"))
    k_cache = torch.randint(-128, 128, shape, generator=g, dtype=I8)
    v_cache = torch.randint(-128, 128, shape, generator=g, dtype=I8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[0, 6]] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, want_k, want_v, slots)

    def unplugged(*args, **kwargs):
        raise AssertionError("cpu_backend.store_kv fell back to the reference")

    monkeypatch.setattr(reference, "store_kv", unplugged)
    cpu_backend.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)
    # What the bytes hold: the written slots are the tokens' quantized rows...
    live = slots >= 0
    flat_k, flat_v = k_cache.view(nb * bs, hkv, -1), v_cache.view(nb * bs, hkv, -1)
    assert torch.equal(flat_k[slots[live]], quantize_kv(k[live]))
    assert torch.equal(flat_v[slots[live]], quantize_kv(v[live]))
    # ... the rest (including where a padded token would have gone) are untouched.
    rest = torch.ones(nb * bs, dtype=torch.bool)
    rest[slots[live]] = False
    assert torch.equal(flat_k[rest], before_k.view(nb * bs, hkv, -1)[rest])
    assert torch.equal(flat_v[rest], before_v.view(nb * bs, hkv, -1)[rest])
    # The NaN groups: a NaN scale (so the group reads back NaN), zero codes.
    s4 = int(slots[4])
    assert torch.isnan(_scales(flat_k[s4, 1], d)[1]) and (flat_k[s4, 1, 32:64] == 0).all()
    assert torch.isnan(dequantize_kv(flat_k[s4, 1])[32:64]).all()
    assert torch.isfinite(dequantize_kv(flat_k[s4, 1])[:32]).all()
    assert flat_k[int(slots[2]), 0, :10].tolist() == [127, 0, 2, 2, 0, -2, -2, 4, -4, 6]


@needs_cc
def test_c_store_slot_past_the_cache_is_named_and_nothing_written():
    g = generator(seed_for("kv-int8-store-bad"))
    shape = (4, 8, 2, 72)
    k_cache = torch.randint(-128, 128, shape, generator=g, dtype=I8)
    v_cache = torch.randint(-128, 128, shape, generator=g, dtype=I8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = randn((3, 2, 64), F32, g).cpu(), randn((3, 2, 64), F32, g).cpu()
    with pytest.raises(IndexError, match=r"token 2's slot 32 is past the cache's 32 slots"):
        cpu_backend.store_kv(k, v, k_cache, v_cache, torch.tensor([5, 0, 32]))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


# --- attention over int8 caches --------------------------------------------------------------


def _int8_paged_kv(lens, bs, hkv, d, dtype, g):
    """make_paged_kv's caches (NaN but for the live tokens) quantized whole, on the CPU."""
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g)
    kv.k_cache, kv.v_cache = quantize_kv(kv.k_cache.cpu()), quantize_kv(kv.v_cache.cpu())
    kv.block_tables, kv.seq_lens = kv.block_tables.cpu(), kv.seq_lens.cpu()
    return kv


def _decode(fn, q, kv):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, out=out)
    assert got is out
    return got


DECODE_SHAPES = [pytest.param(64, 9, 3, id="d64-gqa3"), pytest.param(128, 8, 1, id="d128-gqa8"),
                 pytest.param(64, 4, 4, id="d64-mha")]


@needs_cc
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("d, hq, hkv", DECODE_SHAPES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_c_decode_matches_reference(dtype, d, hq, hkv, bs):
    g = generator(seed_for("kv-int8-decode", dtype, d, hq, hkv, bs))
    lens = [300, 1, 21, 2 * bs, 37]
    kv = _int8_paged_kv(lens, bs, hkv, d, dtype, g)
    assert kv.k_cache.dtype == I8 and kv.k_cache.shape[-1] == d * 9 // 8
    q = randn((len(lens), hq, d), dtype, g).cpu()
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got = _decode(cpu_backend.paged_decode_attention, q, kv)
    want = _decode(reference.paged_decode_attention, q, kv)
    assert_close(got, want, dtype)


@needs_cc
def test_c_decode_zero_length_sequence_gets_zeros():
    g = generator(seed_for("kv-int8-decode-empty"))
    lens = [0, 45, 0, 3]
    kv = _int8_paged_kv(lens, 16, 3, 64, F32, g)
    q = randn((4, 9, 64), F32, g).cpu()
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got = _decode(cpu_backend.paged_decode_attention, q, kv)
    assert torch.equal(got[[0, 2]], torch.zeros((2, 9, 64)))
    want = _decode(reference.paged_decode_attention, q, kv)
    assert_close(got, want, F32)


@pytest.mark.parametrize("d, hq, hkv", [pytest.param(32, 4, 2, id="d32"),
                                        pytest.param(64, 12, 1, id="group12"),
                                        # the wide kernel: 256 for float caches only
                                        pytest.param(256, 4, 1, id="d256")])
def test_decode_shapes_the_c_kernel_does_not_take_run_the_reference(d, hq, hkv):
    g = generator(seed_for("kv-int8-decode-fallback", d, hq, hkv))
    lens = [70, 1, 19]
    kv = _int8_paged_kv(lens, 16, hkv, d, F32, g)
    q = randn((3, hq, d), F32, g).cpu()
    assert not cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got = _decode(cpu_backend.paged_decode_attention, q, kv)
    want = _decode(reference.paged_decode_attention, q, kv)
    assert_close(got, want, F32)


def _prefill_case(hq, hkv, d, bs, dtype, q_lens, prefix, g):
    lens = [a + b for a, b in zip(q_lens, prefix)]
    kv = _int8_paged_kv(lens, bs, hkv, d, dtype, g)
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = randn((int(starts[-1]), hq, d), dtype, g).cpu()
    return q, kv, starts


def _prefill(fn, q, kv, starts):
    out = torch.full_like(q, float("nan"))
    got = fn(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, out=out)
    assert got is out
    return got


def _float_caches(kv):
    """The same paged KV with float32 caches holding the int8 caches' values."""
    return type(kv)(dequantize_kv(kv.k_cache), dequantize_kv(kv.v_cache), kv.block_tables,
                    kv.seq_lens)


def test_reference_on_int8_equals_reference_on_its_dequantized_values():
    """Pins the int8 path to the float one: decode and prefill of the reference over an
    int8 cache against the same over float32 caches of dequantize_kv's values."""
    g = generator(seed_for("kv-int8-ref-vs-float"))
    kv = _int8_paged_kv([90, 1, 33], 16, 2, 64, F32, g)
    fkv = _float_caches(kv)
    assert fkv.k_cache.dtype == F32 and fkv.k_cache.shape[-1] == 64
    q = randn((3, 6, 64), F32, g).cpu()
    got = _decode(reference.paged_decode_attention, q, kv)
    want = _decode(reference.paged_decode_attention, q, fkv)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

    q, kv, starts = _prefill_case(6, 2, 64, 16, F32, [20, 3, 9], [41, 0, 16], g)
    fkv = _float_caches(kv)
    got = _prefill(reference.paged_prefill_attention, q, kv, starts)
    want = _prefill(reference.paged_prefill_attention, q, fkv, starts)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# (q heads, kv heads, head dim, block size, new tokens, cached prefix)
PREFILL_CASES = [
    pytest.param(9, 3, 64, 16, [37, 5, 1], [70, 11, 3], id="d64-gqa3-bs16"),
    pytest.param(8, 1, 128, 8, [17, 2], [3, 45], id="d128-gqa8-bs8"),
    pytest.param(4, 2, 32, 16, [16, 9, 20], [16, 40, 0], id="d32-gqa2-bs16"),
]


@needs_cc
@pytest.mark.parametrize("hq, hkv, d, bs, q_lens, prefix", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_c_prefill_matches_reference(dtype, hq, hkv, d, bs, q_lens, prefix):
    g = generator(seed_for("kv-int8-prefill", dtype, hq, hkv, d, bs, q_lens, prefix))
    q, kv, starts = _prefill_case(hq, hkv, d, bs, dtype, q_lens, prefix, g)
    assert cpu_prefill.can_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables)
    got = _prefill(cpu_backend.paged_prefill_attention, q, kv, starts)
    want = _prefill(reference.paged_prefill_attention, q, kv, starts)
    assert_close(got, want, dtype)
