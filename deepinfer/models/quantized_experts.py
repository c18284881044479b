"""A mixture-of-experts MLP whose experts are kept as GGUF blocks: grouped by expert,
each expert's two products through the GGUF matmul bound to its blocks.

Why not the backend's ``fused_moe``: that op takes float stacks (``w13 [E, 2I, H]``,
``w2 [E, H, I]``). Dequantizing an expert per call would cost more than the product
itself, and keeping float copies would undo the point (a 30B MoE's experts are ~95% of
its weights). Grouping follows the reference ``fused_moe``: one pair of products per
expert that got a token, no per-token loop, contributions summed in fp32 in routing
order. It needs the per-expert counts on the host, so it runs on the CPU only; on CUDA
the backend's ``fused_moe_gguf`` reads the stacks whole, without a sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: One expert's bound products: x ``[M, H]`` -> gate/up ``[M, 2I]``, and ``[M, I]`` ->
#: ``[M, H]``, both in x's dtype.
ExpertMatmuls = tuple[Callable[[torch.Tensor], torch.Tensor],
                      Callable[[torch.Tensor], torch.Tensor]]


def experts_from_blocks(x: torch.Tensor, matmuls: Sequence[ExpertMatmuls],
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """SwiGLU experts of x ``[T, H]`` weighted by the routing.

    matmuls: per expert, its bound gate/up and down products; topk_weights ``[T, k]``
    fp32 and topk_ids ``[T, k]`` int (``moe_route``'s output, ids in ``[0, E)``);
    silu_and_mul: ``[M, 2I]`` -> ``[M, I]`` (the backend's). Returns ``[T, H]`` in x's
    dtype, the experts' contributions summed in fp32.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=len(matmuls)).tolist()
    weights = topk_weights.reshape(-1).float()
    acc = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up, down = matmuls[e]
        y = down(silu_and_mul(gate_up(x[tokens])))
        acc.index_add_(0, tokens, y.float() * weights[pairs, None])
    return acc.to(x.dtype)
