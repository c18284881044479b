"""Host-side state of the requests an engine is running: per sample, the tokens so far,
the incremental detokenizer (text, stop strings), the seeded generator and the logprobs.

``SequenceExport`` is what moves with a sequence when a PROMPT engine hands it to a
COMPLETION engine: everything needed to rebuild this host state on the other side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.sampling_params import SamplingParams


@dataclass
class SampleState:
    """Host-side state of one output sequence (one of a request's ``n`` samples)."""

    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestState:
    """One request: its prompt, sampling parameters, stop ids (EOS included unless
    ``ignore_eos``) and the state of each sample started so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    samples: dict[int, SampleState] = field(default_factory=dict)
    num_finished: int = 0

    def sample_state(self, sample_index: int, tokenizer: Any,
                     device: torch.device) -> SampleState:
        """The state of sample ``sample_index``, created on first use."""
        st = self.samples.get(sample_index)
        if st is None:
            p = self.params
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=device)
                # Distinct, reproducible streams for the n samples of one seed.
                gen.manual_seed((p.seed * 1_000_003 + sample_index) % (1 << 63))
            st = SampleState(
                detok=IncrementalDetokenizer(
                    tokenizer, self.prompt_token_ids,
                    skip_special_tokens=p.skip_special_tokens, stop=p.stop_list(),
                ),
                generator=gen,
                logprobs=[] if p.logprobs is not None else None,
            )
            self.samples[sample_index] = st
        return st


@dataclass
class SequenceExport:
    """A prefilled sequence leaving its engine (n = 1 only): what the receiving engine
    needs besides the KV blocks and state rows (``ModelRunner.export_kv``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int]
    generator_state: torch.Tensor | None
    logprobs: list[dict[int, float]] | None
    num_blocks: int
