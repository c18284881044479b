"""The fused mixture-of-experts layer (SwiGLU experts) with the experts kept as GGUF
blocks: ``fused_moe``'s plan (one alignment, gate+up with SiLU-and-mul in its epilogue,
down with the routing weight, a sum over the k choices) on the block-decoding grouped
GEMM (``moe_gguf_gemm``). No host sync, so it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.fused_moe import moe_layer_launches, run_moe_layer
from deepinfer_kernels.gguf_blocks import BlockFormat
from deepinfer_kernels.moe_gguf_gemm import moe_gguf_gemm_launches
from deepinfer_kernels.runtime import Launch, Target
from deepinfer_kernels.validation import check_fused_moe_gguf_args


def fused_moe_gguf_launches(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    fmt13: BlockFormat,
    fmt2: BlockFormat,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    target: Target,
) -> list[Launch]:
    """Every launch of ``fused_moe_gguf`` except the final sum over k, for validated
    non-empty arguments (pure: shapes, dtypes and ``target``; buffers are allocated on
    x's device, so meta tensors plan without a GPU). ``out``: the per-pair
    ``[T * top_k, H]`` buffer."""
    weights, formats = (w13, w2), (fmt13, fmt2)
    return moe_layer_launches(
        x, topk_weights, topk_ids, out, w2.shape[0], w13.shape[1] // 2,
        lambda a, i, *rest: moe_gguf_gemm_launches(a, weights[i], formats[i], *rest, target),
        target)


def fused_moe_gguf(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    qtype13: int,
    qtype2: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture-of-experts MLP layer with SwiGLU experts held as GGUF blocks.

    x: ``[T, H]`` fp32/fp16/bf16, unit last stride. w13: uint8 ``[E, 2I, row_bytes(H)]``
    of ggml type ``qtype13`` (gate rows ``0..I``, up rows ``I..2I``), w2: uint8
    ``[E, H, row_bytes(I)]`` of type ``qtype2``, both contiguous, on x's device.
    topk_weights ``[T, k]`` fp32; topk_ids ``[T, k]`` int32 in ``[0, E)``. Returns
    ``[T, H]`` in x's dtype (``out`` when given): ``sum_j w_j * (silu(x @ gate_e.T) *
    (x @ up_e.T)) @ down_e.T``, fp32 accumulation; 16-bit x is multiplied by weights
    rounded to its dtype. Same contract as ``deepinfer_kernels.reference.fused_moe_gguf``;
    ``ValueError`` naming the argument on bad input, before any launch (a weight whose
    rows are not whole blocks among them).
    """
    fmt13, fmt2 = check_fused_moe_gguf_args(x, w13, w2, qtype13, qtype2, topk_weights,
                                            topk_ids, out)
    target = Target.of(x.device)
    return run_moe_layer(x, topk_ids, out, lambda ids, per_pair: fused_moe_gguf_launches(
        x, w13, w2, fmt13, fmt2, topk_weights, ids, per_pair, target))
