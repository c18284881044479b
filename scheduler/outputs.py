"""What ``Scheduler.schedule()`` returns, and scheduler counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from scheduler.batch import LaunchBatch
from scheduler.sequence import Sequence


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
    batch              LaunchBatch (see ``scheduler.batch``)
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
    # Scheduler-private bookkeeping for update().
    _slots: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    _epoch: int = field(default=0, repr=False)
    _step: int = field(default=0, repr=False)

    @property
    def seq_ids(self) -> list[int]:
        """Ids of ``seqs``, batch order (derived on access: the hot path never needs it)."""
        return [s.seq_id for s in self.seqs]
