"""Prompt logprobs on the runner's side: the logits of a prompt step's scored rows
(``LaunchBatch.score_rows``, chosen by the scheduler's ``prompt_scores``), a chunk of rows
at a time, reduced to each row's target logprob and top ``k``.

Why chunks: a row's logits are vocabulary-sized (49152 floats for SmolLM2, 152k for
Qwen3), and a long scored prompt has thousands of rows; a chunk holds at most
``SCORE_ELEMENTS`` logits. Every rank of a tensor-parallel group runs the same chunks
(each one's logits gather is a collective); only the leader reduces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SCORE_ELEMENTS", "PromptScores", "score_rows"]

#: Logits (fp32) one chunk of scored rows may hold: 64 MiB.
SCORE_ELEMENTS = 1 << 24


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

    def entry(self, row: int, target: int, k: int) -> dict[int, float]:
        """``{token: logprob}`` of one row: its target, then its top ``k`` (a target among
        them is listed once)."""
        d = {target: float(self.target_logprobs[row])}
        for t, lp in zip(self.top_ids[row, :k].tolist(), self.top_logprobs[row, :k].tolist()):
            d.setdefault(t, lp)
        return d


def score_rows(model: nn.Module, hidden: torch.Tensor, rows: torch.Tensor,
               targets: torch.Tensor | None, k: int, vocab: int) -> PromptScores | None:
    """Score ``rows`` (int64 ``[R]`` on hidden's device) of a step's hidden states
    (``[T, H]``): log-softmax of their logits (``model.compute_logits``), the logprob of
    ``targets`` (int64 ``[R]``) and the top ``k``. A tensor-parallel follower passes
    ``targets=None``: it takes part in each chunk's logits gather and gets None.
    ``vocab``: the model's vocabulary size (sizes the chunks, the same on every rank)."""
    chunk = max(1, SCORE_ELEMENTS // vocab)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for i in range(0, rows.shape[0], chunk):
        logits = model.compute_logits(hidden[rows[i:i + chunk]])
        if logits is None or targets is None:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        target = lp.gather(1, targets[i:i + chunk, None].to(lp.device)).squeeze(1)
        top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        parts.append((target.cpu(), top_ids.cpu(), top_lp.cpu()))
    if not parts:
        return None
    return PromptScores(*(torch.cat(p) for p in zip(*parts)))
