"""The plain-torch GGUF oracle (``dequantize_gguf``, ``gguf_matmul``) against the ``gguf``
package, ggml's own Python reference: every block type, blocks quantized by ``gguf``
where it can quantize the type and random bytes where it cannot, fp16 scales that include
negative and subnormal values, fresh inputs per case; the shared block table; bad input.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize

import deepinfer_kernels
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS, BlockFormat, block_format
from deepinfer_kernels.reference import dequantize_gguf, gguf_matmul
from tests.kernels.gguf_helpers import (
    FP16_FIELDS,
    assert_product,
    make_blocks,
    ragged_k,
    rng_for,
)
from tests.kernels.helpers import DEVICE

FORMATS = list(BLOCK_FORMATS.values())
NAMES = [f.name for f in FORMATS]


# --- the block table -----------------------------------------------------------------------

def test_block_table_matches_gguf():
    assert sorted(NAMES) == sorted(FP16_FIELDS)  # the eight types of the issue
    for fmt in FORMATS:
        assert GQ(fmt.type_id).name == fmt.name
        assert gguf.GGML_QUANT_SIZES[GQ(fmt.type_id)] == (fmt.block_weights, fmt.block_bytes)
        assert block_format(GQ(fmt.type_id)) is fmt
        assert block_format(fmt.type_id) is fmt


def test_row_sizes_and_block_boundaries():
    q4k = block_format(GQ.Q4_K)
    assert q4k.row_bytes(768) == 3 * 144 and q4k.row_weights(3 * 144) == 768
    assert q4k.bits_per_weight == 4.5
    with pytest.raises(ValueError, match=r"^k: .*multiple of 256"):
        q4k.row_bytes(300)
    with pytest.raises(ValueError, match=r"^w_down: "):
        q4k.row_bytes(0, name="w_down")
    with pytest.raises(ValueError, match=r"^row_bytes: .*multiple of 144"):
        q4k.row_weights(145)


# --- dequantize_gguf -----------------------------------------------------------------------

@pytest.mark.parametrize("rows,blocks_per_row", [(7, 5), (1, 3)])
@pytest.mark.parametrize("name", NAMES)
def test_dequantize_equals_gguf_bit_for_bit(name: str, rows: int, blocks_per_row: int):
    # Exact: each weight is the same one to three fp32 products / sums, in the same order,
    # as gguf.quants computes it, and IEEE fp32 rounds them the same in numpy and torch.
    fmt = BLOCK_FORMATS[GQ[name].value]
    raw = make_blocks(fmt, rows, blocks_per_row * fmt.block_weights, rng_for(name, rows))
    want = torch.from_numpy(gguf_dequantize(raw, GQ(fmt.type_id)))
    got = dequantize_gguf(torch.from_numpy(raw).to(DEVICE), GQ(fmt.type_id))
    assert got.dtype == torch.float32 and got.device.type == DEVICE.type
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_strided_rows(name: str):
    """Rows with a gap between them (row stride > row bytes) and every other row."""
    fmt = BLOCK_FORMATS[GQ[name].value]
    raw = torch.from_numpy(make_blocks(fmt, 6, 2 * fmt.block_weights, rng_for(name, "s")))
    padded = torch.cat([raw, torch.full((6, 5), 0xFF, dtype=torch.uint8)], dim=1)
    whole = dequantize_gguf(raw, fmt.type_id)
    torch.testing.assert_close(dequantize_gguf(padded[:, :raw.shape[1]], fmt.type_id), whole,
                               rtol=0, atol=0)
    torch.testing.assert_close(dequantize_gguf(raw[1::2], fmt.type_id), whole[1::2],
                               rtol=0, atol=0)


# --- gguf_matmul ---------------------------------------------------------------------------

# Error bound on the scale of the dot products, |x| @ |W|.T: fp32 accumulation over K of
# a few hundred stays far inside 1e-5 of it; 16-bit outputs are rounded once at the end,
# a relative 2^-9 (bf16) or 2^-12 (fp16) of the result, inside 1e-2.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
N = 24  # output features


def check_product(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, fmt: BlockFormat) -> None:
    """``y`` against ``x @ W.T`` in float64, W from ``gguf.quants``."""
    w = torch.from_numpy(gguf_dequantize(raw, GQ(fmt.type_id)))
    assert_product(y, x, w, RTOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 16, 17, 64])
@pytest.mark.parametrize("name", NAMES)
def test_gguf_matmul_matches_dequantized_product(name: str, m: int, dtype: torch.dtype):
    fmt = BLOCK_FORMATS[GQ[name].value]
    rng = rng_for(name, m, str(dtype))
    k = ragged_k(fmt)
    raw = make_blocks(fmt, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(DEVICE, dtype)
    y = gguf_matmul(x, torch.from_numpy(raw).to(DEVICE), fmt.type_id)
    assert y.dtype == dtype and y.shape == (m, N) and y.device.type == DEVICE.type
    check_product(y, x, raw, fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_matmul_out_and_strided_x(dtype: torch.dtype):
    """``out`` is written and returned; a transposed (non-contiguous) x is accepted."""
    fmt = block_format(GQ.Q5_K)
    rng = rng_for("out", str(dtype))
    k = ragged_k(fmt)
    raw = make_blocks(fmt, N, k, rng)
    blocks = torch.from_numpy(raw).to(DEVICE)
    x = torch.from_numpy(rng.standard_normal((k, 5)).astype(np.float32)).to(DEVICE, dtype).T
    assert not x.is_contiguous()
    out = torch.full((5, N), float("nan"), dtype=dtype, device=DEVICE)
    assert gguf_matmul(x, blocks, fmt.type_id, out=out) is out
    check_product(out, x, raw, fmt)


# --- bad input -------------------------------------------------------------------------------

def _u8(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.uint8, device=DEVICE)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(shape, device=DEVICE).to(dtype)


Q8, Q4K = int(GQ.Q8_0), int(GQ.Q4_K)
BAD_INPUTS: dict[str, tuple[str, Callable[[], object]]] = {
    # a row that is not a whole number of blocks
    "row_bytes_q8": ("blocks", lambda: dequantize_gguf(_u8(2, 35), Q8)),
    "row_bytes_k": ("blocks", lambda: dequantize_gguf(_u8(2, 144 + 32), Q4K)),
    "row_bytes_empty": ("blocks", lambda: dequantize_gguf(_u8(2, 0), Q8)),
    "row_bytes_matmul": ("blocks", lambda: gguf_matmul(_x(1, 32), _u8(3, 33), Q8)),
    # not raw bytes
    "blocks_int8": ("blocks", lambda: dequantize_gguf(_u8(2, 34).to(torch.int8), Q8)),
    "blocks_1d": ("blocks", lambda: dequantize_gguf(_u8(34), Q8)),
    "blocks_numpy": ("blocks", lambda: dequantize_gguf(np.ones((2, 34), np.uint8), Q8)),
    "blocks_strided_bytes": ("blocks", lambda: dequantize_gguf(_u8(34, 2).T, Q8)),
    # unknown types
    "qtype_unknown": ("qtype", lambda: dequantize_gguf(_u8(2, 34), 99)),
    "qtype_f16": ("qtype", lambda: dequantize_gguf(_u8(2, 34), int(GQ.F16))),
    "qtype_q2_k": ("qtype", lambda: dequantize_gguf(_u8(2, 84), int(GQ.Q2_K))),
    "qtype_name": ("qtype", lambda: dequantize_gguf(_u8(2, 34), "Q8_0")),
    "qtype_bool": ("qtype", lambda: dequantize_gguf(_u8(2, 18), True)),
    "qtype_matmul": ("qtype", lambda: gguf_matmul(_x(1, 32), _u8(3, 34), 99)),
    # x
    "k_mismatch": ("x", lambda: gguf_matmul(_x(3, 64), _u8(4, 3 * 34), Q8)),
    "k_mismatch_k": ("x", lambda: gguf_matmul(_x(3, 512), _u8(4, 144), Q4K)),
    "x_int": ("x", lambda: gguf_matmul(_x(3, 32, dtype=torch.int32), _u8(4, 34), Q8)),
    "x_1d": ("x", lambda: gguf_matmul(_x(32), _u8(4, 34), Q8)),
    # out
    "out_shape": ("out", lambda: gguf_matmul(_x(3, 32), _u8(4, 34), Q8, out=_x(4, 3))),
    "out_dtype": ("out", lambda: gguf_matmul(_x(3, 32), _u8(4, 34), Q8,
                                             out=_x(3, 4, dtype=torch.bfloat16))),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case: str):
    name, call = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=rf"^{name}: expected "):
        call()


def test_error_messages_say_what_was_expected():
    with pytest.raises(ValueError, match=r"multiple of 34 \(whole Q8_0 blocks\), got 35"):
        dequantize_gguf(_u8(2, 35), Q8)
    with pytest.raises(ValueError, match=r"Q4_K=12.*got 99"):
        dequantize_gguf(_u8(2, 34), 99)
    with pytest.raises(ValueError, match=r"^x: expected 96 columns .*got shape \(3, 64\)"):
        gguf_matmul(_x(3, 64), _u8(4, 3 * 34), Q8)


def test_kernel_package_does_not_import_gguf():
    """The kernels run from raw bytes and the block table: ``gguf`` is a test-time and
    loader dependency only."""
    root = Path(deepinfer_kernels.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "gguf"]
    assert not offenders
