"""Native CPU kernels: C sources in ``kernels/csrc`` built on first use with the system C
compiler and called through ``ctypes``.

Why C and not more torch ops: on the CPU, paged decode attention through torch has to
gather every sequence's K/V blocks into a dense copy before ``scaled_dot_product_attention``
(the copy is as much traffic as the attention itself), and at decode shapes SDPA's fixed
cost per (sequence, head) dominates. The C kernel reads each K/V row once, straight from
the paged cache. It uses no torch headers, so a build takes about a second (a torch
extension takes ~40 s); OpenMP is resolved against the ``libgomp`` torch already loaded,
so both share one thread pool.

Built libraries are cached under ``$DEEPINFER_CACHE_DIR`` (default
``~/.cache/deepinfer``), keyed by the source, the compiler flags, the compiler and the
machine. ``DEEPINFER_NATIVE_CPU=0`` turns the native path off; so does a missing or failing
compiler (one warning, then the torch path runs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from deepinfer_kernels.kv_quant import cache_head_dim
from deepinfer_kernels.validation import check_out, check_softcap, check_window, table_error

__all__ = ["native_library", "can_decode", "paged_decode_attention", "MAX_BLOCK_SIZE"]

_CSRC = Path(__file__).resolve().parent / "csrc"
# One library of all the C kernels: paged decode and prefill attention, the GGUF block
# matmul (exact, with int8 activations, the bf16 GEMM for many rows, and over row groups
# repacked for int8 products), the decoder layer's elementwise ops, the K/V store, the
# decode step's whole stack of layers made of them, and token sampling.
SOURCES = (_CSRC / "paged_decode_cpu.c", _CSRC / "paged_decode_wide_cpu.c",
           _CSRC / "gguf_cpu.c", _CSRC / "gguf_int8_cpu.c", _CSRC / "gguf_gemm_bf16_cpu.c",
           _CSRC / "gguf_rows16_cpu.c", _CSRC / "gguf_rows16_avx2.c",
           _CSRC / "gguf_rows16_pack.c", _CSRC / "gguf_rows16_q6k.c",
           _CSRC / "paged_prefill_cpu.c",
           _CSRC / "layer_ops_cpu.c", _CSRC / "store_kv_cpu.c", _CSRC / "decoder_cpu.c",
           _CSRC / "sampling_cpu.c")
# Included by the sources: part of what a build is cached under.
HEADERS = (_CSRC / "vec16.h", _CSRC / "vec8.h", _CSRC / "vec_lanes.h",
           _CSRC / "byte_lanes.h", _CSRC / "gguf_rows16.h")
_I64, _I32, _PTR, _F32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
# Every exported function's argument types (all return int64: 0 or an error code).
_SIGNATURES = {
    "paged_decode_attention_cpu": [_PTR] * 6 + [_I64] * 8 + [_I32] * 2 + [_I64, _F32, _I32],
    "paged_prefill_attention_cpu": [_PTR, _I32, _PTR, _PTR, _I32, _PTR, _I32, _I64, _I64,
                                    _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _F32,
                                    _PTR, _I64, _F32, _I32],
    "softcap_scores": [_PTR, _I64, _F32],
    "gguf_matmul_cpu": [_PTR, _I64, _I64, _I64, _I32, _PTR, _I64, _I64, _I32, _PTR, _I64,
                        _I32, _I32],
    "gguf_matmul_int8_cpu": [_PTR, _I64, _I64, _I64, _I32, _PTR, _I64, _I64, _I32, _PTR,
                             _I64, _I32, _I32],
    "gguf_int8_types": [],
    "gguf_gemm_bf16_cpu": [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I32, _PTR, _I64, _I32,
                           _I32],
    "gguf_gemm_bf16_available": [],
    "gguf_rows16_types": [],
    "gguf_rows16_bf16_min_m": [_I32],
    "gguf_rows16_pack": [_PTR, _I64, _I64, _I32, _I32, _I32],
    "gguf_rows16_gather": [_PTR, _I64, _I64, _I32, _PTR, _I64, _PTR],
    "gguf_rows16_matmul": [_PTR, _I64, _I64, _I64, _I32, _PTR, _I64, _I32, _PTR, _I64, _I32,
                           _I32],
    "dense_gemm_bf16_cpu": [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I32, _I32],
    "gguf_dequantize_cpu": [_PTR, _I64, _I64, _I64, _I32, _PTR, _I64, _I32, _I32],
    "rms_norm_cpu": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32,
                     _I32, _I32],
    "rotary_qk_cpu": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64,
                      _I64, _PTR, _I64, _PTR, _PTR, _PTR, _F32, _I32, _I32],
    "silu_and_mul_cpu": [_PTR, _I64, _PTR, _I64, _I64, _I64, _I32, _I32],
    "store_kv_cpu": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32],
    "store_kv_int8_cpu": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                          _I32],
    "decoder_stack_fields": [],
    "sample_tokens_cpu": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I32],
    "decoder_stack_cpu": [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64,
                          _PTR, _I64, _I64, _I32, _PTR, _F32, _F32, _F32, _I32, _I32],
}
MAX_BLOCK_SIZE = 64  # MAX_BLOCK in the C source
_MAX_GROUP = 64
_MAX_DIM = 512
# The kernel keeps a sequence's Hq x D floats on the thread's stack (a few of them).
_MAX_HEADS_X_DIM = 1 << 17
# The int8 shapes of the wide kernel, the only one that reads an int8 cache
# (paged_decode_wide_takes in paged_decode_wide_cpu.c; it takes head dim 256 for float
# caches only).
_INT8_DIMS, _INT8_MAX_GROUP = (64, 128), 8
# cache_kind of the C kernels (KV_* in vec16.h).
KV_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_BAD_SHAPE = 1
# -Wno-psabi: without -march=native GCC notes that 32-byte vectors change the (internal) ABI.
_BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-Wno-psabi"]
# Tried in order: this CPU's vector width with OpenMP threads; OpenMP alone; then neither
# (a compiler without OpenMP, e.g. Apple clang: the kernel runs on one thread).
_FLAG_SETS = (_BASE_FLAGS + ["-fopenmp", "-march=native"], _BASE_FLAGS + ["-fopenmp"],
              _BASE_FLAGS)


def softcap_arg(softcap: float | None) -> float:
    """A checked cap as the C kernels' fp32 argument (0: none), kept within [1e-30, 1e30]:
    in fp32 a smaller cap would become 0 (none) or have an infinite inverse, a larger one
    would be infinite (NaN scores). No fp32 result moves: from 1e30 the cap leaves every
    score below 1e26 as it is, and under 1e-30 every score's weight is e^0."""
    return 0.0 if softcap is None else min(max(softcap, 1e-30), 1e30)


def _cache_dir() -> Path:
    root = os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deepinfer")
    return Path(root) / "native"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: a library built for one CPU must not be loaded
    on another (a shared home directory across machines)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compiles SOURCES into ``out`` (atomically); returns None or the compiler's error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        # CC may hold a launcher or flags ("ccache gcc"), as make reads it.
        proc = subprocess.run([*shlex.split(cc), *flags, "-o", tmp, *map(str, SOURCES)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip()[-2000:]
        os.replace(tmp, out)  # concurrent builders each finish their own file
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The built kernel library, or None when the native path is off or cannot be built
    (the reason is given once as a warning)."""
    if os.environ.get("DEEPINFER_NATIVE_CPU", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        warnings.warn("no C compiler found (set CC): the CPU backend runs its torch path, "
                      "a few times slower at decode", RuntimeWarning, stacklevel=2)
        return None
    source = b"\0".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    err = None
    failed: tuple[list[str], str] | None = None  # the first flag set that did not build
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([
            source, " ".join(flags).encode(), cc.encode(), platform.machine().encode(),
            _cpu_signature().encode(), torch.__version__.encode()])).hexdigest()[:16]
        path = _cache_dir() / f"deepinfer_cpu-{key}.so"
        if not path.exists():
            try:
                err = _compile(cc, flags, path)
            except (OSError, subprocess.SubprocessError) as exc:
                err = str(exc)
            if err is not None:
                failed = failed or (flags, err)
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:  # e.g. an undefined symbol: said as a build that failed
            err = str(exc)
            failed = failed or (flags, err)
            continue
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = _I64, argtypes
        if failed is not None:  # said, not silent: this build has fewer flags, runs slower
            warnings.warn(f"building the native CPU kernels with {' '.join(failed[0])} "
                          f"failed ({failed[1][-300:]}); built with {' '.join(flags)}",
                          RuntimeWarning, stacklevel=2)
        return lib
    warnings.warn(f"could not build the native CPU kernels with {cc} ({err}): the CPU "
                  "backend runs its torch path, a few times slower at decode",
                  RuntimeWarning, stacklevel=2)
    return None


def int8_decode_shape(head_dim: int, group: int) -> bool:
    """Whether the C decode kernel reads an int8 cache for this head dim and number of
    query heads per KV head (its wide kernel's shapes)."""
    return head_dim in _INT8_DIMS and 1 <= group <= _INT8_MAX_GROUP


def can_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_attention` takes these inputs: CPU tensors, an fp32 or
    bf16 cache (both caches alike, contiguous), block size <= 64, at most 64 query heads
    per KV head, head dim a multiple of 8 and <= 512 (heads x dim <= 2**17, held on a
    thread's stack), int32/int64 block tables; or an int8 cache (``[..., D * 9 / 8]``) with a
    head dim of 64 or 128 and at most 8 query heads per KV head. Builds the library on
    first call."""
    # is_cpu, not .device: building a device object per check costs ~1 us, and this runs
    # once a layer per decode step.
    if q.dim() != 3 or not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu):
        return False
    if k_cache.dtype not in KV_KIND or v_cache.dtype != k_cache.dtype:
        return False
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    _, block_size, hkv, _ = k_cache.shape
    hq, d = q.shape[1], cache_head_dim(k_cache)
    if (block_size > MAX_BLOCK_SIZE or hkv == 0 or hq % hkv or hq // hkv > _MAX_GROUP
            or d > _MAX_DIM or d % 8 or q.shape[2] != d or hq * d > _MAX_HEADS_X_DIM):
        return False
    if k_cache.dtype == torch.int8 and not int8_decode_shape(d, hq // hkv):
        return False
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.dim() != 2:
        return False
    if not (block_tables.is_cpu and seq_lens.is_cpu):
        return False
    return native_library() is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence against its ``seq_lens[b]`` cached keys (its last
    ``window`` with a sliding window; scores soft-capped at ``softcap``, as
    :func:`deepinfer_kernels.validation.check_softcap` says), by the C kernel.

    q ``[B, Hq, D]`` (any float dtype); k_cache/v_cache ``[num_blocks, block_size, Hkv,
    D]`` fp32 or bf16, or ``[..., D * 9 / 8]`` int8 (:mod:`deepinfer_kernels.kv_quant`),
    contiguous; block_tables ``[B, W]`` int32/int64 (any row stride);
    seq_lens ``[B]``.
    Returns ``[B, Hq, D]`` in q's dtype (into ``out`` when given); fp32 math. A sequence
    of length 0 gets zeros. Call only where :func:`can_decode` holds. Raises IndexError
    naming the sequence when its length needs more blocks than its table row has or its
    table names a block outside the cache (nothing is read out of bounds).
    """
    lib = native_library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see can_decode)")
    window, softcap = check_window(window), check_softcap(softcap)
    b, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    else:  # the C kernel writes B x Hq x D floats through its pointer: never past it
        check_out(out, q)
    if b == 0:
        return out
    # The scale folded into q once (B x Hq x D multiplies, not one per score).
    qs = q.to(torch.float32).mul(scale).contiguous()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    res = out if direct else torch.empty((b, hq, d), dtype=torch.float32)
    # Rows may be a slice of a wider buffer (the scheduler's launch tensors): passed with
    # their stride, no copy.
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if lens.shape[0] < b or tables.shape[0] < b:
        raise ValueError(f"paged_decode_attention: {b} queries but seq_lens has "
                         f"{lens.shape[0]} and block_tables {tables.shape[0]} rows")
    rc = lib.paged_decode_attention_cpu(
        qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), res.data_ptr(), b, hq, hkv, d, num_blocks, block_size,
        tables.shape[1], tables.stride(0), KV_KIND[k_cache.dtype],
        int(tables.dtype == torch.int64), window or 0, softcap_arg(softcap),
        torch.get_num_threads())
    if rc == _BAD_SHAPE:
        raise ValueError(f"paged_decode_attention: shapes the native kernel cannot take "
                         f"(q {tuple(q.shape)}, cache {tuple(k_cache.shape)})")
    if rc < 0:
        s = -rc - 1
        raise table_error("paged_decode_attention", s, int(lens[s]), block_size,
                          tables.shape[1], num_blocks)
    if not direct:
        out.copy_(res)
    return out
