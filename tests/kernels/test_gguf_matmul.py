"""The Triton ``gguf_matmul`` (GEMV for M <= 16, GEMM above; interpreted on CPU) against
the dequantized product: every block type, both paths, fp32/bf16/fp16 x, random blocks
with negative and subnormal fp16 scales, K not a power of two, ``out`` poisoned with NaN
before the call; the tiles planned for a GPU run through the interpreter; bad input.

Tolerances are relative to the scale of each dot product, ``|x| @ |W|.T``: 1e-4 for fp32
x (fp32 accumulation in another order than the oracle's), 2e-2 for 16-bit x (the GEMM
rounds the weights to x's dtype, both paths round the output once).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ

import deepinfer_kernels
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS, BlockFormat
from deepinfer_kernels.gguf_matmul import GEMV_MAX_M, _gguf_gemv_kernel, gguf_matmul_launches
from deepinfer_kernels.reference import dequantize_gguf
from deepinfer_kernels.runtime import Target, run_launches
from tests.kernels.gguf_helpers import assert_product, make_blocks, rng_for
from tests.kernels.gguf_helpers import ragged_k as shared_ragged_k
from tests.kernels.helpers import DEVICE

FORMATS = {f.name: f for f in BLOCK_FORMATS.values()}
NAMES = list(FORMATS)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"fp32": F32, "bf16": BF16, "fp16": F16}
RTOL = {F32: 1e-4, BF16: 2e-2, F16: 2e-2}
N = 40  # weight rows: more than one N tile of the interpreter's tiles (32), a ragged last


def ragged_k(fmt: BlockFormat) -> int:
    """Several blocks, not a power of two: 7 x 32 = 224 or 3 x 256 = 768 (fewer than the
    oracle's tests: the interpreter is slow)."""
    return shared_ragged_k(fmt, blocks_of_32=7)


def case_data(fmt: BlockFormat, m: int, n: int, k: int, dtype: torch.dtype, *seed: object
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [m, k], blocks [n, row_bytes], W [n, k] float32)`` on the test device."""
    rng = rng_for(fmt.name, m, n, k, str(dtype), *seed)
    blocks = torch.from_numpy(make_blocks(fmt, n, k, rng)).to(DEVICE)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(DEVICE, dtype)
    return x, blocks, dequantize_gguf(blocks, fmt.type_id)


def poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("m", [1, 16, 17, 64])
@pytest.mark.parametrize("name", NAMES)
def test_matches_dequantized_product(name: str, m: int, dtype: torch.dtype):
    """Every type x both paths (M 1 and 16: GEMV; 17 and 64: GEMM) x dtype, ragged K."""
    fmt = FORMATS[name]
    x, blocks, w = case_data(fmt, m, N, ragged_k(fmt), dtype)
    out = poisoned(m, N, dtype)
    assert deepinfer_kernels.gguf_matmul(x, blocks, fmt.type_id, out=out) is out
    assert_product(out, x, w, RTOL[dtype])


@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("name", NAMES)
def test_whole_steps_and_new_output(name: str, m: int):
    """K a whole number of the kernels' K steps, several of them (no ragged last step);
    no ``out``: a new ``[M, N]`` tensor in x's dtype."""
    fmt = FORMATS[name]
    k = 2048 if fmt.block_weights == 32 else 4096  # 64 or 128 groups of 32 weights
    x, blocks, w = case_data(fmt, m, 24, k, F32, "whole")
    y = deepinfer_kernels.gguf_matmul(x, blocks, fmt.type_id)
    assert y.shape == (m, 24) and y.dtype == F32 and y.device.type == DEVICE.type
    assert_product(y, x, w, RTOL[F32])


# The GPU's tiles (sm_90), each path's configurations: GEMV BLOCK_M 1 / 4 / 16 (8 rows a
# program, 32 // BLOCK_M groups a step), GEMM BLOCK_M 64 and 128 (grouped launch order
# over several m tiles). bf16 is left out: the interpreter multiplies bf16 dot operands
# as raw bits unless they are upcast, which only interpreter-planned launches do.
GPU_TILES = [(name, m, dtype) for name, (m, dtype) in zip(
    NAMES, [(1, F32), (130, F16), (4, F16), (40, F32), (16, F16), (130, F32), (1, F16),
            (72, F16)])] + [("Q4_K", 16, F32), ("Q8_0", 40, F16)]


@pytest.mark.parametrize("name,m,dtype", GPU_TILES,
                         ids=[f"{n}-m{m}-{str(d)[6:]}" for n, m, d in GPU_TILES])
def test_gpu_tiles_through_the_interpreter(name: str, m: int, dtype: torch.dtype):
    """Launches planned for sm_90 (not the interpreter's big tiles) give the same
    product: clamped rows across several 8-row GEMV programs, ragged and whole K steps,
    the GEMM's m tiles in grouped order."""
    fmt = FORMATS[name]
    k = 2048 if fmt.block_weights == 32 else 1280  # 64 groups (whole steps) or 40
    n = 20
    x, blocks, w = case_data(fmt, m, n, k, dtype, "gpu")
    out = poisoned(m, n, dtype)
    (launch,) = gguf_matmul_launches(x, blocks, fmt, out, Target((9, 0), 132, False))
    assert (launch.kernel is _gguf_gemv_kernel) == (m <= GEMV_MAX_M)
    run_launches([launch])
    assert_product(out, x, w, RTOL[dtype])


def test_strided_operands():
    """A transposed x, weight rows with padding between them (an odd row stride: the
    fp16 fields are read a byte at a time), a transposed ``out``."""
    fmt = FORMATS["Q5_1"]
    k = ragged_k(fmt)
    for m in (5, 20):
        x, blocks, w = case_data(fmt, m, N, k, BF16, "strided")
        x_t = x.T.contiguous().T
        padded = torch.full((N, blocks.shape[1] + 7), 0xFF, dtype=torch.uint8, device=DEVICE)
        padded[:, :blocks.shape[1]] = blocks
        out = poisoned(N, m, BF16).T
        assert not x_t.is_contiguous() and not out.is_contiguous()
        got = deepinfer_kernels.gguf_matmul(x_t, padded[:, :blocks.shape[1]], fmt.type_id,
                                            out=out)
        assert got is out
        assert_product(out, x, w, RTOL[BF16])


def test_empty_shapes():
    """No rows of x, or no weight rows: an empty result, no launch."""
    fmt = FORMATS["Q4_0"]
    blocks = torch.zeros((3, fmt.row_bytes(64)), dtype=torch.uint8, device=DEVICE)
    y = deepinfer_kernels.gguf_matmul(torch.ones((0, 64), device=DEVICE), blocks, fmt.type_id)
    assert y.shape == (0, 3)
    none = torch.zeros((0, fmt.row_bytes(64)), dtype=torch.uint8, device=DEVICE)
    assert deepinfer_kernels.gguf_matmul(torch.ones((2, 64), device=DEVICE), none,
                                         fmt.type_id).shape == (2, 0)


# --- bad input -------------------------------------------------------------------------------

def _u8(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.uint8, device=DEVICE)


def _x(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.ones(shape, device=DEVICE).to(dtype)


Q8, Q4K = int(GQ.Q8_0), int(GQ.Q4_K)
matmul = deepinfer_kernels.gguf_matmul
BAD_INPUTS: dict[str, tuple[str, Callable[[], object]]] = {
    "x_int": ("x", lambda: matmul(_x(3, 32, dtype=torch.int32), _u8(4, 34), Q8)),
    "x_fp64": ("x", lambda: matmul(_x(3, 32, dtype=torch.float64), _u8(4, 34), Q8)),
    "x_1d": ("x", lambda: matmul(_x(32), _u8(4, 34), Q8)),
    "k_mismatch": ("x", lambda: matmul(_x(3, 64), _u8(4, 3 * 34), Q8)),
    "k_mismatch_k": ("x", lambda: matmul(_x(3, 512), _u8(4, 144), Q4K)),
    "blocks_int8": ("blocks", lambda: matmul(_x(3, 32), _u8(4, 34).to(torch.int8), Q8)),
    "blocks_fp16": ("blocks", lambda: matmul(_x(3, 32), _x(4, 17, dtype=F16), Q8)),
    "blocks_row_bytes": ("blocks", lambda: matmul(_x(3, 32), _u8(4, 35), Q8)),
    "blocks_strided_bytes": ("blocks", lambda: matmul(_x(3, 32), _u8(34, 4).T, Q8)),
    "qtype_unknown": ("qtype", lambda: matmul(_x(3, 32), _u8(4, 34), 99)),
    "qtype_f16": ("qtype", lambda: matmul(_x(3, 32), _u8(4, 34), int(GQ.F16))),
    "qtype_name": ("qtype", lambda: matmul(_x(3, 32), _u8(4, 34), "Q8_0")),
    "out_shape": ("out", lambda: matmul(_x(3, 32), _u8(4, 34), Q8, out=_x(4, 3))),
    "out_dtype": ("out", lambda: matmul(_x(3, 32), _u8(4, 34), Q8, out=_x(3, 4, dtype=BF16))),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case: str):
    name, call = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=rf"^{name}: expected "):
        call()


def test_bad_input_writes_nothing():
    """Checks run before any launch: a refused call leaves ``out`` as it was."""
    out = poisoned(3, 4, F32)
    with pytest.raises(ValueError, match="^x: expected 96 columns"):
        matmul(_x(3, 64), _u8(4, 3 * 34), Q8, out=out)
    assert torch.isnan(out).all()
