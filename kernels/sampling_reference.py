"""Plain-torch token sampling: the draw (``sample_tokens``: an inverse CDF at a given
uniform), the filters before it (top-k, top-p, min-p: ``filter_logits``), both together
(``sample_tokens_filtered``), and the float64 oracle of a draw (``inverse_cdf_draw_ok``).
Re-exported by ``deepinfer_kernels.reference``: the reference of the sampling ops."""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``softmax(logits / temperature)`` by inverting the CDF at
    ``uniforms`` (``[N]`` float32): the first token whose cumulative probability exceeds
    ``uniform * total``. logits ``[N, V]`` (not modified) -> ``[N]`` int64. A token with
    zero probability is never returned (should rounding land on one, the row's most
    likely token instead)."""
    probs = torch.softmax(logits.float() / temperatures.unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    token_ids.clamp_(max=probs.shape[-1] - 1)
    ok = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, token_ids, probs.argmax(dim=-1))


def inverse_cdf_draw_ok(logits: torch.Tensor, temperatures: torch.Tensor,
                        uniforms: torch.Tensor, token_ids: torch.Tensor,
                        rel_tol: float = 1e-5) -> torch.Tensor:
    """Per row (``[N]`` bool): whether ``token_ids`` ``[N]`` is an inverse-CDF answer of
    ``softmax(logits / temperature)`` at ``uniforms``, checked in float64 up to
    ``rel_tol`` of the total: ``cdf[i-1] <= target + tol``, ``cdf[i] >= target - tol``
    and ``p[i] > 0``. The oracle for any draw whose sums run in another order than
    ``sample_tokens``' (a row whose target lies within rounding of a boundary may then
    pick either neighbour, both valid)."""
    p = torch.softmax(logits.double() / temperatures.double()[:, None], dim=-1)
    cdf = p.cumsum(dim=-1)
    total = cdf[:, -1]
    target, tol = uniforms.double() * total, rel_tol * total
    i = token_ids.unsqueeze(1)
    above = cdf.gather(1, i).squeeze(1)
    below = torch.where(token_ids > 0, cdf.gather(1, (i - 1).clamp(min=0)).squeeze(1), 0.0)
    return (below <= target + tol) & (above >= target - tol) & (p.gather(1, i).squeeze(1) > 0)


def filter_logits(logits: torch.Tensor, temperatures: torch.Tensor,
                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  min_p: torch.Tensor | None = None,
                  max_top_k: int | None = None) -> torch.Tensor:
    """``logits / temperature`` (a new float32 ``[N, V]``; the input is not modified)
    with -inf where top-k, then top-p, then min-p drop a token:

    - ``top_k`` ``[N]`` int64: keep the ``k`` largest and every token tied with the k-th
      (``k >= V``: off);
    - ``top_p`` ``[N]`` fp32 in ``(0, 1]``: in order of decreasing value (ties by
      increasing id: a stable sort), drop a token once the probabilities before it,
      renormalized over what top-k kept, reach ``top_p`` (1: off; the first token stays);
    - ``min_p`` ``[N]`` fp32 in ``[0, 1]``: drop tokens whose probability is below
      ``min_p`` times the largest (0: off).

    ``None`` turns a filter off for every row. ``max_top_k``: a host bound on the rows'
    ``top_k`` below ``V`` (saves reading it from the device); None reads it."""
    scaled = logits.float() / temperatures.unsqueeze(1)
    if top_p is not None:
        _top_k_top_p_sorted(scaled, top_k, top_p)
    elif top_k is not None:
        vocab = scaled.shape[-1]
        k_max = int(top_k.clamp(max=vocab).max()) if max_top_k is None else max_top_k
        _top_k(scaled, top_k, max(1, min(k_max, vocab)))
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i - max logit < log(min_p): no softmax here.
        top = scaled.amax(dim=-1, keepdim=True)
        scaled.masked_fill_(scaled - top < min_p.log().unsqueeze(1), float("-inf"))
    return scaled


def sample_tokens_filtered(logits: torch.Tensor, temperatures: torch.Tensor,
                           uniforms: torch.Tensor, top_k: torch.Tensor | None = None,
                           top_p: torch.Tensor | None = None,
                           min_p: torch.Tensor | None = None,
                           max_top_k: int | None = None) -> torch.Tensor:
    """One draw per row of ``logits`` ``[N, V]`` (not modified) after ``filter_logits``
    (same arguments), by ``sample_tokens`` at ``uniforms`` ``[N]`` fp32. Returns ``[N]``
    int64."""
    scaled = filter_logits(logits, temperatures, top_k, top_p, min_p, max_top_k)
    return sample_tokens(scaled, torch.ones_like(uniforms), uniforms)


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """Keep each row's ``top_k[i]`` largest logits (ties at the threshold survive), in
    place; ``max_k``: at least every row's ``top_k`` below the vocabulary."""
    vals = logits.topk(max_k, dim=-1).values  # [N, max_k], descending
    kth = vals.gather(1, (top_k.clamp(min=1, max=max_k) - 1).unsqueeze(1))
    # Rows with top-k off (k == vocab > max_k) keep everything.
    kth.masked_fill_((top_k > max_k).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor) -> None:
    """Top-k then top-p with one stable descending sort, in place; rows with ``top_p`` 1
    skip top-p. Ties at the k-th value survive top-k, as in ``_top_k`` (and vLLM): which of
    several equal logits the sort puts first must not decide which ones can be drawn; among
    tokens tied at the top-p cut, the lower ids come first."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(min=1, max=vocab) - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p; the first always stays.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
