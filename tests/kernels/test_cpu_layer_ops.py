"""The C elementwise ops of the CPU backend (``cpu_layer_ops``) against the torch
reference: random data per case, rows that are views of a wider fused buffer (as the
decoder passes them), one token and many (the threaded path), fp32 and bf16; the
fallbacks; bad positions."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import cpu_backend, cpu_layer_ops, reference
from deepinfer_kernels.cpu_native import native_library
from tests.kernels.helpers import assert_close, generator, seed_for

pytestmark = pytest.mark.skipif(native_library() is None,
                                reason="native CPU kernels not built (no C compiler)")

DTYPES = [torch.float32, torch.bfloat16]
# 70 x 576 elements is past the C ops' threading threshold (2^15); 1 and 7 are below.
TOKENS = [1, 7, 70]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def _wide_rows(t: int, width: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``[t, width]`` as columns 5.. of a wider buffer: a row stride != width."""
    return _rand((t, width + 11), dtype, g)[:, 5:5 + width]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", TOKENS)
def test_norms_match_reference(t: int, dtype: torch.dtype):
    g = generator(seed_for("norm", t, str(dtype)))
    x, res = _wide_rows(t, 576, dtype, g), _rand((t, 576), dtype, g)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    assert_close(cpu_layer_ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), dtype)
    got, got_sum = cpu_layer_ops.add_rms_norm(x, res, w, 1e-5)
    want, want_sum = reference.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(got_sum, want_sum)  # one add, rounded once: exact
    assert_close(got, want, dtype)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", TOKENS)
def test_rotary_matches_reference(t: int, dtype: torch.dtype, qk_norm: bool):
    """q and k are head views of one fused q/k/v row, as the attention layer makes them."""
    g = generator(seed_for("rotary", t, str(dtype), qk_norm))
    hq, hkv, d = 9, 3, 64
    qkv = _rand((t, (hq + 2 * hkv) * d), dtype, g)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    cache = _rand((200, d), dtype, g)
    pos = torch.randint(0, 200, (t,), generator=g)
    weights = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)]
    args = (*weights, 1e-6) if qk_norm else ()
    got = cpu_layer_ops.rotary_qk(q, k, cache, pos, *args)
    want = reference.rotary_qk(q, k, cache, pos, *args)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous()
        assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", TOKENS)
def test_silu_and_mul_matches_reference(t: int, dtype: torch.dtype):
    g = generator(seed_for("silu", t, str(dtype)))
    x = _wide_rows(t, 2 * 1536, dtype, g) * 4  # well into both tails of the sigmoid
    assert_close(cpu_layer_ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


def test_float16_and_odd_inputs_take_the_reference_op():
    g = generator(seed_for("fallback"))
    x = _rand((3, 64), torch.float16, g)
    w = torch.ones(64, dtype=torch.float16)
    assert torch.equal(cpu_layer_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    x32 = _rand((3, 64), torch.float32, g)
    w16 = torch.ones(64, dtype=torch.bfloat16)  # weight dtype differs from x
    assert torch.equal(cpu_layer_ops.rms_norm(x32, w16, 1e-6),
                       reference.rms_norm(x32, w16, 1e-6))
    gu = _rand((2, 10), torch.float16, g)
    assert torch.equal(cpu_layer_ops.silu_and_mul(gu), reference.silu_and_mul(gu))


def test_position_outside_the_cache_is_named():
    g = generator(seed_for("bad-position"))
    q, k = _rand((2, 4, 16), torch.float32, g), _rand((2, 2, 16), torch.float32, g)
    cache = _rand((10, 16), torch.float32, g)
    with pytest.raises(IndexError, match=r"token 1 has position 10, outside .* 10 rows"):
        cpu_layer_ops.rotary_qk(q, k, cache, torch.tensor([3, 10]))


def test_cpu_backend_runs_these_ops():
    for name in cpu_layer_ops.__all__:
        assert getattr(cpu_backend, name) is getattr(cpu_layer_ops, name)
