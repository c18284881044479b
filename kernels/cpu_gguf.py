"""GGUF-quantized weights on the CPU: the matmul and the dequantization of
``kernels/csrc/gguf_cpu.c`` (built into the native library, see ``cpu_native``).

Paths, picked by the activations' dtype and the number of rows M (measured with
``benchmarks/bench_quant.py``):

- M < ``LARGE_M`` (single-stream decode): the C kernel reads the weights as stored (4-8
  bits a weight) and decodes each row into fp32 once for all M rows; a step's cost is
  the bytes of the file, not of a dequantized copy. For 16-bit activations, every type
  takes ``kernels/csrc/gguf_int8_cpu.c`` where the CPU has AVX2 (``int8_types()``): x is
  quantized per block of 32 to int8 and multiplied with the weight codes by integer dot
  products, as llama.cpp does, ~4x fewer instructions a weight than decoding to fp32
  (a K-quant as sub-blocks of 32, Q6_K with a scale per half). Its error, at most half
  a step of 1/127 of a block's largest |x| per element, stays inside the 2e-2 that
  16-bit activations are held to; fp32 activations always take the exact path.
- bf16 activations from 2 rows (from ``LARGE_M`` for the int8 types), where the CPU has
  AVX512-BF16 (``bf16_gemm()``): ``kernels/csrc/gguf_gemm_bf16_cpu.c`` decodes 32
  weight rows at a time into a bf16 panel that stays in cache and multiplies every x
  row against it. No dequantized copy of the weight is ever whole; on 2 cores it runs
  at the speed of torch's bf16 GEMM on a dequantized weight from memory, or faster
  (batched decode: 1.2x the throughput of dequantize-at-load).
- Otherwise, from ``tile_min_rows(dtype)`` rows: the weight is dequantized by the C
  kernel into a reused tile and multiplied by torch's BLAS. The tile is fp32 unless the
  CPU has AVX512-BF16 (a bf16 BLAS without it is emulated: 3-4x slower than fp32's).
  fp32 activations keep the exact kernel up to 32 rows (``FP32_TILE_MIN_M``); 16-bit
  ones the int8 kernel up to 63 (``INT8_TILE_MIN_M``) where the CPU has it but no bf16
  GEMM (AVX2, or VNNI without AVX512-BF16), else up to ``LARGE_M - 1``.

All accumulate in fp32. ``bind_gguf_matmul`` checks a weight once and returns the
per-call function a layer keeps (the plan/run split: a decoder makes ~120 of these calls
a token, so per-call checks would cost as much as the small matmuls themselves).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_kernels.cpu_native import native_library
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
from deepinfer_kernels.validation import check_gguf_blocks, check_gguf_matmul_args, fail
from deepinfer_kernels.workspace import scratch

__all__ = ["FP32_TILE_MIN_M", "INT8_MAX_M", "INT8_TILE_MIN_M", "LARGE_M", "available", "bf16_gemm",
           "bind_gguf_matmul", "dequantize_gguf", "gguf_matmul", "int8_types", "kernel_types",
           "tile_min_rows"]

#: Activation rows from which the matmul stops reading the weights row by row: the bf16
#: GEMM or, without it, a dequantized tile and torch's BLAS. With the tile, on 2 cores
#: (bf16, the default model, 128 requests of 16-128 tokens): 32 gave 0.78x the
#: throughput of dequantize-at-load, 16 about 0.9x, 4 about parity; one row
#: (single-stream decode) is where the blocks win, 3x.
LARGE_M = 4
#: fp32 activations: the exact kernel (weights read as stored, each row decoded once for
#: all x rows) up to 32 rows, a dequantized tile from 33. Measured (2 cores, calls
#: interleaved, tile / exact time; Q4_1 1536x576 and 576x1536, Q8_0 49152x576 (the tied
#: head)): 4 rows 10.8 / 2.3 / 6.9x, 16 rows 4.0 / 1.4 / 2.3x, 32 rows 2.3 / 0.92 / 1.5x,
#: 64 rows 1.6 / 0.73 / 1.0x. With LARGE_M for fp32 too, a decode step of 4-8 sequences
#: wrote the head's 113 MB fp32 tile each step: 27-52 tok/s against 111 at 3 sequences.
FP32_TILE_MIN_M = 33
#: With AVX512-BF16, the most bf16 rows that the types with the int8 kernel keep it for;
#: from one more the bf16 GEMM takes them (``_uses_gemm``; ``decoder_cpu.c`` is handed
#: the same number, so the fused decode step picks the same kernels). Below ``LARGE_M``.
#: Measured on the default model's decode steps (2 cores, fused step, A/B in one
#: process): at 2 sequences the int8 kernel is 1.1-1.35x faster, at 3 the GEMM by ~4%.
INT8_MAX_M = 2
#: 16-bit activations on a CPU with the int8 kernel but no bf16 GEMM: the rows from which
#: a weight is dequantized into an fp32 tile for torch's BLAS instead. Measured (2-core
#: AVX2 EPYC, best of 5, int8 / fp32 tile ms; Q4_1 1536x576 and 576x1536, Q8_0 49152x576):
#: 16 rows 0.38 / 1.00, 0.42 / 0.96, 10.7 / 71.7; 64 rows 1.47 / 1.48, 1.58 / 1.41,
#: 44.1 / 92.5; 256 rows 5.8 / 3.4, 6.5 / 3.3. The bf16 tile it replaced took 1.2 s a
#: decode step of 64 sequences (torch's bf16 BLAS without AVX512-BF16).
INT8_TILE_MIN_M = 64
_DIRECT = (torch.float32, torch.bfloat16)  # x and out dtypes the C kernel reads and writes
_ERRORS = {1: "an unknown GGUF type", 2: "a row that is not whole blocks",
           3: "out of memory for a row buffer", 4: "no bf16 GEMM in this build"}


def available() -> bool:
    """Whether the native library (and so these kernels) is built and loadable."""
    return native_library() is not None


@functools.lru_cache(maxsize=1)
def int8_types() -> frozenset[int]:
    """ggml type ids with the int8-activation path on this CPU (empty without AVX2)."""
    lib = native_library()
    if lib is None:
        return frozenset()
    mask = lib.gguf_int8_types()
    return frozenset(i for i in BLOCK_FORMATS if (mask >> i) & 1)


@functools.lru_cache(maxsize=1)
def bf16_gemm() -> bool:
    """Whether this CPU's build has the bf16 GEMM that decodes weight panels in place
    (AVX512-BF16): bf16 activations of ``LARGE_M`` rows or more take it."""
    lib = native_library()
    return lib is not None and bool(lib.gguf_gemm_bf16_available())


def kernel_types() -> frozenset[int]:
    """The ggml type ids these kernels compute on (none without the native library)."""
    return frozenset(BLOCK_FORMATS) if available() else frozenset()


def _library():  # the ctypes library, or a RuntimeError saying why it is missing
    lib = native_library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (no C compiler, or "
                           "DEEPINFER_NATIVE_CPU=0): GGUF weights cannot stay quantized")
    return lib


def _check_rc(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what}: the native kernel refused: {_ERRORS.get(rc, rc)}")


def _dequantize_into(blocks: torch.Tensor, qtype: int, k: int, out: torch.Tensor) -> None:
    """Decode checked ``blocks`` ``[N, row_bytes]`` into ``out`` ``[N, K]`` (fp32 or bf16,
    unit last stride)."""
    rc = _library().gguf_dequantize_cpu(
        blocks.data_ptr(), blocks.shape[0], k, blocks.stride(0), qtype, out.data_ptr(),
        out.stride(0), int(out.dtype == torch.bfloat16), torch.get_num_threads())
    _check_rc(rc, "dequantize_gguf")


def dequantize_gguf(blocks: torch.Tensor, qtype: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode GGUF block rows on the CPU.

    blocks: uint8 ``[N, row_bytes]`` CPU, unit last stride (see
    ``deepinfer_kernels.gguf_reference.dequantize_gguf``); qtype: ggml type id.
    Returns ``[N, K]`` in ``dtype`` (float32 and bfloat16 written directly, others cast
    from float32); equal to the reference to fp32 rounding (the C decoder may fuse a
    multiply-add the reference rounds twice).
    """
    b, fmt, k = check_gguf_blocks(blocks, qtype, torch.device("cpu"))
    direct = dtype in (torch.float32, torch.bfloat16)
    out = torch.empty((b.shape[0], k), dtype=dtype if direct else torch.float32)
    if b.shape[0]:
        _dequantize_into(b, fmt.type_id, k, out)
    return out if direct else out.to(dtype)


def _uses_gemm(m: int, dtype: torch.dtype, qtype: int) -> bool:
    """Whether ``m`` rows of ``dtype`` go to the bf16 GEMM: bf16 from 2 rows, except that
    the types with the int8 path keep it up to ``INT8_MAX_M`` rows (measured, 2 cores: from 2
    rows the GEMM beats the exact kernel, which decodes every weight to fp32; the int8
    kernel stays ahead of it at 2 rows). ``decoder_cpu.c:product`` makes the same
    choice, so the fused decode step gives the same bits."""
    if dtype != torch.bfloat16 or m < 2 or not bf16_gemm():
        return False
    return m > INT8_MAX_M or qtype not in int8_types()


def tile_min_rows(dtype: torch.dtype) -> int:
    """Rows of ``dtype`` activations from which a weight without the bf16 GEMM is
    dequantized into a tile for torch's BLAS: ``FP32_TILE_MIN_M`` for float32;
    ``INT8_TILE_MIN_M`` for 16-bit activations where the int8 kernel exists without the
    bf16 GEMM (every type has the int8 kernel where one has); else ``LARGE_M``."""
    if dtype == torch.float32:
        return FP32_TILE_MIN_M
    return INT8_TILE_MIN_M if int8_types() and not bf16_gemm() else LARGE_M


def _tile_dtype(dtype: torch.dtype) -> torch.dtype:
    """The tile's dtype: bf16 for bf16 activations on a CPU with native bf16 (the bf16
    GEMM's build), fp32 otherwise (torch's bf16 BLAS is emulated there)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and bf16_gemm() else torch.float32


def _matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int,
            out: torch.Tensor | None) -> torch.Tensor:
    """Checked arguments: ``x [M, K] @ W.T`` -> ``[M, N]`` in x's dtype."""
    m, n = x.shape[0], blocks.shape[0]
    if x.stride(1) == 1 and _uses_gemm(m, x.dtype, qtype):
        # Decoded panel by panel inside the GEMM (gguf_gemm_bf16_cpu.c): no tile.
        direct = out is not None and out.dtype == x.dtype and out.stride(1) == 1
        res = out if direct else torch.empty((m, n), dtype=x.dtype)
        _check_rc(_library().gguf_gemm_bf16_cpu(
            x.data_ptr(), m, k, x.stride(0), blocks.data_ptr(), n, blocks.stride(0), qtype,
            res.data_ptr(), res.stride(0), 1, torch.get_num_threads()), "gguf_matmul")
        return res if direct or out is None else out.copy_(res)
    if m >= tile_min_rows(x.dtype):
        tile_dtype = _tile_dtype(x.dtype)
        w = scratch("gguf-tile", n * k, tile_dtype).view(n, k)
        _dequantize_into(blocks, qtype, k, w)
        y = F.linear(x.to(tile_dtype), w)
        if out is None:
            return y.to(x.dtype)
        return out.copy_(y)
    # float32 and bfloat16 are read and written by the kernel as they are (no torch op
    # per call: a decoder makes ~120 of these calls a token); float16 goes through fp32.
    direct_x = x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == 1
    xk = x if direct_x else x.float().contiguous()
    res_dtype = xk.dtype
    direct = out is not None and out.dtype == res_dtype and out.stride(1) == 1
    res = out if direct else torch.empty((m, n), dtype=res_dtype)
    if m:
        bf16 = int(res_dtype == torch.bfloat16)
        lib = _library()
        kernel = (lib.gguf_matmul_int8_cpu if x.dtype != torch.float32
                  and qtype in int8_types() else lib.gguf_matmul_cpu)
        rc = kernel(xk.data_ptr(), m, k, xk.stride(0), bf16, blocks.data_ptr(), n,
                    blocks.stride(0), qtype, res.data_ptr(), res.stride(0), bf16,
                    torch.get_num_threads())
        _check_rc(rc, "gguf_matmul")
    if direct:
        return res
    if out is None:
        return res if res.dtype == x.dtype else res.to(x.dtype)
    return out.copy_(res)


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` on the CPU for a weight kept as GGUF blocks (the contract of
    ``deepinfer_kernels.gguf_reference.gguf_matmul``).

    x: ``[M, K]`` float32, bfloat16 or float16 (unit last stride or not); blocks: uint8
    ``[N, row_bytes]``; out: optional ``[M, N]`` in x's dtype. Returns ``[M, N]`` in x's
    dtype, accumulated in float32. ``ValueError`` naming the argument on bad input.
    """
    xt, b, fmt = check_gguf_matmul_args(x, blocks, qtype, out)
    if xt.device.type != "cpu":
        fail("x", "a CPU tensor (the native GGUF kernels run on the CPU)", xt.device)
    return _matmul(xt, b, fmt.type_id, xt.shape[1], out)


def bind_gguf_matmul(blocks: torch.Tensor, qtype: int
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Check a weight's blocks once; returns ``f(x)`` = :func:`gguf_matmul` ``(x, blocks,
    qtype)`` that checks only what can change per call: x ``[M, K]`` on the CPU.

    The returned function holds ``blocks`` (and its address): bind again after moving or
    replacing the tensor."""
    b, fmt, k = check_gguf_blocks(blocks, qtype, torch.device("cpu"))
    lib = _library()
    exact = lib.gguf_matmul_cpu
    # 16-bit activations take the int8 path where this CPU and type have it.
    narrow = lib.gguf_matmul_int8_cpu if fmt.type_id in int8_types() else exact
    n, ldw, w_ptr, type_id = b.shape[0], b.stride(0), b.data_ptr(), fmt.type_id
    bf16 = torch.bfloat16
    # Fixed for this build: looked up once here, not per call (~120 calls a token).
    tile_rows = {dtype: tile_min_rows(dtype) for dtype in _DIRECT}

    def matmul(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            fail("x", f"a CPU tensor [M, {k}] (K of this {fmt.name} weight)",
                 f"shape {tuple(x.shape)} on {x.device}")
        m, dtype = x.shape[0], x.dtype
        if (dtype not in _DIRECT or m >= tile_rows[dtype] or m == 0 or x.stride(1) != 1
                or _uses_gemm(m, dtype, type_id)):
            return _matmul(x, b, type_id, k, None)
        # The decode step's path, ~120 calls a token: straight to the kernel.
        out = torch.empty((m, n), dtype=dtype)
        is_bf16 = dtype == bf16
        kernel = narrow if is_bf16 else exact
        _check_rc(kernel(x.data_ptr(), m, k, x.stride(0), is_bf16, w_ptr, n, ldw, type_id,
                         out.data_ptr(), n, is_bf16, torch.get_num_threads()), "gguf_matmul")
        return out

    return matmul
