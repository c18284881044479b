"""Triton kernels of deepinfer (paged attention, KV store, cache/state copies,
mixture-of-experts routing, alignment and grouped GEMM).

``kernels.reference`` holds plain-torch versions with the same signatures. Without CUDA
the Triton kernels can only run through the interpreter, so ``TRITON_INTERPRET=1`` is set
here (unless already set) before any kernel module is imported: Triton reads it when a
kernel is decorated. Importing this package never fails for lack of Triton; calling an op
then raises a RuntimeError saying so.
"""

from __future__ import annotations

import os
from typing import Any

import torch

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



def _refuse_name_clash() -> None:
    """HuggingFace's ``kernels`` distribution (transformers 5.25 and later require it)
    has this package's import name: whichever comes first on ``sys.path`` hides the other,
    and transformers then fails deep inside with "cannot import name ... from 'kernels'".
    Say so here instead, with the way out."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        other = distribution("kernels")
    except PackageNotFoundError:
        return
    raise ImportError(
        f"the 'kernels' distribution {other.version} (HuggingFace's; transformers >= 5.25 "
        "requires it) is installed beside deepinfer, whose kernel package has the same "
        "import name 'kernels', so one hides the other: pip uninstall kernels && "
        "pip install 'transformers<5.25'")


_refuse_name_clash()

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only where triton is absent
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

if _IMPORT_ERROR is None:
    from kernels.activation import silu_and_mul
    from kernels.cache_ops import clone_blocks, clone_states, zero_states
    from kernels.decode_attention import paged_decode_attention
    from kernels.fused_moe import fused_moe, fused_moe_gemm
    from kernels.moe_align import moe_align
    from kernels.moe_routing import moe_route
    from kernels.prefill_attention import paged_prefill_attention
    from kernels.rms_norm import add_rms_norm, rms_norm
    from kernels.rotary import rotary_qk
    from kernels.sampling import sample_tokens
    from kernels.store_kv import store_kv
else:  # pragma: no cover

    def _missing(name: str) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"kernels.{name} needs Triton, which could not be imported "
                f"({_IMPORT_ERROR}); install triton or use kernels.reference"
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
