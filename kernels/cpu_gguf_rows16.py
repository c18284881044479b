"""GGUF weights repacked in groups of 16 rows for int8 products on the CPU
(``kernels/csrc/gguf_rows16*.c``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K on CPUs
with AVX2 (a 16-lane build with AVX512-VNNI, an 8-lane one with AVX2 alone), and Q6_K
with AVX2 alone or where the CPU has AVX512-VNNI and AVX512-BF16. Q6_K's int8 products cost
more per x row than the other types' (a scale per 16 weights), so from
:func:`rows16_bf16_min_rows` x rows on it decodes each row group to bf16 once a call
and multiplies bf16 x (fp32 x rounded to bf16 first) instead.

A weight is repacked once, in place, after loading (:func:`pack_rows16`: the same bytes,
rearranged within each 16-row group, so the resident size is the file's); from then on
its products take :func:`bind_rows16_matmul` for any number of rows (and a tied
embedding's lookups :func:`bind_rows16_lookup`): x quantized per
block of 32 to int8 (the int8 path's rounding, see ``cpu_gguf``), 64 products a
``vpdpbusd`` into 16 outputs, with no per-call decode or transpose. Measured with
``benchmarks/bench_quant.py``: the default model's decode steps from 1 to 128 sequences.

Error: the int8 path's (at most half a step of 1/127 of a block's largest |x| per x
element), accumulated in fp32; on Q6_K's bf16 path, x's and the weights' bf16 rounding.
bf16 and fp16 activations are held to 2e-2 as elsewhere. A NaN in x makes that row's
outputs NaN.
Layers of other types, of a row count that is not whole groups, or on other devices keep
the row-major blocks and their kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from deepinfer_kernels.cpu_gguf import dequantize_gguf
from deepinfer_kernels.cpu_native import native_library
from deepinfer_kernels.validation import check_gguf_blocks, fail

__all__ = ["GROUP_ROWS", "bind_rows16_lookup", "bind_rows16_matmul", "pack_rows16",
           "rows16_bf16_min_rows", "rows16_matmul", "rows16_types", "rows16_usable",
           "unpack_rows16"]

#: Rows a group packs together: a weight's row count must be a multiple.
GROUP_ROWS = 16
_ERRORS = {1: "a type without the kernel", 2: "rows not whole groups or blocks",
           3: "out of memory"}


@functools.lru_cache(maxsize=1)
def rows16_types() -> frozenset[int]:
    """ggml type ids this CPU's build repacks (empty without AVX2)."""
    lib = native_library()
    if lib is None:
        return frozenset()
    mask = lib.gguf_rows16_types()
    return frozenset(i for i in range(64) if (mask >> i) & 1)


def rows16_bf16_min_rows(qtype: int) -> int | None:
    """The x rows from which a packed ``qtype`` weight is multiplied in bf16 (the group
    decoded once, x rounded to bf16) instead of with int8 x; None: never."""
    lib = native_library()
    rows = lib.gguf_rows16_bf16_min_m(qtype) if lib is not None else 0
    return rows or None


def rows16_usable(blocks: torch.Tensor, qtype: int) -> bool:
    """Whether ``blocks`` (uint8 ``[N, row_bytes]``) can be repacked: a type with the
    kernel, N a multiple of ``GROUP_ROWS``, contiguous on the CPU."""
    return (qtype in rows16_types() and blocks.dtype == torch.uint8 and blocks.is_cpu
            and blocks.dim() == 2 and blocks.shape[0] % GROUP_ROWS == 0
            and blocks.shape[0] > 0 and blocks.is_contiguous())


def _checked(blocks: torch.Tensor, qtype: int):
    """``check_gguf_blocks`` plus what the row-group kernel needs (``rows16_usable``):
    the blocks, their format and K; ``ValueError`` naming ``blocks`` otherwise."""
    b, fmt, k = check_gguf_blocks(blocks, qtype, torch.device("cpu"))
    if not rows16_usable(b, fmt.type_id):
        fail("blocks", f"contiguous CPU {fmt.name} rows, a multiple of {GROUP_ROWS}, of a "
             f"type in {sorted(rows16_types())}", f"{tuple(blocks.shape)} {fmt.name}")
    return b, fmt, k


def _repack(blocks: torch.Tensor, qtype: int, unpack: bool) -> None:
    b, fmt, k = _checked(blocks, qtype)
    rc = native_library().gguf_rows16_pack(b.data_ptr(), b.shape[0], k, fmt.type_id,
                                           int(unpack), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"gguf_rows16_pack: {_ERRORS.get(rc, rc)}")


def pack_rows16(blocks: torch.Tensor, qtype: int) -> None:
    """Repack row-major GGUF ``blocks`` uint8 ``[N, row_bytes]`` in place into the
    row-group layout (same shape and bytes, rearranged). ``ValueError`` naming the
    argument where :func:`rows16_usable` does not hold."""
    _repack(blocks, qtype, unpack=False)


def unpack_rows16(blocks: torch.Tensor, qtype: int) -> None:
    """The inverse of :func:`pack_rows16`, in place."""
    _repack(blocks, qtype, unpack=True)


def _run(lib, x: torch.Tensor, w_ptr: int, n: int, k: int, qtype: int) -> torch.Tensor:
    """Checked x ``[M, K]`` (fp32/bf16, unit last stride) -> ``[M, N]`` in x's dtype."""
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    if m:
        bf16 = int(x.dtype == torch.bfloat16)
        rc = lib.gguf_rows16_matmul(x.data_ptr(), m, k, x.stride(0), bf16, w_ptr, n, qtype,
                                    out.data_ptr(), n, bf16, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"gguf_rows16_matmul: {_ERRORS.get(rc, rc)}")
    return out


def _as_input(x: torch.Tensor) -> torch.Tensor:
    """fp32 and bf16 as they are (unit last stride), anything else through fp32."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return x if x.stride(1) == 1 else x.contiguous()


def rows16_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W.T`` for a weight repacked by :func:`pack_rows16`.

    x: ``[M, K]`` float32, bfloat16 or float16 on the CPU; blocks: the packed uint8
    ``[N, row_bytes]``. Returns ``[M, N]`` in x's dtype (int8 activations, fp32 sums).
    ``ValueError`` naming the argument on bad input."""
    return bind_rows16_matmul(blocks, qtype)(x)


def bind_rows16_matmul(blocks: torch.Tensor, qtype: int
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Check a packed weight once; returns ``f(x)`` = :func:`rows16_matmul` ``(x,
    blocks, qtype)`` checking only x per call. It holds ``blocks`` (and its address)."""
    b, fmt, k = _checked(blocks, qtype)
    lib, n, w_ptr, type_id = native_library(), b.shape[0], b.data_ptr(), fmt.type_id

    def matmul(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != k or not x.is_cpu or not x.is_floating_point():
            fail("x", f"a float CPU tensor [M, {k}] (K of this {fmt.name} weight)",
                 f"{tuple(x.shape)} {x.dtype} on {x.device}")
        y = _run(lib, _as_input(x), w_ptr, n, k, type_id)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    matmul.keep_alive = b  # type: ignore[attr-defined]
    return matmul


def bind_rows16_lookup(blocks: torch.Tensor, qtype: int, dtype: torch.dtype
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """An embedding's lookup on a packed weight: ``f(ids)``, ids ``[T]`` int64 on the
    CPU -> their rows ``[T, K]`` in ``dtype``, each gathered back to its row-major blocks
    and then dequantized (``cpu_gguf.dequantize_gguf``: the same values as a lookup on
    the unpacked weight). ``IndexError`` naming an id outside the rows."""
    b, fmt, k = _checked(blocks, qtype)
    lib, n, w_ptr, type_id, row_bytes = (native_library(), b.shape[0], b.data_ptr(),
                                         fmt.type_id, b.shape[1])

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 1 or not ids.is_cpu or ids.dtype != torch.int64:
            fail("ids", "a CPU int64 tensor [T]", f"{tuple(ids.shape)} {ids.dtype}")
        ids = ids.contiguous()
        rows = torch.empty((ids.shape[0], row_bytes), dtype=torch.uint8)
        rc = lib.gguf_rows16_gather(w_ptr, n, k, type_id, ids.data_ptr(), ids.shape[0],
                                    rows.data_ptr())
        if rc >= 5:
            at = rc - 5
            raise IndexError(f"ids[{at}] = {int(ids[at])} is outside the embedding's "
                             f"{n} rows")
        if rc:
            raise RuntimeError(f"gguf_rows16_gather: {_ERRORS.get(rc, rc)}")
        return dequantize_gguf(rows, type_id, dtype)

    lookup.keep_alive = b  # type: ignore[attr-defined]
    return lookup
