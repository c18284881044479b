"""Runs one scheduled step on the device: cache/state copies, forward, sampling. Also owns
the device memory of the step: it sizes the KV cache (a profiling forward on CUDA), holds
the per-slot sampler state, and moves KV blocks and state rows in and out as bytes
(disaggregated prefill/decode hands sequences over with them).

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

from deepinfer.config import ModelConfig
from deepinfer.cuda_graph import DecodeGraphRunner
from deepinfer.models.attention import AttentionMetadata
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


@dataclass
class KVCacheSpec:
    """How to size the KV cache: on CPU ``kv_cache_memory`` bytes; on CUDA what is left of
    ``gpu_memory_utilization`` of the device after a profiling forward at
    ``max_num_batched_tokens``. Never more blocks than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens could use."""

    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_memory: int
    gpu_memory_utilization: float


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the KV cache, the per-slot sampler state and the model on one device.

    ``num_blocks``: the KV cache size in blocks; None sizes it from ``spec``
    (``plan_num_blocks``). ``capture_graphs``: CUDA graphs for decode steps (CUDA only;
    a prefill-only engine never decodes and passes False).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        backend: ModuleType,
        spec: KVCacheSpec,
        num_blocks: int | None = None,
        capture_graphs: bool = False,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.block_size = spec.block_size
        if num_blocks is None:
            num_blocks = self.plan_num_blocks(spec)
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(
            kv_cache_shape(cfg, num_blocks, spec.block_size), dtype=dtype, device=device
        )
        self.sampler = Sampler()
        self.states = Sampler.make_state(spec.max_num_seqs, cfg.vocab_size, device)
        self.graphs: DecodeGraphRunner | None = None
        if device.type == "cuda" and capture_graphs:
            self.graphs = DecodeGraphRunner(
                self._forward, device, max_num_seqs=spec.max_num_seqs,
                max_blocks_per_seq=-(-spec.max_model_len // spec.block_size),
                block_size=spec.block_size, max_seq_len=spec.max_model_len,
            )
            self.graphs.capture()

    # ------------------------------------------------------------------ sizing
    def plan_num_blocks(self, spec: KVCacheSpec) -> int:
        """KV blocks that fit the budget of ``spec`` (see ``KVCacheSpec``). Raises
        ``ValueError`` naming the options to raise when fewer than 2 fit."""
        block_bytes = kv_block_bytes(self.cfg, spec.block_size, self.dtype)
        useful = spec.max_num_seqs * -(-spec.max_model_len // spec.block_size) + 1
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget(spec)
        else:
            budget = spec.kv_cache_memory
        num_blocks = min(useful, budget // block_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
                f"{block_bytes} bytes: raise kv_cache_memory / gpu_memory_utilization"
            )
        return int(num_blocks)

    def _profile_cuda_budget(self, spec: KVCacheSpec) -> int:
        """Bytes left for the KV cache after a forward at the largest prompt batch."""
        dev = self.device
        tokens, bs = spec.max_num_batched_tokens, spec.block_size
        n_blocks = -(-tokens // bs)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        cache = torch.zeros(kv_cache_shape(self.cfg, n_blocks, bs), dtype=self.dtype,
                            device=dev)
        meta = AttentionMetadata(
            is_prompt=True,
            slot_mapping=torch.arange(tokens, device=dev),
            block_tables=torch.arange(n_blocks, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
            max_query_len=tokens, max_seq_len=tokens,
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(tokens, device=dev), cache, meta,
                                self.backend)
            self.model.compute_logits(hidden[-min(tokens, 256):])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - cache.numel() * cache.element_size()
        del cache, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        used_elsewhere = total - free - torch.cuda.memory_allocated(dev)
        return int(total * spec.gpu_memory_utilization - peak - used_elsewhere)

    # ------------------------------------------------------------------ KV hand-off
    def transfer_bytes(self, num_blocks: int, num_seqs: int) -> int:
        """Size of an ``export_kv`` payload of ``num_blocks`` blocks and ``num_seqs``
        state rows."""
        kv = self.kv_cache
        block = kv[:, :, 0].numel() * kv.element_size()
        row = sum(t[0].numel() * t.element_size() for t in self.states)
        return num_blocks * block + num_seqs * row

    def export_kv(self, blocks: list[int], slots: list[int]) -> torch.Tensor:
        """Flat uint8 payload on the device: ``kv_cache[:, :, blocks]`` ([L, 2, nb, bs,
        Hkv, D]) then, per state tensor, its rows ``[slots]``. Bytes, not typed tensors,
        so that one send carries everything whatever the dtypes (gloo/NCCL need no
        bf16/bool support)."""
        dev = self.kv_cache.device
        bidx = torch.tensor(blocks, dtype=torch.int64, device=dev)
        parts = [self.kv_cache.index_select(2, bidx).reshape(-1).view(torch.uint8)]
        sidx = torch.tensor(slots, dtype=torch.int64, device=dev)
        for t in self.states:
            parts.append(t.index_select(0, sidx).reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    def import_kv(self, payload: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        """Scatter an ``export_kv`` payload (uint8 ``[transfer_bytes(...)]``) into
        ``blocks`` and state ``slots`` of this runner."""
        kv = self.kv_cache
        dev = kv.device
        shape = list(kv.shape)
        shape[2] = len(blocks)
        nkv = kv[:, :, 0].numel() * kv.element_size() * len(blocks)
        # KV bytes come first, so the typed views below stay aligned.
        src = payload[:nkv].view(kv.dtype).view(shape)
        kv.index_copy_(2, torch.tensor(blocks, dtype=torch.int64, device=dev), src)
        sidx = torch.tensor(slots, dtype=torch.int64, device=dev)
        off = nkv
        for t in self.states:
            n = len(slots) * t[0].numel() * t.element_size()
            rows = payload[off:off + n].view(t.dtype).view(len(slots), *t.shape[1:])
            t.index_copy_(0, sidx, rows)
            off += n

    # ------------------------------------------------------------------ one step
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
