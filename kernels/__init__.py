"""Triton kernels of deepinfer (paged attention, KV store, cache/state copies,
mixture-of-experts routing, alignment and grouped GEMM).

The folder kernels/ installs under the import name ``deepinfer_kernels``.
``deepinfer_kernels.reference`` holds plain-torch versions with the same signatures.
Without CUDA the Triton kernels can only run through the interpreter, so
``TRITON_INTERPRET=1`` is set here (unless already set) before any kernel module is
imported: Triton reads it when a kernel is decorated. Importing this package never fails
for lack of Triton; calling an op then raises a RuntimeError saying so.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if __name__ == "kernels":
    # The checkout's root is on sys.path (python -m ... run from it), so this folder was
    # found under its folder name. That name belongs to HuggingFace's kernels package
    # (transformers imports it): load the installed one in its place. Where none is
    # installed, hand back an empty namespace, as a folder without __init__.py would give
    # (transformers' probe reads that as "not installed"). deepinfer itself imports this
    # folder only as deepinfer_kernels.
    import importlib.machinery
    import importlib.util

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout])
    if _spec is None or _spec.loader is None:
        _spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _spec.submodule_search_locations = []
    _installed = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _installed  # what the import statement hands back
    if _spec.loader is not None:
        _spec.loader.exec_module(_installed)

import torch  # noqa: E402

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "clone_blocks",
    "zero_states",
    "clone_states",
    "moe_route",
    "moe_align",
    "fused_moe_gemm",
    "fused_moe",
    "rms_norm",
    "add_rms_norm",
    "rotary_qk",
    "silu_and_mul",
    "sample_tokens",
]

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only where triton is absent
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

if _IMPORT_ERROR is None:
    from deepinfer_kernels.activation import silu_and_mul
    from deepinfer_kernels.cache_ops import clone_blocks, clone_states, zero_states
    from deepinfer_kernels.decode_attention import paged_decode_attention
    from deepinfer_kernels.fused_moe import fused_moe, fused_moe_gemm
    from deepinfer_kernels.moe_align import moe_align
    from deepinfer_kernels.moe_routing import moe_route
    from deepinfer_kernels.prefill_attention import paged_prefill_attention
    from deepinfer_kernels.rms_norm import add_rms_norm, rms_norm
    from deepinfer_kernels.rotary import rotary_qk
    from deepinfer_kernels.sampling import sample_tokens
    from deepinfer_kernels.store_kv import store_kv
else:  # pragma: no cover

    def _missing(name: str) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"deepinfer_kernels.{name} needs Triton, which could not be imported "
                f"({_IMPORT_ERROR}); install triton or use deepinfer_kernels.reference"
            )

        op.__name__ = name
        return op

    store_kv = _missing("store_kv")
    paged_decode_attention = _missing("paged_decode_attention")
    paged_prefill_attention = _missing("paged_prefill_attention")
    clone_blocks = _missing("clone_blocks")
    zero_states = _missing("zero_states")
    clone_states = _missing("clone_states")
    moe_route = _missing("moe_route")
    moe_align = _missing("moe_align")
    fused_moe_gemm = _missing("fused_moe_gemm")
    fused_moe = _missing("fused_moe")
    rms_norm = _missing("rms_norm")
    add_rms_norm = _missing("add_rms_norm")
    rotary_qk = _missing("rotary_qk")
    silu_and_mul = _missing("silu_and_mul")
    sample_tokens = _missing("sample_tokens")
