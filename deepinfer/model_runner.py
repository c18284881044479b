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

from collections.abc import Callable

import numpy as np
import torch

from deepinfer.config import ModelConfig
from deepinfer.cuda_graph import DecodeGraphRunner
from deepinfer.host_copy import to_device
from deepinfer.kv_cache_spec import KVCacheSpec, kv_block_bytes, new_kv_cache
from deepinfer.kv_handoff import export_kv, handoff_bytes, import_kv
from deepinfer.models.attention import AttentionMetadata
from deepinfer.models.backend import KernelBackend
from deepinfer.models.tensor_parallel import SINGLE, TPGroup
from deepinfer.prompt_scoring import score_rows
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampled_tokens import SampledTokens
from deepinfer.sampling.sampler import Sampler, SamplingTensors
from deepinfer.sampling.steering import SteeringTable
from deepinfer.sampling.step_sampling import StepSampling
from deepinfer.sampling.table import NO_SEED, SamplingTable
from deepinfer.step_channel import FollowerStep, StepChannel
from deepinfer.structured.bitmask import BitmaskStaging, TokenMask, apply_token_mask
from deepinfer_kernels import cpu_backend


class ModelRunner:
    """Owns the KV cache, the per-slot sampler state and the model on one device.

    ``num_blocks``: the KV cache size in blocks; None sizes it from ``spec``
    (``plan_num_blocks``). ``capture_graphs``: CUDA graphs for decode steps (CUDA only;
    a prefill-only engine never decodes and passes False).

    Tensor parallelism: ``tp`` is this rank's group and ``channel`` the step broadcast.
    The leader (TP rank 0) samples and sends each step to the others through
    ``channel``; a follower runs the steps it receives (``follow``) on its shard and
    holds no sampler state. Every rank sizes its cache the same way and the group takes
    the smallest block count, so block ids mean the same on every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        backend: KernelBackend,
        spec: KVCacheSpec,
        num_blocks: int | None = None,
        capture_graphs: bool = False,
        tp: TPGroup = SINGLE,
        channel: StepChannel | None = None,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.tp = tp
        self.channel = channel
        self._broken = False
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.block_size = spec.block_size
        # Per-slot state first: KV sizing must see it as memory already taken.
        # The Triton draw on a GPU; on a CPU the C one whatever the model's backend (the
        # Triton interpreter is 50x slower than torch, torch's top-p 20-90x slower than C).
        self.sampler = Sampler(backend if device.type == "cuda" else cpu_backend,
                               None if seed is None
                               else torch.Generator(device).manual_seed(seed % (1 << 63)))
        # A follower never samples: one row keeps the shapes valid.
        self.states = Sampler.make_state(spec.max_num_seqs if tp.leader else 1,
                                         cfg.vocab_size, device)
        self.sampling_table = SamplingTable(spec.max_num_seqs, cfg.vocab_size)
        self.steering = SteeringTable(spec.max_num_seqs if tp.leader else 1, device)
        #: The engine's ``deepinfer.lora.manager.LoRAManager`` (``enable_lora``), else None.
        self.lora = None
        self._cached_sampling: tuple[np.ndarray, tuple[int, int], SamplingTensors] | None = None
        # Each slot's latest sampled id, on the device: a decode input whose token was
        # still in flight when the step was scheduled (a placeholder) is read from here.
        # Written only while ``overlap`` is on (the engine's loop keeps a step in flight):
        # without it no input is ever a placeholder.
        self.last_sampled = torch.zeros(spec.max_num_seqs, dtype=torch.int64, device=device)
        self.overlap = False
        self._copy_stream = None
        self._host_ids: list[torch.Tensor] = []
        if device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device)
            # Two: step k's ids are read on the host while step k+1's are copied.
            self._host_ids = [torch.empty(spec.max_num_seqs, dtype=torch.int64,
                                          pin_memory=True) for _ in range(2)]
        self._host_index = 0
        self._mask_staging = BitmaskStaging()  # used on CUDA only
        self._captures_graphs = device.type == "cuda" and capture_graphs
        error: Exception | None = None
        if num_blocks is None:
            try:
                num_blocks = self.plan_num_blocks(spec)
            except (ValueError, torch.cuda.OutOfMemoryError) as e:
                # Every TP rank takes part in the agreement below, or the others hang.
                error, num_blocks = e, 0
        self.num_blocks = tp.min_int(num_blocks)
        if error is not None:
            raise error
        if self.num_blocks < 2:
            raise ValueError("another tensor-parallel rank has no room for a KV cache: "
                             "raise kv_cache_memory / gpu_memory_utilization")
        # Not zeroed: every kernel reads only slots written this run (unwritten ones are
        # masked out, tested with NaN-poisoned caches), and zeroing a GiB costs ~0.5 s.
        self.kv_cache = new_kv_cache(cfg, self.num_blocks, spec, dtype, device, tp)
        self.graphs: DecodeGraphRunner | None = None
        if self._captures_graphs:
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
        block_bytes = kv_block_bytes(self.cfg, spec.block_size, self.dtype, self.tp,
                                     spec.kv_cache_dtype)
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
        """Bytes left for the KV cache: ``gpu_memory_utilization`` of the device minus
        what is already allocated (weights, per-slot state), the peak of a forward at the
        largest prompt batch followed by a sampling pass over ``max_num_seqs`` rows with
        every sampling feature on (sort, softmax, cumsum, penalties, logprobs), and an
        allowance for the decode CUDA graphs' memory pool."""
        dev = self.device
        tokens, bs = spec.max_num_batched_tokens, spec.block_size
        n_blocks = -(-tokens // bs)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        cache = new_kv_cache(self.cfg, n_blocks, spec, self.dtype, dev, self.tp).zero_()
        meta = AttentionMetadata(
            is_prompt=True,
            slot_mapping=torch.arange(tokens, device=dev),
            block_tables=torch.arange(n_blocks, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
            max_query_len=tokens, max_seq_len=tokens,
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        rows = spec.max_num_seqs
        with torch.inference_mode():
            # Positions wrap at max_model_len: the torch backend indexes the RoPE table
            # with them (a device-side assert past its end), and the batch budget may
            # exceed the model's length.
            positions = torch.arange(tokens, device=dev) % spec.max_model_len
            hidden = self.model(ids, positions, cache, meta, self.backend)
            picked = torch.arange(rows, device=dev) % tokens
            logits = self.model.compute_logits(hidden[picked])
            del hidden
            if logits is not None:  # None on a TP follower, which does not sample
                every = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05,
                                       repetition_penalty=1.1, presence_penalty=0.1,
                                       logprobs=5)
                st = SamplingTensors.from_params([every] * rows, self.cfg.vocab_size, dev)
                self.sampler.sample(logits, st, torch.arange(rows, device=dev), self.states)
            del logits
        torch.cuda.synchronize(dev)
        cache_bytes = cache.numel() * cache.element_size()
        peak = torch.cuda.max_memory_allocated(dev) - base - cache_bytes
        del cache
        torch.cuda.empty_cache()
        # Decode graphs run at most max_num_seqs tokens: their pool holds about that
        # share of the prompt forward's activations, plus cuBLAS workspaces.
        graph_pool = (peak * min(1.0, rows / tokens) + (64 << 20)
                      if self._captures_graphs else 0)
        free, total = torch.cuda.mem_get_info(dev)
        used = total - free  # weights, per-slot state, other processes, the CUDA context
        return int(total * spec.gpu_memory_utilization - used - peak - graph_pool)

    # ------------------------------------------------------------------ KV hand-off
    def transfer_bytes(self, num_blocks: int, num_seqs: int) -> int:
        """Size of an ``export_kv`` payload (``deepinfer.kv_handoff.handoff_bytes``)."""
        return handoff_bytes(self.kv_cache, self.states, num_blocks, num_seqs)

    def export_kv(self, blocks: list[int], slots: list[int]) -> torch.Tensor:
        """KV ``blocks`` and state rows ``slots`` as one flat uint8 payload on the device
        (``deepinfer.kv_handoff.export_kv``)."""
        return export_kv(self.kv_cache, self.states, blocks, slots)

    def import_kv(self, payload: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        """Scatter an ``export_kv`` payload into ``blocks`` and state ``slots``."""
        import_kv(self.kv_cache, self.states, payload, blocks, slots)

    # ------------------------------------------------------------------ one step
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_cache, meta, self.backend)

    def execute(self, out, sampling: StepSampling | None = None
                ) -> tuple[list[int], list | None]:
        """Run one step and wait for it; returns the sampled token ids (one per sample)
        and logprobs. ``launch(...).result()``."""
        return self.launch(out, sampling).result()

    def launch(self, out, sampling: StepSampling | None = None,
               logits_mask: Callable[[], TokenMask | None] | None = None,
               score_k: int = 0, pool_rows: list[int] | None = None) -> SampledTokens:
        """Enqueue one step (see ``_launch``). A TP leader whose step failed part-way
        (its followers are left inside that step's collectives) refuses any further
        step: the group is out of step for good."""
        if self.channel is None:
            return self._launch(out, sampling, logits_mask, score_k, pool_rows)
        if self._broken:
            raise RuntimeError("a step failed part-way on this tensor-parallel leader: its "
                               "ranks are out of step; build a new engine")
        try:
            return self._launch(out, sampling, logits_mask, score_k, pool_rows)
        except BaseException:
            self._broken = True
            raise

    @torch.inference_mode()
    def _launch(self, out, sampling: StepSampling | None = None,
                logits_mask: Callable[[], TokenMask | None] | None = None,
                score_k: int = 0, pool_rows: list[int] | None = None) -> SampledTokens:
        """Enqueue one step: copies, forward, sampling. Returns the sampled ids' handle
        without waiting for the device (logprobs, when asked for, come with the ids; a
        prompt step's scored rows, ``prompt_scores``, with their top ``score_k``, are
        read at once; so are the hidden rows of the samples at ``pool_rows``, sample
        order indices, as ``pooled``: the embedding requests').

        ``logits_mask`` (structured output): the sampling is deferred (the handle's
        ``finish_sampling()`` or ``result()`` enqueues it); it calls ``logits_mask()``
        then and applies the ``TokenMask`` it returns to those rows' logits on the
        device, so the host fills the mask while the device runs the forward.

        ``out`` is the scheduler's ``SchedulerOutputs`` of this step (borrowed: consumed
        before the next ``schedule()``). Its decode inputs may hold placeholders (-1)
        for tokens of the step launched before this one: they are read from
        ``last_sampled`` on the device.
        """
        b = out.batch
        ids_in_flight = self._has_placeholders(out.is_prompt, b)
        if self.channel is not None and (b.num_tokens or out.clone_blocks.numel()):
            self.channel.send_step(out, ids_in_flight)
        if out.clone_blocks.numel():
            self.backend.clone_blocks(self.kv_cache, self._to_device(out.clone_blocks))
        if out.zero_states.numel():
            self.backend.zero_states(self.states, self._to_device(out.zero_states))
        # Recorded before clone_states so that forked children inherit the parent's state.
        sampling = sampling or StepSampling()
        if sampling.prompt_tokens is not None and sampling.prompt_tokens.numel():
            Sampler.record_prompt_tokens(self.states, self._to_device(sampling.prompt_tokens),
                                         self._to_device(sampling.prompt_slots))
        if sampling.output_tokens is not None and sampling.output_tokens.numel():
            Sampler.record_output_tokens(self.states, self._to_device(sampling.output_tokens),
                                         self._to_device(sampling.output_slots))
        if out.clone_states.numel():
            self.backend.clone_states(self.states, self._to_device(out.clone_states))
        if out.num_samples == 0 and b.num_tokens == 0:
            return SampledTokens(None, None)

        ids = None
        if ids_in_flight:
            # Tokens of the step launched before this one, still in flight on the host.
            dev_ids = self._to_device(b.input_ids)
            ids = torch.where(dev_ids < 0, self.last_sampled[self._to_device(b.state_slots)],
                              dev_ids)
            if self.channel is not None:
                self.channel.send_ids(ids)
        hidden = self._run_model(out.is_prompt, b, ids)
        scores = None
        if b.score_rows.numel():
            scores = score_rows(self.model, hidden, self._to_device(b.score_rows),
                                b.score_targets, score_k, self.cfg.vocab_size)
        if out.num_samples == 0:
            b.mark_copied()  # every copy out of the scheduler's host buffers is enqueued
            return SampledTokens(None, None, prompt_scores=scores)
        if not out.is_prompt and out.num_samples == b.num_tokens:
            rows = hidden[: b.num_tokens]  # decode samples every row, in order: no gather
        else:
            rows = hidden[self._to_device(b.logits_indices)]
        # Read before the sampling is enqueued: on CUDA this waits for the forward, which
        # only steps holding an embedding request pay.
        pooled = rows[pool_rows].float().cpu() if pool_rows else None
        logits = self.model.compute_logits(rows)
        slots = self._to_device(b.sample_state_slots)
        b.mark_copied()
        st = self._sampling_tensors(b, slots)
        if logits_mask is None:
            sampled = self._sample(logits, st, slots, None)
        else:
            # The mask is filled once the matchers have seen every earlier token: with a
            # step in flight that is after the engine lands it (``finish_sampling``),
            # while the device runs this step's forward.
            sampled = SampledTokens.deferred(
                lambda: self._sample_deferred(logits, st, slots, logits_mask))
        sampled.prompt_scores = scores
        sampled.pooled = pooled
        return sampled

    def _sample_deferred(self, *args) -> SampledTokens:
        """``_sample`` called after ``_launch`` returned (deferred): in inference mode
        again, as the tensors it updates in place were made in it."""
        with torch.inference_mode():
            return self._sample(*args)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors, slots: torch.Tensor,
                logits_mask: Callable[[], TokenMask | None] | None) -> SampledTokens:
        """Enqueue the sampling of a step's logits (``[num_samples, V]``) into
        ``slots`` (int64 ``[num_samples]`` on the device) and the ids' copy to the host."""
        if logits_mask is not None:
            logits = apply_token_mask(logits, logits_mask(), self._mask_staging)
        token_ids, logprobs = self.sampler.sample(logits, st, slots, self.states, owned=True,
                                                  lazy_logprobs=True)
        if st.do_repetition or st.do_presence_frequency:
            # Counts only matter to rows with a penalty (a row's params never change, so
            # a step without one holds no row that will ever read them).
            Sampler.record_output_tokens(self.states, token_ids, slots)
        if self.overlap:
            self.last_sampled.index_copy_(0, slots, token_ids)
        if self._copy_stream is None:
            return SampledTokens(token_ids, logprobs)
        host = self._host_ids[self._host_index][: token_ids.shape[0]]
        self._host_index ^= 1
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(token_ids, non_blocking=True)
            if logprobs is not None:
                logprobs.copy_to_host()
            event = torch.cuda.Event()
            event.record(stream)
        token_ids.record_stream(stream)  # the allocator must not reuse it before the copy
        return SampledTokens(token_ids, logprobs, host, event)

    def _sampling_tensors(self, b, slots_on_device: torch.Tensor) -> SamplingTensors:
        """The sampling parameters of this step's samples (in ``slots_on_device``). A
        decode step over the same sequences as the last, none seeded or under
        ``min_tokens``, reuses its tensors: nothing about them changed."""
        slots = b.sample_state_slots.numpy()
        table = self.sampling_table
        versions = (table.version, self.steering.version)
        cached = self._cached_sampling
        if (cached is not None and cached[1] == versions
                and np.array_equal(cached[0], slots)):
            return cached[2]
        positions = b.positions.numpy()[b.logits_indices.numpy()]
        rows, steps, banned = table.gather(slots, positions)
        st = SamplingTensors.from_rows(rows, steps, self.cfg.vocab_size, self.device, banned)
        st.steering = self.steering.gather(slots, slots_on_device)
        # Seeded rows draw a new uniform and min_tokens bans end: both change each step.
        per_step = banned is not None or bool((rows.seed_key != NO_SEED).any())
        self._cached_sampling = None if per_step else (slots.copy(), versions, st)
        return st

    def _has_placeholders(self, is_prompt: bool, b) -> bool:
        """Whether a decode input is a placeholder for a token still in flight."""
        return bool(self.overlap and not is_prompt and b.num_tokens
                    and int(b.input_ids.numpy().min()) < 0)

    @torch.inference_mode()
    def follow(self, step: FollowerStep) -> None:
        """A TP follower's side of one of the leader's steps: the same copy-on-write
        copies and forward on this rank's shard, and its part of the logits gather."""
        if step.clone_blocks.numel():
            self.backend.clone_blocks(self.kv_cache, self._to_device(step.clone_blocks))
        b = step.batch
        if b.num_tokens == 0:
            return
        ids = self.channel.recv_ids(b.num_tokens, self.device) if step.ids_on_device else None
        hidden = self._run_model(step.is_prompt, b, ids)
        if b.score_rows.numel():  # the leader gathers these rows' scores first
            score_rows(self.model, hidden, self._to_device(b.score_rows), b.score_targets,
                       0, self.cfg.vocab_size)
        if b.logits_indices.numel():
            self.model.compute_logits(hidden[self._to_device(b.logits_indices)])

    @property
    def broken(self) -> bool:
        """Whether a TP leader's step failed part-way (its ranks are out of step)."""
        return self._broken

    def close(self) -> bool:
        """A TP leader tells its followers that the run is over; returns whether it did
        (not after a step that failed part-way: they are inside that step)."""
        channel, self.channel = self.channel, None
        if self.tp.size > 1:
            self.release_graphs()
        if channel is not None and self.tp.leader and not self._broken:
            channel.send_stop()
            return True
        return False

    def release_graphs(self) -> None:
        """Drop the decode CUDA graphs (later decode steps run eagerly). Under tensor
        parallelism they captured the group's NCCL all-reduce: they must be gone before
        the group is destroyed."""
        graphs, self.graphs = self.graphs, None
        if graphs is not None:
            torch.cuda.synchronize(self.device)  # no replay of them still in flight
            del graphs

    def _run_model(self, is_prompt: bool, b, ids: torch.Tensor | None) -> torch.Tensor:
        """The forward over launch batch ``b``; ``ids``: resolved input ids on the
        device (None: ``b.input_ids``)."""
        # LoRA deltas are planned per step, outside any captured graph.
        lora = self.lora is not None and self.lora.plan(b.state_slots, b.query_start_loc)
        if not is_prompt and not lora and self.graphs is not None and self.graphs.can_run(b):
            return self.graphs.run(b, ids)
        meta = AttentionMetadata(
            is_prompt=is_prompt,
            slot_mapping=self._to_device(b.slot_mapping),
            block_tables=self._to_device(b.block_tables),
            seq_lens=self._to_device(b.seq_lens),
            query_start_loc=self._to_device(b.query_start_loc),
            max_query_len=b.max_query_len,
            max_seq_len=b.max_seq_len,
        )
        if ids is None:
            ids = self._to_device(b.input_ids)
        return self._forward(ids, self._to_device(b.positions), meta)
