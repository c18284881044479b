"""Runs one scheduled step on the device: cache/state copies, forward, sampling.

The runner consumes a ``SchedulerOutputs`` exactly as the scheduler emits it: per step it
applies ``clone_blocks`` (copy-on-write of shared KV blocks), ``zero_states`` (new
sequences), records newly admitted sequences' tokens into their penalty state,
``clone_states`` (forks), then runs the model (per layer ``store_kv`` + paged prefill or
decode attention), computes logits for ``logits_indices`` only, and samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer.attention import AttentionMetadata
from deepinfer.config import ModelConfig
from deepinfer.cuda_graph import DecodeGraphRunner
from deepinfer.sampler import Sampler
from deepinfer.sampling_params import SamplingParams


@dataclass
class StepSampling:
    """Per-sample sampling inputs for one step (sample order = ``out.sample_seqs``)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    banned_token_ids: list[Sequence[int]]
    # Penalty state of sequences admitted this step (their slot was just zeroed): the
    # whole prompt (prefix-cache hits included) and, after a preemption, the outputs
    # generated before it. Host int64 tensors of equal length per pair.
    prompt_tokens: torch.Tensor | None = None
    prompt_slots: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    output_slots: torch.Tensor | None = None


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the KV cache, the per-slot sampler state and the model on one device."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        backend: ModuleType,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool = True,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype, device=device
        )
        self.sampler = Sampler()
        self.states = Sampler.make_state(max_num_seqs, cfg.vocab_size, device)
        self.graphs: DecodeGraphRunner | None = None
        if device.type == "cuda" and not enforce_eager:
            self.graphs = DecodeGraphRunner(
                self._forward, device, max_num_seqs=max_num_seqs,
                max_blocks_per_seq=-(-max_model_len // block_size),
                block_size=block_size, max_seq_len=max_model_len,
            )
            self.graphs.capture()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_cache, meta, self.backend)

    @torch.inference_mode()
    def execute(self, out, sampling: StepSampling) -> tuple[list[int], list | None]:
        """Run one step; returns the sampled token ids (one per sample) and logprobs.

        ``out`` is the scheduler's ``SchedulerOutputs`` of this step (borrowed: consumed
        before the next ``schedule()``).
        """
        b = out.batch
        if out.clone_blocks.numel():
            self.backend.clone_blocks(self.kv_cache, self._to_device(out.clone_blocks))
        if out.zero_states.numel():
            self.backend.zero_states(self.states, self._to_device(out.zero_states))
        # Recorded before clone_states so that forked children inherit the parent's state.
        if sampling.prompt_tokens is not None and sampling.prompt_tokens.numel():
            Sampler.record_prompt_tokens(self.states, self._to_device(sampling.prompt_tokens),
                                         self._to_device(sampling.prompt_slots))
        if sampling.output_tokens is not None and sampling.output_tokens.numel():
            Sampler.record_output_tokens(self.states, self._to_device(sampling.output_tokens),
                                         self._to_device(sampling.output_slots))
        if out.clone_states.numel():
            self.backend.clone_states(self.states, self._to_device(out.clone_states))
        if out.num_samples == 0 and b.num_tokens == 0:
            return [], None

        hidden = self._run_model(out)
        if out.num_samples == 0:
            return [], None
        logits = self.model.compute_logits(hidden[self._to_device(b.logits_indices)])
        slots = self._to_device(b.sample_state_slots)
        token_ids, logprobs = self.sampler.sample(
            logits, slots, self.states, sampling.params, sampling.generators,
            sampling.banned_token_ids,
        )
        Sampler.record_output_tokens(self.states, token_ids, slots)
        return token_ids.tolist(), logprobs

    def _run_model(self, out) -> torch.Tensor:
        b = out.batch
        if not out.is_prompt and self.graphs is not None and self.graphs.can_run(b):
            return self.graphs.run(b)
        meta = AttentionMetadata(
            is_prompt=out.is_prompt,
            slot_mapping=self._to_device(b.slot_mapping),
            block_tables=self._to_device(b.block_tables),
            seq_lens=self._to_device(b.seq_lens),
            query_start_loc=self._to_device(b.query_start_loc),
            max_query_len=b.max_query_len,
            max_seq_len=b.max_seq_len,
        )
        return self._forward(self._to_device(b.input_ids), self._to_device(b.positions), meta)
