"""The ops of the kernel package, as ``deepinfer_kernels`` exports them: the Triton
kernels, or, where Triton cannot be imported, stand-ins that raise a RuntimeError saying
so when called. Without CUDA the kernels can only run through the interpreter, so
``TRITON_INTERPRET=1`` is set here (unless already set) before any kernel module is
imported: Triton reads it when a kernel is decorated."""

from __future__ import annotations

import os
from typing import Any

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only where triton is absent
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

# Needs no Triton: no backend but the CPU one fuses the decode stack.
from deepinfer_kernels.decoder_spec import bind_decoder_stack  # noqa: E402, F401

if _IMPORT_ERROR is None:
    from deepinfer_kernels.activation import silu_and_mul
    from deepinfer_kernels.cache_ops import clone_blocks, clone_states, zero_states
    from deepinfer_kernels.decode_attention import paged_decode_attention
    from deepinfer_kernels.fused_moe import fused_moe, fused_moe_gemm
    from deepinfer_kernels.fused_moe_gguf import fused_moe_gguf
    from deepinfer_kernels.gguf_matmul import gguf_matmul
    from deepinfer_kernels.moe_align import moe_align
    from deepinfer_kernels.moe_routing import moe_route
    from deepinfer_kernels.prefill_attention import paged_prefill_attention
    from deepinfer_kernels.rms_norm import add_rms_norm, rms_norm
    from deepinfer_kernels.rotary import rotary_qk
    from deepinfer_kernels.sampling import sample_tokens, sample_tokens_filtered
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
    fused_moe_gguf = _missing("fused_moe_gguf")
    rms_norm = _missing("rms_norm")
    add_rms_norm = _missing("add_rms_norm")
    rotary_qk = _missing("rotary_qk")
    silu_and_mul = _missing("silu_and_mul")
    sample_tokens = _missing("sample_tokens")
    sample_tokens_filtered = _missing("sample_tokens_filtered")
    gguf_matmul = _missing("gguf_matmul")
