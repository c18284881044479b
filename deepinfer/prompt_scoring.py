"""Prompt logprobs on the runner's side: the logits of a prompt step's scored rows
(``LaunchBatch.score_rows``, chosen by the scheduler's ``prompt_scores``), a chunk of rows
at a time, reduced to each row's target logprob and top ``k``.

Why chunks: a row's logits are vocabulary-sized (49152 floats for SmolLM2, 152k for
Qwen3), and a long scored prompt has thousands of rows; a chunk holds at most
``SCORE_ELEMENTS`` logits. Every rank of a tensor-parallel group runs the same chunks
(each one's gather is a collective). Under tensor parallelism the vocabulary shards are
not gathered: each rank reduces its own to a log-sum-exp, a top k and the target's logit,
and the leader combines those (``2 + 2 * SHARD_TOP_K`` numbers a row, not the
vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SCORE_ELEMENTS", "SHARD_TOP_K", "PromptScores", "score_rows"]

#: Logits (fp32) one chunk of scored rows may hold: 64 MiB.
SCORE_ELEMENTS = 1 << 24
#: Top entries each tensor-parallel rank sends a row: the most any request may ask for
#: (``SamplingParams``' ``MAX_LOGPROBS``), so that followers, which do not know the
#: step's requests, send as many as the leader.
SHARD_TOP_K = 20


@dataclass
class PromptScores:
    """The scored rows of one prompt step, on the host, in row order.

    target_logprobs  float32 [R]     logprob of the token each row scores
    top_ids          int64   [R, k]  the k most likely tokens of each row, best first
    top_logprobs     float32 [R, k]  their logprobs
    """

    target_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def entries(self, first: int, targets: list[int], k: int) -> list[dict[int, float]]:
        """``{token: logprob}`` of rows ``first .. first + len(targets) - 1``: each row's
        target, then its top ``k`` (a target among them listed once). One host read of
        those rows, not one per number."""
        end = first + len(targets)
        lps = self.target_logprobs[first:end].tolist()
        ids = self.top_ids[first:end, :k].tolist()
        tops = self.top_logprobs[first:end, :k].tolist()
        out = []
        for target, lp, row_ids, row_lps in zip(targets, lps, ids, tops):
            d = {target: lp}
            for t, v in zip(row_ids, row_lps):
                d.setdefault(t, v)
            out.append(d)
        return out


def score_rows(model: nn.Module, hidden: torch.Tensor, rows: torch.Tensor,
               targets: torch.Tensor, k: int, vocab: int) -> PromptScores | None:
    """Score ``rows`` (int64 ``[R]`` on hidden's device) of a step's hidden states
    (``[T, H]``): log-softmax of their logits, the logprob of ``targets`` (int64 ``[R]``)
    and the top ``k``. Under tensor parallelism each rank reduces its vocabulary block
    (``model.shard_logits``) to its log-sum-exp, its top ``k`` and the target's logit where
    the block holds it (``SHARD_TOP_K`` of each, whatever ``k``), and only those numbers
    are gathered to the leader, which combines them; a follower gets None. ``vocab``: the
    model's vocabulary size (sizes the chunks, alike on all ranks)."""
    tp = model.tp
    chunk = max(1, SCORE_ELEMENTS // vocab)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for i in range(0, rows.shape[0], chunk):
        local = model.shard_logits(hidden[rows[i:i + chunk]]).float()
        if tp.size == 1:
            lp = torch.log_softmax(local, dim=-1)
            target = lp.gather(1, targets[i:i + chunk, None].to(lp.device)).squeeze(1)
            top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        else:
            got = _gather_shard_stats(tp, local, targets, i, SHARD_TOP_K)
            if got is None:
                continue
            target, top_ids, top_lp = got
        parts.append((target.cpu(), top_ids.cpu(), top_lp.cpu()))
    if not parts:
        return None
    return PromptScores(*(torch.cat(p) for p in zip(*parts)))


def _gather_shard_stats(tp, local: torch.Tensor, targets: torch.Tensor, i: int,
                        k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One chunk's per-shard reduction under tensor parallelism: local logits ``[n, Vs]``
    -> on the leader ``(target logprob [n], top ids [n, k], top logprobs [n, k])``, None
    on the others. Token ids travel as float32: exact below 2^24 (any real vocabulary)."""
    n, width = local.shape
    start = tp.rank * width
    k = min(k, width)
    lse = torch.logsumexp(local, dim=-1, keepdim=True)
    top_v, top_i = local.topk(k, dim=-1)
    # The target's logit from the one rank whose block holds it, -inf from the others.
    t = targets[i:i + n].to(local.device)[:, None] - start
    inside = (t >= 0) & (t < width)
    tgt = torch.where(inside, local.gather(1, t.clamp(0, width - 1)),
                      torch.full((n, 1), float("-inf"), device=local.device))
    stats = tp.gather_to_leader(torch.cat([lse, tgt, top_v, (top_i + start).float()], 1))
    if stats is None:
        return None
    per = stats.view(n, tp.size, 2 + 2 * k)
    total = torch.logsumexp(per[:, :, 0], dim=-1)
    cand_v = per[:, :, 2:2 + k].reshape(n, -1)
    cand_i = per[:, :, 2 + k:].reshape(n, -1)
    best_v, pick = cand_v.topk(k, dim=-1)
    return ((per[:, :, 1].amax(dim=-1) - total), cand_i.gather(1, pick).long(),
            best_v - total[:, None])
