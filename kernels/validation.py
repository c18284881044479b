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

from deepinfer_kernels.gguf_blocks import BlockFormat, block_format
from deepinfer_kernels.kv_quant import KV_GROUP, is_int8_cache, kv_row_width
from deepinfer_kernels.runtime import interpreting

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


def check_positive_float(name: str, value: object) -> float:
    """A positive finite number (bool refused), as a float; ``ValueError`` naming
    ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(name, "a positive finite float", type(value).__name__)
    v = float(value)  # type: ignore[arg-type]
    if not math.isfinite(v) or v <= 0:
        fail(name, "a positive finite float", v)
    return v


def check_scale(scale: object, head_dim: int) -> float:
    """Default softmax scale is 1/sqrt(head_dim)."""
    return head_dim**-0.5 if scale is None else check_positive_float("scale", scale)


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


#: The window the Triton attention kernels are given for none: more positions than any
#: sequence holds (a runtime int, so one compiled kernel serves both).
NO_WINDOW = 1 << 30


def check_softcap(softcap: object) -> float | None:
    """Attention logit soft-capping (Gemma 2): None (none) or a positive finite number
    ``c``; each scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax."""
    return None if softcap is None else check_positive_float("softcap", softcap)


def check_window(window: object) -> int | None:
    """A sliding attention window: None (every earlier key) or a Python int >= 1, the
    positions a query sees, itself included (query ``p`` sees keys ``p - window + 1 ..
    p``: transformers' ``sliding_window``)."""
    return check_optional_int("window", window, 1)


def check_kv_caches(
    k_cache: object, v_cache: object, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both caches ``[num_blocks, block_size, Hkv, D]`` float (or ``D * 9 / 8`` int8, see
    :mod:`deepinfer_kernels.kv_quant`), same shape/dtype/device, contiguous."""
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=(*FLOAT_DTYPES, torch.int8),
                     device=device, contiguous=True)
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=(k.dtype,), device=k.device,
                     contiguous=True)
    check_shape("v_cache", v, k.shape)
    if k.shape[1] < 1:  # the kernels divide positions by it
        fail("k_cache", "block_size >= 1 (dim 1)", f"shape {tuple(k.shape)}")
    return k, v


def check_cache_rows(k_cache: torch.Tensor, head_dim: int) -> None:
    """The cache's last dim holds rows of ``head_dim`` values: ``head_dim`` itself in a float
    cache, ``head_dim`` codes and their scales in an int8 one (``head_dim`` a multiple of 32)."""
    if not is_int8_cache(k_cache):
        if k_cache.shape[3] != head_dim:
            fail("k_cache", f"head_dim {head_dim} (the last dim of q or k)", k_cache.shape[3])
        return
    if head_dim % KV_GROUP:
        fail("k_cache", f"a float cache for head_dim {head_dim} (an int8 cache needs a "
             f"multiple of {KV_GROUP}: a scale per {KV_GROUP} values)", "an int8 cache")
    width = kv_row_width(head_dim, "int8")
    if k_cache.shape[3] != width:
        fail("k_cache", f"last dim {width} (head_dim {head_dim} int8 codes, then a fp32 "
             f"scale per {KV_GROUP})", k_cache.shape[3])


def check_out(out: object, q: torch.Tensor) -> torch.Tensor:
    """``out`` must look like ``q`` (same shape and device, float dtype, unit last stride)."""
    o = check_tensor("out", out, ndim=q.dim(), dtypes=FLOAT_DTYPES, device=q.device,
                     last_dim_contiguous=True)
    check_shape("out", o, q.shape)
    return o


def table_error(op: str, seq: int, seq_len: int, block_size: int, width: int,
                num_blocks: int) -> IndexError:
    """What a native attention kernel's refusal of sequence ``seq``'s block table means:
    its ``seq_len`` needs more blocks than the ``width`` entries of its row, or the row
    names a block outside the cache's ``num_blocks``."""
    return IndexError(f"{op}: sequence {seq} (seq_len {seq_len}) needs "
                      f"{-(-seq_len // block_size)} blocks but its block_tables row has "
                      f"{width} entries or names a block outside the cache's {num_blocks}")


def check_attention_common(
    q: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shared by decode and prefill; returns the typed tensors."""
    qt = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_runnable_device("q", qt)
    kc, vc = check_kv_caches(k_cache, v_cache, qt.device)
    if kc.dtype not in (qt.dtype, torch.int8):
        fail("k_cache", f"the dtype of q ({qt.dtype}) or int8", kc.dtype)
    hq, d = qt.shape[1], qt.shape[2]
    hkv = kc.shape[2]
    check_cache_rows(kc, d)
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


# --- mixture of experts -----------------------------------------------------------------

def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """A host Python int in ``[minimum, maximum]`` (bools and tensors rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, "a Python int (a host value, not a tensor)", type(value).__name__)
    assert isinstance(value, int)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        fail(name, f"an int {bound}", value)
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        fail(name, "a bool", type(value).__name__)
    return bool(value)


def check_moe_route_args(router_logits: object, top_k: object,
                         renormalize: object) -> torch.Tensor:
    """router_logits ``[T, E]`` float with unit last stride; 1 <= top_k <= min(E, 64)."""
    logits = check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES,
                          last_dim_contiguous=True)
    check_runnable_device("router_logits", logits)
    if logits.shape[1] == 0:
        fail("router_logits", "at least one expert (column)", f"shape {tuple(logits.shape)}")
    check_int("top_k", top_k, 1, min(logits.shape[1], 64))
    check_bool("renormalize", renormalize)
    return logits


def check_moe_align_args(topk_ids: object, num_experts: object, block_m: object) -> torch.Tensor:
    """topk_ids ``[T, k]`` int32 contiguous; num_experts >= 1; block_m a power of two >= 16."""
    ids = check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), contiguous=True)
    check_runnable_device("topk_ids", ids)
    check_int("num_experts", num_experts, 1)
    bm = check_int("block_m", block_m, 16)
    if bm & (bm - 1):
        fail("block_m", "a power of two >= 16 (the GEMM's BLOCK_M)", bm)
    return ids


def _check_moe_weights(name: str, w: object, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    wt = check_tensor(name, w, ndim=3, dtypes=(dtype,), device=device, contiguous=True)
    if wt.shape[0] == 0:
        fail(name, "at least one expert", f"shape {tuple(wt.shape)}")
    return wt


def check_moe_gemm_args(
    a: object, w: object, sorted_ids: object, block_expert: object, num_padded: object,
    topk_weights: object, out: object, top_k: object, mul_routed_weight: object,
    gated: object,
) -> None:
    """The arguments of ``fused_moe_gemm`` (see its docstring for the shapes)."""
    at = check_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("a", at)
    wt = _check_moe_weights("w", w, at.dtype, device)
    if wt.shape[2] != at.shape[1]:
        fail("w", f"[E, N, {at.shape[1]}] (K = the last dim of a)", f"shape {tuple(wt.shape)}")
    k = check_int("top_k", top_k, 1)
    mul = check_bool("mul_routed_weight", mul_routed_weight)
    if check_bool("gated", gated) and wt.shape[1] % 2:
        fail("w", "an even N (gate and up halves) when gated", f"shape {tuple(wt.shape)}")
    n = wt.shape[1] // 2 if gated else wt.shape[1]
    o = check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, device=device,
                     last_dim_contiguous=True)
    pairs = o.shape[0]
    if o.shape[1] != n:
        fail("out", f"{n} columns (N of w{', halved: gated' if gated else ''})", o.shape[1])
    if at.shape[0] * k != pairs and at.shape[0] != pairs:
        fail("a", f"{pairs // k if pairs % k == 0 else '?'} rows (per token) or {pairs} "
             f"rows (per pair), as out has {pairs} rows and top_k is {k}", at.shape[0])
    si = check_tensor("sorted_ids", sorted_ids, ndim=1, dtypes=(torch.int32,), device=device,
                      contiguous=True)
    be = check_tensor("block_expert", block_expert, ndim=1, dtypes=(torch.int32,),
                      device=device, contiguous=True)
    if be.shape[0] == 0 and si.shape[0] != 0:
        fail("block_expert", "at least one block", "shape (0,)")
    if be.shape[0] and (si.shape[0] % be.shape[0] or si.shape[0] // be.shape[0] < 16
                        or (si.shape[0] // be.shape[0]) & (si.shape[0] // be.shape[0] - 1)):
        fail("block_expert", f"len(sorted_ids) / block_m entries with block_m a power of "
             f"two >= 16 (len(sorted_ids) = {si.shape[0]})", f"shape {tuple(be.shape)}")
    npad = check_tensor("num_padded", num_padded, ndim=1, dtypes=(torch.int32,),
                        device=device)
    check_shape("num_padded", npad, (1,))
    if mul:
        tw = check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,),
                          device=device, contiguous=True)
        if tw.numel() != pairs:
            fail("topk_weights", f"{pairs} entries ([T, top_k], one per row of out)",
                 f"shape {tuple(tw.shape)}")


def check_fused_moe_args(x: object, w13: object, w2: object, topk_weights: object,
                         topk_ids: object, out: object) -> None:
    """The arguments of ``fused_moe`` (see its docstring for the shapes)."""
    xt = check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("x", xt)
    hidden = xt.shape[1]
    w1 = _check_moe_weights("w13", w13, xt.dtype, device)
    if w1.shape[2] != hidden or w1.shape[1] % 2:
        fail("w13", f"[E, 2 * I, {hidden}] (H = the last dim of x)", f"shape {tuple(w1.shape)}")
    experts, inter = w1.shape[0], w1.shape[1] // 2
    w2t = _check_moe_weights("w2", w2, xt.dtype, device)
    check_shape("w2", w2t, (experts, hidden, inter))
    _check_routing(xt, topk_weights, topk_ids, out, device)


def check_fused_moe_gguf_args(x: object, w13: object, w2: object, qtype13: object,
                              qtype2: object, topk_weights: object, topk_ids: object,
                              out: object) -> tuple[BlockFormat, BlockFormat]:
    """The arguments of ``fused_moe_gguf`` (see its docstring for the shapes); returns
    the two block formats. A weight whose rows are not whole blocks of the width x and
    w13 give is an error naming it."""
    xt = check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("x", xt)
    hidden = xt.shape[1]
    fmt13, fmt2 = block_format(qtype13, "qtype13"), block_format(qtype2, "qtype2")
    w1 = _check_moe_weights("w13", w13, torch.uint8, device)
    if w1.shape[1] % 2 or fmt13.row_weights(w1.shape[2], name="w13") != hidden:
        fail("w13", f"uint8 [E, 2 * I, {fmt13.row_bytes(hidden, name='x')}] ({fmt13.name} "
             f"rows of H = {hidden} weights)", f"shape {tuple(w1.shape)}")
    experts, inter = w1.shape[0], w1.shape[1] // 2
    w2t = _check_moe_weights("w2", w2, torch.uint8, device)
    check_shape("w2", w2t, (experts, hidden, fmt2.row_bytes(inter, name="w13 (I)")))
    _check_routing(xt, topk_weights, topk_ids, out, device)
    return fmt13, fmt2


def _check_routing(xt: torch.Tensor, topk_weights: object, topk_ids: object, out: object,
                   device: torch.device) -> None:
    """topk_ids ``[T, k]`` int32, topk_weights the same shape fp32, out ``[T, H]`` x's
    dtype: a MoE layer's routing and output beside x ``[T, H]``."""
    ids = check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), device=device)
    if ids.shape[0] != xt.shape[0] or ids.shape[1] == 0:
        fail("topk_ids", f"[{xt.shape[0]}, top_k >= 1] (one row per token of x)",
             f"shape {tuple(ids.shape)}")
    tw = check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,),
                      device=device, contiguous=True)
    check_shape("topk_weights", tw, ids.shape)
    if out is not None:
        o = check_tensor("out", out, ndim=2, dtypes=(xt.dtype,), device=device,
                         last_dim_contiguous=True)
        check_shape("out", o, xt.shape)


# --- GGUF quantized weights ---------------------------------------------------------------

def check_gguf_blocks(blocks: object, qtype: object, device: torch.device | None = None
                      ) -> tuple[torch.Tensor, BlockFormat, int]:
    """blocks uint8 ``[N, row_bytes]`` with unit last stride, each row a whole number of
    ``qtype`` blocks; returns ``(blocks, its format, K)``, K the weights a row holds."""
    b = check_tensor("blocks", blocks, ndim=2, dtypes=(torch.uint8,), device=device,
                     last_dim_contiguous=True)
    fmt = block_format(qtype)
    return b, fmt, fmt.row_weights(b.shape[1], name="blocks")


def check_gguf_matmul_args(x: object, blocks: object, qtype: object, out: object
                           ) -> tuple[torch.Tensor, torch.Tensor, BlockFormat]:
    """The arguments of ``gguf_matmul`` (see its docstring); returns ``(x, blocks,
    format)``."""
    xt = check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    b, fmt, k = check_gguf_blocks(blocks, qtype, xt.device)
    if xt.shape[1] != k:
        fail("x", f"{k} columns (K of blocks: {b.shape[1]} bytes a row, {k} {fmt.name} "
             "weights)", f"shape {tuple(xt.shape)}")
    if out is not None:
        o = check_tensor("out", out, ndim=2, dtypes=(xt.dtype,), device=xt.device)
        check_shape("out", o, (xt.shape[0], b.shape[0]))
    return xt, b, fmt


def check_sampling_args(logits: object, **rows: object) -> torch.Tensor:
    """``logits`` ``[N, V]`` float with ``V >= 1``; each of ``rows`` (None allowed: a
    filter that is off) a ``[N]`` tensor on its device, int64 for ``top_k``, float32
    otherwise. Returns the typed logits."""
    lg = check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    n, vocab = lg.shape
    if vocab == 0:
        fail("logits", "a non-empty vocabulary", f"shape {(n, vocab)}")
    for name, t in rows.items():
        if t is None:
            continue
        dtype = torch.int64 if name == "top_k" else torch.float32
        check_shape(name, check_tensor(name, t, ndim=1, dtypes=(dtype,), device=lg.device),
                    (n,))
    return lg
