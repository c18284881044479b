"""The native CPU kernels for GGUF weights (``deepinfer_kernels.cpu_gguf``) against the
dequantized product: every block type, random blocks with negative and subnormal fp16
scales, fresh data per case, poisoned outputs, both paths (the C matmul below
``tile_min_rows`` rows, dequantized tiles + BLAS from it), and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize

from deepinfer_kernels import cpu_gguf, gguf_kernels
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS, block_format
from tests.kernels.gguf_helpers import assert_product, make_blocks, ragged_k, rng_for

NAMES = [f.name for f in BLOCK_FORMATS.values()]

pytestmark = pytest.mark.skipif(not cpu_gguf.available(),
                                reason="native CPU kernels not built (no C compiler)")

# The bounds, relative to |x| @ |W|.T (the size of the terms summed): fp32
# accumulation in another order than the float64 reference, then one rounding to x's dtype.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
N = 24


def _check(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype: int) -> None:
    w = torch.from_numpy(gguf_dequantize(raw, GQ(qtype)))
    assert_product(y, x, w, RTOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("name", NAMES)
def test_matmul_matches_dequantized_product(name: str, m: int, dtype: torch.dtype):
    """M = 1 and 3 take the C kernels (3: several rows, fewer than their groups of 4),
    16 and 17 too for fp32 x and, where the CPU has the int8 kernel but no bf16 GEMM, for
    16-bit x (else the dequantized tile), 64 the tile; the out buffer is poisoned, so
    every element must be written."""
    assert 3 < cpu_gguf.LARGE_M <= 16 < cpu_gguf.FP32_TILE_MIN_M <= 64
    assert 17 < cpu_gguf.INT8_TILE_MIN_M <= 64
    fmt = BLOCK_FORMATS[GQ[name].value]
    rng = rng_for("cpu", name, m, str(dtype))
    k = ragged_k(fmt)
    raw = make_blocks(fmt, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
    out = torch.full((m, N), float("nan"), dtype=dtype)
    y = cpu_gguf.gguf_matmul(x, torch.from_numpy(raw), fmt.type_id, out=out)
    assert y is out
    _check(y, x, raw, fmt.type_id)
    fresh = cpu_gguf.gguf_matmul(x, torch.from_numpy(raw), fmt.type_id)
    assert fresh.dtype == dtype and fresh.shape == (m, N)
    _check(fresh, x, raw, fmt.type_id)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_matches_gguf(name: str):
    """fp32 rows equal ``gguf.quants`` to fp32 rounding (the C decoder may fuse a
    multiply-add); bf16 rows are those rounded once."""
    fmt = BLOCK_FORMATS[GQ[name].value]
    rng = rng_for("cpu-dequantize", name)
    k = ragged_k(fmt)
    raw = make_blocks(fmt, 7, k, rng)
    want = torch.from_numpy(gguf_dequantize(raw, GQ(fmt.type_id)))
    got = cpu_gguf.dequantize_gguf(torch.from_numpy(raw), fmt.type_id)
    assert got.dtype == torch.float32 and got.shape == (7, k)
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-30)
    got16 = cpu_gguf.dequantize_gguf(torch.from_numpy(raw), fmt.type_id, torch.bfloat16)
    assert torch.equal(got16, got.to(torch.bfloat16))


def test_strided_inputs_and_rows_of_a_wider_buffer():
    """x with a row stride wider than K (a view of a fused projection's output) and
    blocks that are rows of a wider buffer (a fused weight's part) are read in place."""
    fmt = block_format(int(GQ.Q4_1))
    rng = rng_for("cpu-strided")
    k = ragged_k(fmt)
    raw = make_blocks(fmt, 2 * N, k, rng)
    wide = torch.from_numpy(np.concatenate([raw, raw[:, :40]], axis=1))
    blocks = wide[:N, : raw.shape[1]]
    assert blocks.stride(0) != blocks.shape[1]
    x = torch.from_numpy(rng.standard_normal((3, k + 16)).astype(np.float32))[:, 16:]
    _check(cpu_gguf.gguf_matmul(x, blocks, fmt.type_id), x, raw[:N], fmt.type_id)
    xt = torch.from_numpy(rng.standard_normal((k, 3)).astype(np.float32)).T
    _check(cpu_gguf.gguf_matmul(xt, blocks, fmt.type_id), xt, raw[:N], fmt.type_id)


def test_bound_matmul_checks_each_call_and_matches_the_checked_one():
    fmt = block_format(int(GQ.Q8_0))
    rng = rng_for("cpu-bound")
    raw = make_blocks(fmt, N, ragged_k(fmt), rng)
    blocks = torch.from_numpy(raw)
    f = gguf_kernels.bind_gguf_matmul(blocks, fmt.type_id)
    x = torch.from_numpy(rng.standard_normal((2, ragged_k(fmt))).astype(np.float32))
    assert torch.equal(f(x), cpu_gguf.gguf_matmul(x, blocks, fmt.type_id))
    x16 = x.to(torch.bfloat16)
    y16 = f(x16)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, cpu_gguf.gguf_matmul(x16, blocks, fmt.type_id))
    _check(y16, x16, raw, fmt.type_id)
    wide = torch.cat([x, x], dim=1)[:, : x.shape[1]]  # a row stride wider than K
    assert torch.equal(f(wide), f(x))
    for rows in (cpu_gguf.LARGE_M, cpu_gguf.FP32_TILE_MIN_M - 1):  # fp32: the exact kernel
        mid = torch.from_numpy(rng.standard_normal((rows, ragged_k(fmt))).astype(np.float32))
        assert torch.equal(f(mid), cpu_gguf.gguf_matmul(mid, blocks, fmt.type_id))
        _check(f(mid), mid, raw, fmt.type_id)
    big = torch.from_numpy(rng.standard_normal((cpu_gguf.FP32_TILE_MIN_M, ragged_k(fmt)))
                           .astype(np.float32))
    _check(f(big), big, raw, fmt.type_id)  # the dequantized-tile path
    with pytest.raises(ValueError, match=r"^x: expected a CPU tensor \[M, 352\]"):
        f(x[:, :32])
    with pytest.raises(ValueError, match=r"^x: expected"):
        f(x[0])
    with pytest.raises(ValueError, match=r"^blocks: expected"):
        gguf_kernels.bind_gguf_matmul(blocks[:, :33], fmt.type_id)


def test_empty_batch_and_every_type_listed():
    fmt = block_format(int(GQ.Q4_0))
    raw = make_blocks(fmt, N, 64, rng_for("cpu-empty"))
    y = cpu_gguf.gguf_matmul(torch.empty(0, 64), torch.from_numpy(raw), fmt.type_id)
    assert y.shape == (0, N)
    assert gguf_kernels.kernel_types("cpu") == frozenset(BLOCK_FORMATS)


@pytest.mark.skipif(not cpu_gguf.int8_types(), reason="this CPU has no AVX2 int8 path")
@pytest.mark.parametrize("m", [1, cpu_gguf.INT8_MAX_M, 5, cpu_gguf.INT8_TILE_MIN_M - 1])
@pytest.mark.parametrize("name", NAMES)
def test_16_bit_activations_take_the_int8_path_within_its_bound(name: str, m: int):
    """bf16 x of up to INT8_MAX_M rows where the CPU has the bf16 GEMM, up to
    INT8_TILE_MIN_M - 1 without it (5: a group of 4 rows and one more), on a CPU with
    AVX2: x is quantized to int8 per block of 32. Its error is at most half a step
    (max|x_b| / 254) per element, so each output moves by at most sum over blocks of
    max|x_b| / 254 * sum |w| there, plus the bf16 rounding of the output. One block of x
    holds an outlier (the worst case for a per-block scale)."""
    if m > cpu_gguf.INT8_MAX_M and cpu_gguf.bf16_gemm():
        pytest.skip("from INT8_MAX_M + 1 rows the bf16 GEMM takes bf16 x")
    assert cpu_gguf.tile_min_rows(torch.bfloat16) > m
    fmt = BLOCK_FORMATS[GQ[name].value]
    assert fmt.type_id in cpu_gguf.int8_types()
    rng = rng_for("cpu-int8", name, m)
    k = ragged_k(fmt)
    raw = make_blocks(fmt, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[:, 40] = 30.0  # block 1's scale is set by this one value
    x16 = x.to(torch.bfloat16)
    blocks = torch.from_numpy(raw)
    y = cpu_gguf.gguf_matmul(x16, blocks, fmt.type_id).double()
    w = torch.from_numpy(gguf_dequantize(raw, GQ(fmt.type_id))).double()
    xd = x16.double()
    want = xd @ w.T
    step = xd.abs().view(m, -1, 32).amax(-1) / 254  # [m, blocks]
    bound = step @ w.abs().view(N, -1, 32).sum(-1).T + want.abs() * 2**-8
    assert bool(((y - want).abs() <= bound * 1.01 + 1e-6).all())
    exact = cpu_gguf.gguf_matmul(x16.float(), blocks, fmt.type_id).to(torch.bfloat16)
    assert not torch.equal(exact.double(), y)  # the int8 path ran, not the exact one


def _u8(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.uint8)


BAD = {
    "blocks": lambda: cpu_gguf.gguf_matmul(torch.ones(1, 32), _u8(3, 33), int(GQ.Q8_0)),
    "qtype": lambda: cpu_gguf.dequantize_gguf(_u8(2, 34), 99),
    "x": lambda: cpu_gguf.gguf_matmul(torch.ones(3, 64), _u8(4, 34), int(GQ.Q8_0)),
    "out": lambda: cpu_gguf.gguf_matmul(torch.ones(3, 32), _u8(4, 34), int(GQ.Q8_0),
                                        out=torch.ones(4, 3)),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument(name: str):
    with pytest.raises(ValueError, match=rf"^{name}: expected "):
        BAD[name]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 3, 17])
@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_nan_in_x_makes_its_row_nan_and_leaves_the_others(name: str, m: int,
                                                            dtype: torch.dtype):
    """Every path (exact, int8 from bf16 x, the bf16 GEMM from more rows): a NaN in one x
    row gives that row's outputs NaN, as a float product would (the int8 quantizer must
    not read it as 0), and the other rows the bits they have without it."""
    fmt = BLOCK_FORMATS[GQ[name].value]
    rng = rng_for("cpu-nan", name, m, str(dtype))
    k = ragged_k(fmt)
    blocks = torch.from_numpy(make_blocks(fmt, N, k, rng))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
    clean = cpu_gguf.gguf_matmul(x, blocks, fmt.type_id)
    x[m - 1, k // 2 + 1] = float("nan")
    y = cpu_gguf.gguf_matmul(x, blocks, fmt.type_id)
    assert bool(y[m - 1].isnan().all())
    assert torch.equal(y[: m - 1], clean[: m - 1])
