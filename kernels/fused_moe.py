"""The fused mixture-of-experts layer (SwiGLU experts) on the grouped GEMM.

``fused_moe(x, w13, w2, topk_weights, topk_ids)``: align the (token, k) pairs by expert
once (``moe_align``), then two grouped GEMMs through the same sorted ids: gate+up with
SiLU-and-mul fused into its epilogue (``[T*k, I]``), then down with the routing weight
(``[T*k, H]``), and a sum over the k choices of each token. No host sync: the padded
sizes are host bounds from shapes, and blocks past the device-side padded total exit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kernels.moe_align import align_launches, moe_align_size
from deepinfer_kernels.moe_gemm import moe_block_m, moe_gemm_launches
from deepinfer_kernels.runtime import Launch, Target, run_launches
from deepinfer_kernels.validation import check_fused_moe_args, check_moe_gemm_args


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
    mul_routed_weight: bool,
    gated: bool = False,
) -> torch.Tensor:
    """Grouped GEMM over stacked expert weights, rows through ``moe_align``'s output.

    a: ``[T, K]`` (per token: pair ``i`` reads row ``i // top_k``) or ``[T * top_k, K]``
    (per pair), fp32/fp16/bf16, unit last stride. w: ``[E, N, K]`` (``[E, 2N, K]`` when
    ``gated``), a's dtype, contiguous. sorted_ids ``[P]``, block_expert ``[P // block_m]``,
    num_padded ``[1]``: int32, from ``moe_align`` (block_m is ``P // len(block_expert)``).
    topk_weights: ``[T, top_k]`` fp32 (read when ``mul_routed_weight``; may be None
    otherwise). out: ``[T * top_k, N]`` float, unit last stride; row ``i`` receives pair
    ``i``'s ``a_row @ w[e].T`` (times its weight when ``mul_routed_weight``; ``silu(gate)
    * up`` when ``gated``). Rows of pairs with an out-of-range expert are not written.
    Returns ``out``.
    """
    check_moe_gemm_args(a, w, sorted_ids, block_expert, num_padded, topk_weights, out,
                        top_k, mul_routed_weight, gated)
    if out.numel() == 0 or sorted_ids.numel() == 0:
        return out
    run_launches(moe_gemm_launches(a, w, sorted_ids, block_expert, num_padded, topk_weights,
                                   out, top_k, mul_routed_weight, gated, Target.of(a.device)))
    return out


#: A grouped GEMM's launches with the layer's weight ``0`` (w13) or ``1`` (w2): ``gemm(a,
#: weight, sorted_ids, block_expert, num_padded, topk_weights, out, top_k,
#: mul_routed_weight, gated)``, the arguments of ``moe_gemm_launches`` after its weight.
GemmLaunches = Callable[..., list[Launch]]


def moe_layer_launches(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       out: torch.Tensor, num_experts: int, inter: int, gemm: GemmLaunches,
                       target: Target) -> list[Launch]:
    """A MoE layer's plan on any grouped GEMM (float or GGUF experts): one alignment of the
    ``[T, k]`` pairs by expert, gate+up with SiLU-and-mul in its epilogue into a ``[T * k,
    inter]`` buffer, then down with the routing weight into ``out`` (``[T * k, H]``, per
    pair). The alignment's outputs are sized by host bounds from shapes and allocated on
    x's device (meta tensors plan without a GPU)."""
    num_tokens, top_k = topk_ids.shape
    block_m = moe_block_m(num_tokens, top_k, num_experts, target)
    size = moe_align_size(num_tokens * top_k, num_experts, block_m)
    device = x.device
    sorted_ids = torch.empty((size,), dtype=torch.int32, device=device)
    block_expert = torch.empty((size // block_m,), dtype=torch.int32, device=device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=device)
    return (
        align_launches(topk_ids, num_experts, block_m, sorted_ids, block_expert, num_padded,
                       target)
        + gemm(x, 0, sorted_ids, block_expert, num_padded, None, act, top_k, False, True)
        + gemm(act, 1, sorted_ids, block_expert, num_padded, topk_weights, out, top_k, True,
               False)
    )


def run_moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor | None,
                  launches: Callable[[torch.Tensor, torch.Tensor], list[Launch]]
                  ) -> torch.Tensor:
    """Runs ``launches(topk_ids, per_pair)`` (a layer's plan into a ``[T * k, H]``
    per-pair buffer) and sums over the k choices into ``out`` (``[T, H]``, made when
    None), for validated arguments. No launch for zero tokens."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    per_pair = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    run_launches(launches(topk_ids.contiguous(), per_pair))
    # Sum over the k choices (fp32 accumulation inside torch's reduction).
    torch.sum(per_pair.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out


def fused_moe_launches(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    target: Target,
) -> list[Launch]:
    """Every launch of ``fused_moe`` except the final sum over k (alignment, gate+up,
    down), for validated non-empty arguments. Pure: shapes, dtypes and ``target``; the
    buffers are allocated on x's device (meta tensors plan without a GPU). ``out`` here
    is the per-pair ``[T * top_k, H]`` buffer."""
    weights = (w13, w2)
    return moe_layer_launches(
        x, topk_weights, topk_ids, out, w2.shape[0], w2.shape[2],
        lambda a, i, *rest: moe_gemm_launches(a, weights[i], *rest, target), target)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture-of-experts MLP layer with SwiGLU experts.

    x: ``[T, H]`` fp32/fp16/bf16, unit last stride. w13: ``[E, 2I, H]`` (gate rows
    ``0..I``, up rows ``I..2I``), w2: ``[E, H, I]``, both x's dtype, contiguous.
    topk_weights: ``[T, k]`` fp32; topk_ids: ``[T, k]`` int32 in ``[0, E)`` (from
    ``moe_route``, whose ids always are, NaN logits included). Returns ``[T, H]`` in x's
    dtype (``out`` when given): ``sum_j w_j * (silu(x @ gate_e.T) * (x @ up_e.T)) @
    down_e.T`` over the k choices. An id outside ``[0, E)`` is a caller error the host
    cannot see without a sync: the alignment drops its pair, whose share of the sum is
    then undefined (the reference raises).
    """
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids, out)
    target = Target.of(x.device)
    return run_moe_layer(x, topk_ids, out, lambda ids, per_pair: fused_moe_launches(
        x, w13, w2, topk_weights, ids, per_pair, target))
