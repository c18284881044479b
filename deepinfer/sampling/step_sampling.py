"""The penalty-state input of one step: the tokens of the sequences admitted in it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from deepinfer_scheduler import Sequence


@dataclass
class StepSampling:
    """Penalty state of the sequences admitted this step (their slot was just zeroed):
    the whole prompt (prefix-cache hits included) and, after a preemption, the outputs
    generated before it. Host int64 tensors of equal length per pair (the engine passes
    no ``StepSampling`` when no sequence was admitted). Sampling parameters live in
    ``ModelRunner.sampling_table``.

    prompt_tokens / prompt_slots  int64 [P]  each prompt token and its sequence's slot
    output_tokens / output_slots  int64 [O]  each earlier output token and its slot
    """

    prompt_tokens: torch.Tensor | None = None
    prompt_slots: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    output_slots: torch.Tensor | None = None

    @classmethod
    def of(cls, seqs: Iterable[Sequence]) -> StepSampling:
        """The tokens of ``seqs`` (admitted this step, each holding its slot), to be
        recorded into their slots' penalty state."""
        p_tok: list[int] = []
        p_slot: list[int] = []
        o_tok: list[int] = []
        o_slot: list[int] = []
        for seq in seqs:
            slot = seq.slot
            p_tok += seq.prompt_token_ids
            p_slot += [slot] * len(seq.prompt_token_ids)
            o_tok += seq.output_token_ids
            o_slot += [slot] * len(seq.output_token_ids)
        return cls(prompt_tokens=torch.tensor(p_tok, dtype=torch.int64),
                   prompt_slots=torch.tensor(p_slot, dtype=torch.int64),
                   output_tokens=torch.tensor(o_tok, dtype=torch.int64),
                   output_slots=torch.tensor(o_slot, dtype=torch.int64))
