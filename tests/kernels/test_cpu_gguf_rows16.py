"""The row-group kernels (``deepinfer_kernels.cpu_gguf_rows16``): Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K and Q6_K blocks repacked in 16-row groups, against the dequantized product in
float64 (of int8-quantized x, or for Q6_K's many-row path of bf16 x and weights). Random
blocks with negative and subnormal fp16 scales, fresh data per case, x rows across the
kernel's tiles (8 rows with AVX-512, 4 with AVX2) and remainders, fp32/bf16/fp16
activations; the packing's round trip; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize

from deepinfer_kernels import cpu_gguf
from deepinfer_kernels import cpu_gguf_rows16 as rows16
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
from tests.kernels.gguf_helpers import assert_product, make_blocks, ragged_k, rng_for

pytestmark = pytest.mark.skipif(not rows16.rows16_types(),
                                reason="no AVX2 build: no row-group kernel")

NAMES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
N = 48  # three row groups
# The output's own rounding, relative to |y|, by x's dtype (the result is written in it).
OUT_ROUNDING = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _case(name: str, m: int, dtype: torch.dtype, *salt: object):
    fmt = BLOCK_FORMATS[GQ[name].value]
    if fmt.type_id not in rows16.rows16_types():
        pytest.skip(f"{name} is not packed in this build (Q6_K: AVX512-VNNI without -BF16)")
    rng = rng_for("rows16", name, m, str(dtype), *salt)
    k = ragged_k(fmt)
    raw = make_blocks(fmt, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[:, 40] = 30.0  # an outlier sets block 1's int8 scale (the worst case for a block)
    return fmt, raw, x.to(dtype)


def test_types_are_the_ones_the_kernel_packs():
    """All of NAMES; Q6_K in AVX2 builds (int8 products for any number of rows) and in
    AVX-512 ones with AVX512-BF16 (its many-row bf16 path), not with AVX512-VNNI alone."""
    q6k = GQ.Q6_K.value
    assert rows16.rows16_types() - {q6k} == {GQ[n].value for n in NAMES} - {q6k}
    if rows16.rows16_bf16_min_rows(q6k) is not None:
        assert q6k in rows16.rows16_types()
    assert rows16.rows16_bf16_min_rows(GQ.Q4_0.value) is None


@pytest.mark.parametrize("name", NAMES)
def test_pack_and_unpack_round_trip_in_place(name: str):
    fmt, raw, _ = _case(name, 1, torch.float32, "pack")
    blocks = torch.from_numpy(raw.copy())
    rows16.pack_rows16(blocks, fmt.type_id)
    assert blocks.shape == raw.shape  # the same bytes, rearranged in place
    assert not torch.equal(blocks, torch.from_numpy(raw))
    rows16.unpack_rows16(blocks, fmt.type_id)
    assert torch.equal(blocks, torch.from_numpy(raw))


def _takes_bf16(name: str, m: int) -> bool:
    """Whether m x rows of a packed ``name`` weight take the bf16 path."""
    rows = rows16.rows16_bf16_min_rows(GQ[name].value)
    return rows is not None and m >= rows


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it, in float64: per block of 32, codes round-to-nearest-
    even of x * (127 / amax) in fp32, times the step amax / 127 (fp32)."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv)
    return (codes.double() * (amax / 127.0).double()).view(x.shape)


def _check_product(name: str, m: int, dtype: torch.dtype) -> None:
    """m rows of x through a packed ``name`` weight against the product in float64 of
    what the kernel multiplies: int8-quantized x (``_int8_rows``) and the weights, to fp32
    sums and the output's rounding; on Q6_K's many-row path x and the weights each
    rounded to bf16, to fp32 sums over K. For 16-bit x, also within the issue's 2e-2 of
    the unquantized product (int8 moves an element by at most half a step, 1/254 of its
    block's largest |x|)."""
    fmt, raw, x = _case(name, m, dtype)
    blocks = torch.from_numpy(raw.copy())
    rows16.pack_rows16(blocks, fmt.type_id)
    y = rows16.rows16_matmul(x, blocks, fmt.type_id)
    assert y.dtype == dtype and y.shape == (m, N)
    w = torch.from_numpy(gguf_dequantize(raw, GQ(fmt.type_id))).double()
    if _takes_bf16(name, m):
        xq, wq = x.bfloat16().double(), w.float().bfloat16().double()
        tol = 2.0**-23 * x.shape[1]  # fp32 sums: K roundings of 2^-24 at most
    else:
        xq, wq, tol = _int8_rows(x), w, 1e-5
    want = xq @ wq.T
    bound = (xq.abs() @ wq.abs().T) * tol + want.abs() * OUT_ROUNDING[dtype]
    assert bool(((y.double() - want).abs() <= bound).all())
    if dtype != torch.float32:
        assert_product(y, x, w.float(), 2e-2)
    bound_fn = rows16.bind_rows16_matmul(blocks, fmt.type_id)
    assert torch.equal(bound_fn(x), y)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                                 ids=["fp32", "bf16", "fp16"])


@DTYPES
@pytest.mark.parametrize("m", [1, 5, 8, 9, 19])
@pytest.mark.parametrize("name", NAMES)
def test_matmul_is_the_int8_product(name: str, m: int, dtype: torch.dtype):
    """1 row, the 8-row tile, a tile and a remainder, two tiles and a remainder of 3;
    three groups of 16 weight rows (``_check_product``)."""
    _check_product(name, m, dtype)


@DTYPES
@pytest.mark.parametrize("extra", [0, 3], ids=["tiles", "remainder"])
def test_q6k_many_rows_take_the_bf16_product(extra: int, dtype: torch.dtype):
    """From ``rows16_bf16_min_rows`` x rows on, Q6_K's groups are decoded to bf16 and
    multiplied with bf16 x (whole 8-row tiles, and a remainder of 3)."""
    rows = rows16.rows16_bf16_min_rows(GQ.Q6_K.value)
    if rows is None:
        pytest.skip("no AVX512-BF16: Q6_K takes int8 products for any number of rows")
    assert _takes_bf16("Q6_K", rows) and not _takes_bf16("Q6_K", rows - 1)
    _check_product("Q6_K", rows + extra, dtype)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_many_rows_give_the_bits_of_their_rows_taken_apart(name: str):
    """x rows are independent: 2000 rows (the kernel runs so many in chunks that stay in
    a core's L2, 256 KB of codes: 744 rows at K = 352, 341 at 768) give the bits of the
    same rows multiplied 7 at a time."""
    fmt, raw, x = _case(name, 2000, torch.bfloat16, "chunks")
    blocks = torch.from_numpy(raw.copy())
    rows16.pack_rows16(blocks, fmt.type_id)
    f = rows16.bind_rows16_matmul(blocks, fmt.type_id)
    y = f(x)
    assert torch.equal(y, torch.cat([f(x[i:i + 7]) for i in range(0, 2000, 7)]))


@pytest.mark.parametrize("m", [1, 9, 43])
@pytest.mark.parametrize("name", NAMES)
def test_a_nan_in_x_makes_its_row_nan_and_leaves_the_others(name: str, m: int):
    """A NaN in one x row: that row's outputs all NaN (as a float product gives; the
    int8 quantizer must not read it as 0), the other rows the bits they have without it.
    43 rows: Q6_K's bf16 path too."""
    fmt, raw, x = _case(name, m, torch.bfloat16, "nan")
    blocks = torch.from_numpy(raw.copy())
    rows16.pack_rows16(blocks, fmt.type_id)
    clean = rows16.rows16_matmul(x, blocks, fmt.type_id)
    x[m // 2, 33] = float("nan")
    y = rows16.rows16_matmul(x, blocks, fmt.type_id)
    assert bool(y[m // 2].isnan().all())
    keep = torch.arange(m) != m // 2
    assert torch.equal(y[keep], clean[keep])


@pytest.mark.parametrize("name", NAMES)
def test_lookup_gathers_the_rows_the_unpacked_weight_holds(name: str):
    """A tied embedding's lookup on the packed weight: each id's row back to its blocks,
    then dequantized: the values a lookup on the row-major blocks gives, bit for bit,
    for ids in every group and position, repeated and out of order."""
    fmt, raw, _ = _case(name, 1, torch.float32, "lookup")
    blocks = torch.from_numpy(raw.copy())
    rows16.pack_rows16(blocks, fmt.type_id)
    ids = torch.tensor([47, 0, 16, 31, 5, 5, 32, 15])
    plain = torch.from_numpy(raw)
    for dtype in (torch.float32, torch.bfloat16):
        got = rows16.bind_rows16_lookup(blocks, fmt.type_id, dtype)(ids)
        want = cpu_gguf.dequantize_gguf(plain.index_select(0, ids), fmt.type_id, dtype)
        assert got.dtype == dtype and torch.equal(got, want)
    lookup = rows16.bind_rows16_lookup(blocks, fmt.type_id, torch.float32)
    assert lookup(torch.zeros(0, dtype=torch.int64)).shape == (0, raw.shape[1] // fmt.block_bytes
                                                               * fmt.block_weights)
    with pytest.raises(IndexError, match=r"ids\[2\] = 48 is outside the embedding's 48 rows"):
        lookup(torch.tensor([1, 2, 48]))
    with pytest.raises(IndexError, match=r"ids\[0\] = -1"):
        lookup(torch.tensor([-1]))


def test_bad_input_is_named():
    fmt, raw, x = _case("Q4_1", 2, torch.bfloat16, "bad")
    blocks = torch.from_numpy(raw.copy())
    with pytest.raises(ValueError, match="blocks"):  # 40 rows: not whole groups of 16
        rows16.pack_rows16(blocks[:40].clone(), fmt.type_id)
    with pytest.raises(ValueError, match="qtype"):  # F16: not a block type
        rows16.pack_rows16(blocks[:16].clone(), GQ.F16.value)
    assert not rows16.rows16_usable(blocks[:16], GQ.F16.value)
    assert not rows16.rows16_usable(blocks[:40], fmt.type_id)
    rows16.pack_rows16(blocks, fmt.type_id)
    f = rows16.bind_rows16_matmul(blocks, fmt.type_id)
    with pytest.raises(ValueError, match=r"x.*\[M, 352\]"):
        f(x[:, :320])
    with pytest.raises(ValueError, match="x"):
        rows16.rows16_matmul(x.to(torch.int32), blocks, fmt.type_id)
