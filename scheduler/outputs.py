"""What ``Scheduler.schedule()`` returns, and scheduler counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_scheduler.batch import LaunchBatch
from deepinfer_scheduler.prompt_scores import ScoreRows
from deepinfer_scheduler.running_rows import RunningRows
from deepinfer_scheduler.sequence import Sequence

# Shared by every step without copies or new sequences: no allocation on the hot path
# (size 0, so a borrower cannot change them).
_EMPTY = torch.zeros(0, dtype=torch.int64)
_EMPTY_PAIRS = torch.zeros((0, 2), dtype=torch.int64)


@dataclass
class SchedulerStats:
    """Counters since the scheduler was built."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    num_prompt_steps: int = 0
    num_decode_steps: int = 0


@dataclass
class SchedulerOutputs:
    """One step: its type, the scheduled sequences and the launch tensors.

    Borrow contract: ``batch``'s tensors, ``clone_blocks``, ``zero_states`` and
    ``clone_states`` are views of host buffers the scheduler reuses. They are valid until
    the next ``schedule()`` call: consume them (copy to the device, or ``.clone()``)
    before scheduling again. The runner applies, in order: ``clone_blocks`` (KV
    copy-on-write), ``zero_states``, the step's prompt tokens into the new sequences'
    state, ``clone_states`` (forks), the forward pass, sampling.

    is_prompt          prompt (prefill) step, else decode step; never mixed
    seqs / seq_ids     scheduled sequences in batch order (``seq_ids``: list[int])
    sample_seqs        the Sequence each sample belongs to (for a fork: parent, children)
    num_batched_tokens T, tokens in the step
    num_samples        S, token ids ``update()`` expects
    clone_blocks       int64 [N, 2] (src, dst) KV blocks to copy before the forward
    zero_states        int64 [M] state slots of newly admitted sequences
    clone_states       int64 [P, 2] (parent slot, child slot) of sequences forked now
    admitted           the sequences whose slot ``zero_states`` zeroes (new or recomputed,
                       at their first chunk), in that order; ``()`` when none
    forked             the children ``clone_states`` copies into, in that order; ``()``
                       when none. Both are the step's own (not borrowed), so the engine
                       starts their samples without reading the launch tensors back
    batch              LaunchBatch (see ``scheduler.batch``)
    rows               decode step: the ``RunningRows`` of ``seqs`` (slots, their owners
                       when the step was built, ...) for ``update()``; None otherwise
    unbinds            ``StateManager.num_unbinds`` when the step was built: if it is
                       unchanged at ``update()``, no row's slot changed hands (else the
                       rows whose sequence ended or was preempted take the per-sequence
                       path)
    filled / may_end   decode step: the rows whose block the step's token fills (None:
                       found from the lengths in ``update()``), and whether a row may
                       reach its length limit with it
    step               the ``schedule()`` count when it was built: ``update()`` takes
                       steps in order, each once
    scores             prompt step: the rows scored for ``score_prompt`` sequences, their
                       target tokens and owners (``scheduler.prompt_scores``); else None
    """

    is_prompt: bool
    seqs: list[Sequence]
    sample_seqs: list[Sequence]
    num_batched_tokens: int
    num_samples: int
    clone_blocks: torch.Tensor
    zero_states: torch.Tensor
    clone_states: torch.Tensor
    batch: LaunchBatch
    admitted: tuple[Sequence, ...] = ()
    forked: tuple[Sequence, ...] = ()
    # Bookkeeping for update().
    rows: RunningRows | None = field(default=None, repr=False)
    unbinds: int = field(default=0, repr=False)
    filled: list[int] | None = field(default=None, repr=False)
    may_end: bool = field(default=True, repr=False)
    step: int = field(default=0, repr=False)
    scores: ScoreRows | None = field(default=None, repr=False)

    @classmethod
    def build(cls, is_prompt: bool, seqs: list[Sequence], sample_seqs: list[Sequence],
              batch: LaunchBatch, *, clone_blocks: list[int], zero_states: list[int],
              clone_states: list[int], admitted: list[Sequence], forked: list[Sequence],
              rows: RunningRows | None, unbinds: int, step: int,
              filled: list[int] | None = None, may_end: bool = True,
              scores: ScoreRows | None = None) -> SchedulerOutputs:
        """Outputs over ``batch``; ``clone_blocks`` / ``clone_states`` are flat
        ``src, dst, ...`` lists, turned into int64 ``[N, 2]`` tensors; ``admitted`` /
        ``forked`` are copied into tuples (most steps have none: ``()``, no allocation)."""
        return cls(
            is_prompt=is_prompt, seqs=seqs, sample_seqs=sample_seqs,
            num_batched_tokens=batch.num_tokens, num_samples=len(sample_seqs),
            clone_blocks=_pairs(clone_blocks),
            zero_states=(torch.tensor(zero_states, dtype=torch.int64) if zero_states
                         else _EMPTY),
            clone_states=_pairs(clone_states),
            batch=batch, admitted=tuple(admitted), forked=tuple(forked),
            rows=rows, unbinds=unbinds, step=step, filled=filled, may_end=may_end,
            scores=scores,
        )

    @property
    def seq_ids(self) -> list[int]:
        """Ids of ``seqs``, batch order (derived on access: the hot path never needs it)."""
        return [s.seq_id for s in self.seqs]


def _pairs(flat: list[int]) -> torch.Tensor:
    """int64 [len(flat) // 2, 2] from a flat ``src, dst, ...`` list."""
    if not flat:
        return _EMPTY_PAIRS
    return torch.tensor(flat, dtype=torch.int64).view(-1, 2)
