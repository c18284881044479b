"""The CPU backend's fused decode step: every decoder layer of a model holding its
projections as GGUF blocks, run by one C call (``kernels/csrc/decoder_cpu.c``) instead of
~12 Python-level kernel calls a layer.

A small model's decode step on the CPU is per-call overhead as much as memory reads:
SmolLM2-135M's 30 layers read ~3 MB each (~0.15 ms), and the Python glue around the
kernels of a layer (argument conversion, output allocation, dispatch checks) costs about
as much again. The C function calls the same kernels as the layer-by-layer path, in the
same order and with the same roundings, so both give the same bits.

Bound once per model (``bind_decoder_stack``: every check of the weights and shapes), the
returned function checks only what a step can change and returns None for a step it does
not take (a prompt step is never passed to it; more sequences than ``_max_rows`` allows,
where the per-layer path would call a kernel the C step cannot (oneDNN, or torch's BLAS
on dequantized tiles); an unusual cache or table layout). With bf16 activations on a CPU
with AVX512-BF16 that is every decode step of a model held as GGUF blocks: at 4-16
sequences the ~12 per-op calls a layer cost as much again as the products.
A kernel that refuses an input (a position outside the RoPE cache, a slot past the cache,
a block table too short) also returns None: the layer-by-layer rerun names it.
"""

from __future__ import annotations

import torch

from deepinfer_kernels import cpu_native
from deepinfer_kernels.cpu_dense import PACKED_MIN_M, dense_gemm_usable
from deepinfer_kernels.cpu_gguf import INT8_MAX_M, bf16_gemm, kernel_types, tile_min_rows
from deepinfer_kernels.cpu_gguf_rows16 import rows16_usable
from deepinfer_kernels.decoder_spec import (
    BF16_TYPE,
    ROWS16_FLAG,
    BlockWeight,
    DecoderStackFn,
    DecoderStackSpec,
    Projection,
    projection_parts,
)
from deepinfer_kernels.kv_quant import kv_row_width
from deepinfer_kernels.validation import check_gguf_blocks

__all__ = ["bind_decoder_stack"]

_ACTIVATIONS = (torch.float32, torch.bfloat16)
# decoder_cpu.c's enums (checked against the library): a projection is up to _MAX_PARTS
# parts of (pointer, row stride, type, rows).
_MAX_PARTS, _PART_FIELDS = 3, 4
# + the window, whether RoPE rotates
_MODEL_FIELDS, _LAYER_FIELDS = 10, 4 + 4 * _MAX_PARTS * _PART_FIELDS + 2


def _vector_ok(w: torch.Tensor | None, size: int, dtype: torch.dtype) -> bool:
    return (w is not None and w.dtype == dtype and w.is_cpu and w.dim() == 1
            and w.shape[0] == size and w.is_contiguous())


def _dense_fields(w: BlockWeight, n: int, k: int) -> list[int] | None:
    """``[pointer, row stride in elements, BF16_TYPE]`` of a dense bf16 weight viewed as
    uint8 ``[n, 2k]``."""
    b = w.blocks
    if (b.dtype != torch.uint8 or not b.is_cpu or b.dim() != 2 or tuple(b.shape) != (n, 2 * k)
            or b.stride(1) != 1 or b.stride(0) % 2
            or not dense_gemm_usable(b.view(torch.bfloat16))):
        return None
    return [b.data_ptr(), b.stride(0) // 2, BF16_TYPE]


def _weight_fields(w: BlockWeight, n: int, k: int, types: frozenset[int]) -> list[int] | None:
    """``[pointer, row stride, type]`` of a ``[n, k]`` weight the C kernels take (the
    stride in bytes for blocks, in elements for a dense bf16 weight; a row-group packed
    weight keeps ``ROWS16_FLAG`` in its type)."""
    if w.qtype == BF16_TYPE:
        return _dense_fields(w, n, k)
    packed, qtype = bool(w.qtype & ROWS16_FLAG), w.qtype & ~ROWS16_FLAG
    if packed:
        if not rows16_usable(w.blocks, qtype):
            return None
    elif qtype not in types or w.blocks.dtype != torch.uint8 or not w.blocks.is_cpu:
        return None
    try:
        blocks, _, cols = check_gguf_blocks(w.blocks, qtype, torch.device("cpu"))
    except ValueError:
        return None
    if cols != k or blocks.shape[0] != n or blocks.data_ptr() != w.blocks.data_ptr():
        return None
    return [blocks.data_ptr(), blocks.stride(0), w.qtype]


def _projection_fields(w: Projection, n: int, k: int, types: frozenset[int]
                       ) -> list[int] | None:
    """``_MAX_PARTS`` x ``[pointer, row stride, type, rows]`` of a ``[n, k]`` projection
    (unused parts zero), or None where a part is one the C kernels do not take or the
    parts' rows do not add up to ``n``."""
    parts = projection_parts(w)
    if len(parts) > _MAX_PARTS:
        return None
    fields: list[int] = []
    for part in parts:
        rows = part.blocks.shape[0] if part.blocks.dim() == 2 else -1
        f = _weight_fields(part, rows, k, types)
        if f is None:
            return None
        fields += f + [rows]
    if sum(fields[3::_PART_FIELDS]) != n:
        return None
    return fields + [0] * (_MAX_PARTS * _PART_FIELDS - len(fields))


def _shapes_ok(spec: DecoderStackSpec) -> bool:
    """The attention kernel's and the rotary kernel's limits (see cpu_native.can_decode)."""
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    return (hkv > 0 and hq % hkv == 0 and hq // hkv <= 64 and d % 8 == 0 and d <= 512
            and hq * d <= 1 << 17 and spec.hidden_size > 0 and spec.intermediate_size > 0)


def _describe(spec: DecoderStackSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int64 model and layer descriptors of decoder_cpu.c, or None where a weight or
    shape is one the C kernels do not take."""
    dtype = spec.final_norm.dtype
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    qs, kvs = spec.num_heads * d, spec.num_kv_heads * d
    cs = spec.cos_sin_cache
    if (dtype not in _ACTIVATIONS or not _shapes_ok(spec) or not _vector_ok(spec.final_norm, h,
                                                                            dtype)
            or cs.dtype != dtype or not cs.is_cpu or cs.dim() != 2 or cs.shape[1] != d
            or not cs.is_contiguous()):
        return None
    types = kernel_types()
    rows = []
    for layer in spec.layers:
        per_head = (layer.q_norm, layer.k_norm)
        if not (_vector_ok(layer.input_norm, h, dtype)
                and _vector_ok(layer.post_attention_norm, h, dtype)):
            return None
        if per_head != (None, None) and not all(_vector_ok(w, d, dtype) for w in per_head):
            return None
        weights = [_projection_fields(layer.qkv, qs + 2 * kvs, h, types),
                   _projection_fields(layer.o, h, qs, types),
                   _projection_fields(layer.gate_up, 2 * inter, h, types),
                   _projection_fields(layer.down, h, inter, types)]
        if any(w is None for w in weights):
            return None
        if dtype != torch.bfloat16 and any(BF16_TYPE in w[2::_PART_FIELDS] for w in weights):
            return None  # the dense kernel takes bf16 activations only
        norms = [0 if w is None else w.data_ptr() for w in per_head]
        rows.append([layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(),
                     *norms, *(f for w in weights for f in w), layer.window or 0,
                     int(layer.rope)])
    model = [h, spec.num_heads, spec.num_kv_heads, d, inter, int(dtype == torch.bfloat16),
             spec.final_norm.data_ptr(), cs.data_ptr(), cs.shape[0], INT8_MAX_M]
    return (torch.tensor(model, dtype=torch.int64),
            torch.tensor(rows, dtype=torch.int64).reshape(len(rows), _LAYER_FIELDS))


def _max_rows(spec: DecoderStackSpec) -> int:
    """The most sequences a fused step takes: those for which every product has a kernel
    the C step can call, the one the per-layer path picks at that many rows. A row-group
    packed weight: any number. Row-major blocks with bf16 activations and the bf16 GEMM:
    any number (the GEMM from ``INT8_MAX_M + 1`` rows); otherwise below
    ``tile_min_rows(dtype)``, from where the per-layer path dequantizes tiles for torch's
    BLAS. A dense bf16 weight:
    below ``PACKED_MIN_M``, from where oneDNN's packed copy takes it."""
    gemm = spec.final_norm.dtype == torch.bfloat16 and bf16_gemm()
    most = 1 << 30
    for layer in spec.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for part in projection_parts(w):
                if part.qtype == BF16_TYPE:
                    most = min(most, PACKED_MIN_M - 1)
                elif not part.qtype & ROWS16_FLAG and not gemm:
                    most = min(most, tile_min_rows(spec.final_norm.dtype) - 1)
    return most


def bind_decoder_stack(spec: DecoderStackSpec) -> DecoderStackFn | None:
    """Check ``spec`` once (see :mod:`deepinfer_kernels.decoder_spec`); returns the
    per-step function, or None where the native library is missing or a weight (a type
    without a C kernel, a float weight) or shape is one it does not take.

    The function: embeddings x ``[T, hidden]`` (activation dtype, contiguous), positions
    ``[T]`` int64, kv_cache ``[L, 2, NB, BS, Hkv, D]`` contiguous in the activation
    dtype (or int8 ``[..., D * 9 / 8]``, :mod:`deepinfer_kernels.kv_quant`), slot_mapping
    ``[T]`` int64, block_tables ``[T, W]`` int32/int64 (unit last stride), seq_lens
    ``[T]`` int32 -> the final-normed hidden states ``[T, hidden]``;
    None for inputs it does not take (the caller runs layer by layer)."""
    lib = cpu_native.native_library()
    if lib is None or lib.decoder_stack_fields() != _MODEL_FIELDS * 100 + _LAYER_FIELDS:
        return None
    described = _describe(spec)
    if described is None:
        return None
    model, layers = described
    num_layers, h, dtype = len(spec.layers), spec.hidden_size, spec.final_norm.dtype
    max_rows = _max_rows(spec)
    hkv, d = spec.num_kv_heads, spec.head_dim
    int8_attention = cpu_native.int8_decode_shape(d, spec.num_heads // hkv)
    int8_width = kv_row_width(d, "int8")
    eps, scale, residual = float(spec.eps), float(spec.scale), float(spec.residual_multiplier)
    int32, int64 = torch.int32, torch.int64
    call, model_ptr, layers_ptr = lib.decoder_stack_cpu, model.data_ptr(), layers.data_ptr()

    def run(x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor) -> torch.Tensor | None:
        t = x.shape[0]
        # Plain comparisons: this runs once a step.
        kv_int8 = kv_cache.dtype == torch.int8
        if (not 0 < t <= max_rows or x.dtype != dtype or not x.is_cpu or x.dim() != 2
                or x.shape[1] != h or not x.is_contiguous()
                or (kv_cache.dtype != dtype and not kv_int8) or not kv_cache.is_cpu
                or kv_cache.dim() != 6
                or kv_cache.shape[0] != num_layers or kv_cache.shape[1] != 2
                or kv_cache.shape[3] > cpu_native.MAX_BLOCK_SIZE or kv_cache.shape[4] != hkv
                or kv_cache.shape[5] != (int8_width if kv_int8 else d)
                or (kv_int8 and not int8_attention) or not kv_cache.is_contiguous()
                or positions.dtype != int64 or positions.shape != (t,)
                or not positions.is_contiguous() or slot_mapping.dtype != int64
                or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous()
                or block_tables.dtype not in (int32, int64) or block_tables.dim() != 2
                or block_tables.shape[0] < t or block_tables.stride(1) != 1
                or seq_lens.dtype != int32 or seq_lens.shape[0] < t
                or not seq_lens.is_contiguous()
                or not (positions.is_cpu and slot_mapping.is_cpu and block_tables.is_cpu
                        and seq_lens.is_cpu)):
            return None
        out = torch.empty((t, h), dtype=dtype)
        rc = call(model_ptr, layers_ptr, num_layers, x.data_ptr(), out.data_ptr(), t,
                  positions.data_ptr(), slot_mapping.data_ptr(), kv_cache.data_ptr(),
                  kv_cache.shape[2], kv_cache.shape[3], block_tables.data_ptr(),
                  block_tables.shape[1], block_tables.stride(0),
                  int(block_tables.dtype == int64), seq_lens.data_ptr(), eps, scale,
                  residual, int(kv_int8), torch.get_num_threads())
        return out if rc == 0 else None

    # The descriptors hold raw pointers: the spec (and so every weight) and the
    # descriptor tensors live as long as the function.
    run.keep_alive = (spec, model, layers)  # type: ignore[attr-defined]
    return run
