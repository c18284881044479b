"""Prompt scoring: which rows of a prompt step have their next-token logprobs taken.

A sequence added with ``score_prompt`` (a request with ``prompt_logprobs``) has every
prompt position p < len(prompt) - 1 scored once: the logits of its row give the logprob
of prompt token p + 1. Each prompt step scores the positions of its chunk that are not
scored yet (``Sequence.prompt_scored`` counts them), so chunked prefill splits the work and
a recompute after preemption does not score a position twice. Admission keeps such a
sequence from skipping unscored positions through the prefix cache (``Admission``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_scheduler.sequence import Sequence

__all__ = ["ScoreRows", "score_rows"]


@dataclass
class ScoreRows:
    """The scored rows of one prompt step.

    rows     int64 [R]  rows of the step's packed tokens whose logits are scored
    targets  int64 [R]  the prompt token each row scores (the one after its position)
    owners   ``(sequence, first position, count)`` per scored sequence, in row order
    """

    rows: torch.Tensor
    targets: torch.Tensor
    owners: list[tuple[Sequence, int, int]]


def score_rows(sched: list[tuple[Sequence, int, int]]) -> ScoreRows | None:
    """The rows to score in a prompt step of ``sched`` (``(seq, first new token, number of
    new tokens)`` in batch order), advancing each scored sequence's ``prompt_scored``;
    None when no row is scored."""
    rows: list[np.ndarray] = []
    targets: list[int] = []
    owners: list[tuple[Sequence, int, int]] = []
    offset = 0
    for seq, start, num in sched:
        if seq.prompt_scored >= 0:
            prompt = seq.prompt_token_ids
            lo = max(start, seq.prompt_scored)
            hi = min(start + num, len(prompt) - 1)
            if hi > lo:
                rows.append(np.arange(offset + lo - start, offset + hi - start))
                targets += prompt[lo + 1:hi + 1]
                owners.append((seq, lo, hi - lo))
                seq.prompt_scored = hi
        offset += num
    if not owners:
        return None
    return ScoreRows(torch.from_numpy(np.concatenate(rows).astype(np.int64)),
                     torch.tensor(targets, dtype=torch.int64), owners)
