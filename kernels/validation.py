"""Cheap argument checks run before any launch.

Only shapes, dtypes, devices and strides are read (host metadata), never device values, so
validation cannot sync with the GPU. Every error is a ``ValueError`` that names the
argument and says what was expected; since all checks run before the first launch, a call
that raises has written nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels.runtime import interpreting

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(name: str, expected: str, got: object) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument and return it (typed)."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    assert isinstance(t, torch.Tensor)
    if ndim is not None and t.dim() != ndim:
        fail(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(name, f"dtype {names}", str(t.dtype).replace("torch.", ""))
    if device is not None and t.device != device:
        fail(name, f"a tensor on {device} (same device as the other arguments)", t.device)
    if contiguous and not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(name, "stride 1 in the last dimension", f"strides {t.stride()}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    """Exact shape check."""
    if tuple(t.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)}", f"shape {tuple(t.shape)}")


def check_runnable_device(name: str, t: torch.Tensor) -> torch.device:
    """Compiled Triton runs on CUDA; the interpreter runs on CPU tensors."""
    if t.device.type == "cuda":
        return t.device
    if not interpreting():
        fail(name, "a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors)", t.device)
    return t.device


def check_scale(scale: object, head_dim: int) -> float:
    """Default softmax scale is 1/sqrt(head_dim)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        fail("scale", "a float or None", type(scale).__name__)
    value = float(scale)  # type: ignore[arg-type]
    if not math.isfinite(value) or value <= 0:
        fail("scale", "a positive finite float", value)
    return value


def check_optional_int(name: str, value: object, minimum: int) -> int | None:
    """Host-int hints: None or a Python int >= minimum."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, f"None or a Python int >= {minimum} (a host value, not a tensor)",
              type(value).__name__)
    assert isinstance(value, int)
    if value < minimum:
        fail(name, f"None or an int >= {minimum}", value)
    return value


def check_kv_caches(
    k_cache: object, v_cache: object, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both caches ``[num_blocks, block_size, Hkv, D]``, same shape/dtype/device, contiguous."""
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device,
                     contiguous=True)
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=(k.dtype,), device=k.device,
                     contiguous=True)
    check_shape("v_cache", v, k.shape)
    return k, v


def check_out(out: object, q: torch.Tensor) -> torch.Tensor:
    """``out`` must look like ``q`` (same shape and device, float dtype, unit last stride)."""
    o = check_tensor("out", out, ndim=q.dim(), dtypes=FLOAT_DTYPES, device=q.device,
                     last_dim_contiguous=True)
    check_shape("out", o, q.shape)
    return o


def check_attention_common(
    q: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shared by decode and prefill; returns the typed tensors."""
    qt = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_runnable_device("q", qt)
    kc, vc = check_kv_caches(k_cache, v_cache, qt.device)
    if kc.dtype != qt.dtype:
        fail("k_cache", f"the dtype of q ({qt.dtype})", kc.dtype)
    hq, d = qt.shape[1], qt.shape[2]
    hkv = kc.shape[2]
    if kc.shape[3] != d:
        fail("k_cache", f"head_dim {d} (the last dim of q)", kc.shape[3])
    if hkv == 0 or hq % hkv != 0:
        fail("q", f"a head count divisible by the kv head count {hkv}", hq)
    bt = check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,),
                      device=qt.device, last_dim_contiguous=True)
    sl = check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=qt.device,
                      contiguous=True)
    if bt.shape[0] != sl.shape[0]:
        fail("block_tables", f"{sl.shape[0]} rows (one per sequence, like seq_lens)",
              bt.shape[0])
    return qt, kc, vc, bt, sl
