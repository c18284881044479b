"""The decoder layer's elementwise ops on the CPU through the native library
(``kernels/csrc/layer_ops_cpu.c``): ``rms_norm``, ``add_rms_norm``, ``rotary_qk`` and
``silu_and_mul`` with the signatures and semantics of ``deepinfer_kernels.reference``,
one C call each instead of 5-15 torch ops (per-op overhead is most of a small model's
decode step on the CPU once its weights stay quantized).

float32 and bfloat16 tensors whose last dim is contiguous take the C path; anything else
(float16, a weight of another dtype, no native library) runs the reference op.
"""

from __future__ import annotations

import torch

from deepinfer_kernels import reference
from deepinfer_kernels.cpu_native import native_library

__all__ = ["add_rms_norm", "rms_norm", "rotary_qk", "silu_and_mul"]

_NATIVE = (torch.float32, torch.bfloat16)


def _rows_ok(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU ``[T, H]`` of ``dtype`` (fp32 or bf16) with a contiguous last dim. Plain
    comparisons, no generator: these run ~150 times a decode step."""
    return x.dtype == dtype and x.is_cpu and x.dim() == 2 and x.stride(1) == 1


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    lib = native_library()
    dtype = x.dtype
    if (lib is None or dtype not in _NATIVE or not _rows_ok(x, dtype)
            or (residual is not None and (not _rows_ok(residual, dtype)
                                          or residual.shape != x.shape))
            or weight.dtype != dtype or weight.dim() != 1 or not weight.is_contiguous()
            or weight.shape[0] != x.shape[1]):
        return None
    t, h = x.shape
    out = torch.empty((t, h), dtype=dtype)
    summed = out if residual is None else torch.empty((t, h), dtype=dtype)
    lib.rms_norm_cpu(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        None if residual is None else summed.data_ptr(), h, weight.data_ptr(),
        out.data_ptr(), h, t, h, float(eps), dtype == torch.bfloat16,
        torch.get_num_threads())
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x ``[T, H]``, weight ``[H]`` -> ``weight * (x / rms(x))`` ``[T, H]`` in x's dtype
    (see ``reference.rms_norm``)."""
    res = _norm(x, None, weight, eps)
    return reference.rms_norm(x, weight, eps) if res is None else res[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s, weight, eps), s)``, each ``[T, H]``."""
    res = _norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps) if res is None else res


def _heads_ok(x: torch.Tensor) -> bool:
    """``[T, H, D]`` with each row's heads back to back (a view of a fused projection)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` rotated by ``positions`` (``[T]`` int64),
    after a per-head RMSNorm when the norm weights (``[D]``) are given (see
    ``reference.rotary_qk``). Returns new contiguous tensors. ``IndexError`` naming the
    token whose position is outside the cache."""
    lib = native_library()
    d = q.shape[-1]
    weights = [w for w in (q_norm_weight, k_norm_weight) if w is not None]
    if (lib is None or q.dtype not in _NATIVE or k.dtype != q.dtype
            or cos_sin_cache.dtype != q.dtype or not cos_sin_cache.is_contiguous()
            or not (_heads_ok(q) and _heads_ok(k)) or k.shape[2] != d
            or cos_sin_cache.shape[1] != d or d % 2 or d > 1024
            or positions.dtype != torch.int64 or positions.dim() != 1
            or any(w.dtype != q.dtype or not w.is_contiguous() for w in weights)
            or len(weights) == 1 or q.device.type != "cpu"):
        return reference.rotary_qk(q, k, cos_sin_cache, positions, q_norm_weight,
                                   k_norm_weight, eps)
    t = q.shape[0]
    pos = positions.contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    rc = lib.rotary_qk_cpu(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), q_out.data_ptr(),
        q_out.stride(0), k_out.data_ptr(), k_out.stride(0), t, q.shape[1], k.shape[1], d,
        cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], pos.data_ptr(),
        None if q_norm_weight is None else q_norm_weight.data_ptr(),
        None if k_norm_weight is None else k_norm_weight.data_ptr(), float(eps),
        int(q.dtype == torch.bfloat16), torch.get_num_threads())
    if rc < 0:
        bad = -rc - 1
        raise IndexError(f"rotary_qk: token {bad} has position {int(pos[bad])}, outside "
                         f"the cos/sin cache's {cos_sin_cache.shape[0]} rows")
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate then up) -> ``silu(gate) * up`` ``[T, I]``."""
    lib = native_library()
    if (lib is None or gate_up.dtype not in _NATIVE or not _rows_ok(gate_up, gate_up.dtype)
            or gate_up.shape[1] % 2):
        return reference.silu_and_mul(gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype)
    lib.silu_and_mul_cpu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, t,
                         inter, int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return out
