"""Triton kernels of deepinfer (paged attention, KV store, cache/state copies,
mixture-of-experts routing, alignment and grouped GEMM, matmuls and experts on
GGUF-quantized weights).

The folder kernels/ installs under the import name ``deepinfer_kernels``.
``deepinfer_kernels.reference`` holds plain-torch versions with the same signatures.
Without CUDA the Triton kernels can only run through the interpreter, so importing the
package sets ``TRITON_INTERPRET=1`` (unless already set; ``ops``) before any kernel is
decorated. Importing it never fails for lack of Triton; calling an op then raises a
RuntimeError saying so.
"""

from __future__ import annotations

import os
import sys

if __name__ == "kernels":
    # The checkout's root is on sys.path (python -m ... run from it), so this folder was
    # found under its folder name. That name belongs to HuggingFace's kernels package
    # (transformers imports it): load the installed one in its place, and nothing of
    # deepinfer's. Where none is installed, hand back an empty namespace, as a folder
    # without __init__.py would give (transformers' probe reads that as "not installed").
    # deepinfer itself imports this folder only as deepinfer_kernels.
    import importlib.machinery
    import importlib.util

    _this = os.path.realpath(__file__)
    _checkout = os.path.dirname(os.path.dirname(_this))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout])
    if (_spec is None or _spec.loader is None or _spec.origin is None
            or os.path.realpath(_spec.origin) == _this):  # this folder again, via a link
        _spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _spec.submodule_search_locations = []
    _installed = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _installed  # what the import statement hands back
    if _spec.loader is not None:
        _spec.loader.exec_module(_installed)
else:
    from deepinfer_kernels.ops import (
        add_rms_norm,
        bind_decoder_stack,
        clone_blocks,
        clone_states,
        fused_moe,
        fused_moe_gemm,
        fused_moe_gguf,
        gguf_matmul,
        moe_align,
        moe_route,
        paged_decode_attention,
        paged_prefill_attention,
        rms_norm,
        rotary_qk,
        sample_tokens,
        sample_tokens_filtered,
        silu_and_mul,
        store_kv,
        zero_states,
    )

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
        "fused_moe_gguf",
        "rms_norm",
        "add_rms_norm",
        "rotary_qk",
        "silu_and_mul",
        "sample_tokens",
        "sample_tokens_filtered",
        "gguf_matmul",
        "bind_decoder_stack",
    ]
