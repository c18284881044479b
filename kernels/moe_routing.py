"""Mixture-of-experts routing: softmax over the router logits in fp32, top-k, optional
renormalisation of the k selected weights.

One program handles BLOCK_T tokens with all E logits of each in registers (``E_PAD`` =
next power of two). Top-k is k rounds of "take the row maximum, record it, knock it
out" (``tl.static_range``, so k is unrolled): O(k * E) compares per token, which is what a
router with E <= 1024 and k <= 16 wants; ties go to the lowest expert index (the
reference sorts stably, so both agree bit for bit on ids). Beyond ``MAX_TRITON_EXPERTS``
the op falls back to ``torch.topk`` (same results up to tie order), since a register tile
of a whole row no longer fits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, next_pow2, run_launches
from deepinfer_kernels.validation import check_moe_route_args

MAX_TRITON_EXPERTS = 1024
MAX_TOP_K = 64


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    num_tokens, num_experts, stride_t,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    t_ok = t < num_tokens
    e_ok = e < num_experts
    x = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_t + e[None, :],
                mask=t_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)
    # Rows past the end are zeros (never stored): no -inf - -inf, no 0 / 0.
    x = tl.where(t_ok[:, None], x, 0.0)
    m = tl.max(x, 1)
    p = tl.exp(x - m[:, None])
    p = p / tl.sum(p, 1)[:, None]
    # Padding columns rank below every real probability (which is >= 0). A NaN (from a
    # NaN logit) ranks with them, after the real columns: ids stay in [0, E).
    p = tl.where(e_ok[None, :] & (p == p), p, -1.0)

    kk = tl.arange(0, K_PAD)
    top_w = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    top_i = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        idx = tl.min(tl.where(p == best[:, None], e[None, :], E_PAD), 1)
        top_w = tl.where(kk[None, :] == i, best[:, None], top_w)
        top_i = tl.where(kk[None, :] == i, idx[:, None], top_i)
        p = tl.where(e[None, :] == idx[:, None], -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    out = t.to(tl.int64)[:, None] * TOP_K + kk[None, :]
    mask = t_ok[:, None] & (kk < TOP_K)[None, :]
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


def route_launches(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    target: Target,
) -> list[Launch]:
    """The launch of ``moe_route`` for validated, non-empty arguments with
    ``E <= MAX_TRITON_EXPERTS`` (pure: shapes, dtypes and ``target`` only)."""
    num_tokens, num_experts = router_logits.shape
    e_pad = next_pow2(max(num_experts, 16))
    # About 4K logits per program on a GPU (32 fp32 registers per thread at 4 warps).
    per_program = 4096 if not target.interpret else 1024
    block_t = max(1, min(next_pow2(num_tokens), per_program // e_pad, 64))
    return [Launch(_route_kernel, (triton.cdiv(num_tokens, block_t),), (
        router_logits, topk_weights, topk_ids,
        num_tokens, num_experts, router_logits.stride(0),
    ), dict(TOP_K=top_k, K_PAD=next_pow2(top_k), E_PAD=e_pad, BLOCK_T=block_t,
            RENORMALIZE=bool(renormalize),
            num_warps=1 if target.interpret else (4 if e_pad <= 256 else 8)))]


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts from its router logits.

    router_logits: ``[T, E]`` fp32/fp16/bf16, unit last stride. The softmax over all E
    experts is taken in fp32; the k largest probabilities are returned in descending order
    (ties: lowest expert index first), divided by their sum when ``renormalize`` (Qwen3-MoE
    / Qwen2-MoE / OLMoE with ``norm_topk_prob``; Mixtral always).

    Returns ``(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)``, contiguous.
    """
    logits = check_moe_route_args(router_logits, top_k, renormalize)
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if num_experts > MAX_TRITON_EXPERTS:  # torch fallback: a row no longer fits registers
        probs = torch.softmax(logits.float(), dim=-1)
        w, i = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        weights.copy_(w)
        ids.copy_(i)
        return weights, ids
    run_launches(route_launches(logits, top_k, renormalize, weights, ids,
                                Target.of(logits.device)))
    return weights, ids
