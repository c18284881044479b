"""The engine: requests in, finished ``RequestOutput``s out, one step at a time.

``LLMEngine.step()`` is one scheduler step: ``schedule()`` -> ``ModelRunner.launch()`` ->
wait for the sampled ids -> ``Scheduler.update()`` -> stop strings, logprobs, finished
requests. ``drain()`` steps until the work is done (``LLM``, the one-engine and DP jobs
drive it); with ``async_scheduling`` step k+1 is launched before step k's ids reach the
host (docs/scheduling.md, "Overlapped scheduling"). ``export_sequence`` /
``import_sequence`` (``engine_handoff``) move a prefilled sequence between engines (PD).
Grammars and multi-token bad words are masked on the host (``step_masks``), other
steering on device.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from deepinfer.config import ModelConfig
from deepinfer.engine_args import EngineArgs
from deepinfer.engine_handoff import SequenceHandoff
from deepinfer.lora.manager import LoRAManager
from deepinfer.lora.request import LoRARequest
from deepinfer.models.quantized import weight_bytes
from deepinfer.outputs import EmbeddingRequestOutput, RequestOutput
from deepinfer.pooling import PoolingParams, embedding_params
from deepinfer.reasoning import reasoning_end_token
from deepinfer.request_state import (
    AdmissionLimits,
    RequestState,
    SampleState,
    prompt_score_k,
    record_embeddings,
    record_prompt_scores,
    watch_sample_tokens,
)
from deepinfer.sampling.params import SamplingParams, checked_defaults
from deepinfer.sampling.sampled_tokens import SampledTokens
from deepinfer.sampling.steering import resolve_steering
from deepinfer.sampling.step_sampling import StepSampling
from deepinfer.step_masks import StepMasks
from deepinfer.structured.matchers import StructuredOutputs
from deepinfer.tokenizer import apply_chat_template, load_tokenizer
from deepinfer.worker import TensorParallel, build_worker
from deepinfer_scheduler import EngineType, Scheduler, SchedulerConfig, Sequence
from deepinfer_scheduler.registry import validate_request


@dataclass
class EngineStats:
    """Counters for progress bars and the end-of-run summary."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prompt_time: float = 0.0
    decode_time: float = 0.0


class LLMEngine(SequenceHandoff):
    """Tokenizer + scheduler + model runner for one rank. ``dp_group``: the
    ``torch.distributed`` group whose schedulers vote on each step's type (None: alone).
    ``tp``: this engine is the leader of a tensor-parallel group whose other ranks run
    ``worker.run_follower``; ``close()`` ends them."""

    def __init__(self, args: EngineArgs, dp_group=None,
                 tp: TensorParallel | None = None) -> None:
        args.validate()
        if args.tensor_parallel_size > 1 and tp is None:
            raise ValueError(
                f"tensor_parallel_size={args.tensor_parallel_size}: an LLMEngine does not "
                "start its TP ranks; use LLM(..., tensor_parallel_size=N) or "
                "deepinfer-generate --tp N")
        self.args = args
        engine_type = EngineType[args.engine_type.upper()]
        # A PROMPT engine never decodes: no decode graphs to capture.
        worker = build_worker(args, tp, capture_graphs=engine_type is not EngineType.PROMPT)
        self.device, self.backend = worker.device, worker.backend
        self.model_path, self.model = worker.model_path, worker.model
        self.model_config: ModelConfig = worker.config
        cfg = self.model_config
        self.dtype, self.max_model_len = worker.dtype, worker.max_model_len
        self.runner = worker.runner
        spec = worker.spec
        on_cuda = self.device.type == "cuda"
        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except BaseException:
            self.runner.close()  # TP followers wait for steps that will never come
            raise
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=spec.block_size,
                max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=args.enable_prefix_caching,
                engine_type=engine_type,
                device=str(self.device),
            ),
            dp_group=dp_group,
        )
        self.async_scheduling = (on_cuda if args.async_scheduling is None
                                 else args.async_scheduling)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.masks = StepMasks(self.structured, cfg.vocab_size)
        self.reasoning_end = reasoning_end_token(self.tokenizer, args.reasoning_parser)
        self.sampling_defaults = checked_defaults(
            cfg.generation_defaults if args.generation_config == "auto" else {})
        self.requests: dict[str, RequestState] = {}
        self.admission = AdmissionLimits(self.max_model_len)  # PD: also the decode side's
        # Requests finished by a step completed while no one was iterating (drain closed
        # with a step in flight): handed out by the next step() or drain().
        self._undelivered: list[RequestOutput] = []
        self._open_steps: deque = deque()  # scheduled, not yet completed (abort_all)
        self._last_done = 0.0  # when the last step completed (overlapping step times)
        # Samples whose tokens need host work each step (stop strings, logprobs).
        self._watched: dict[int, tuple[RequestState, SampleState]] = {}
        self._pooling: set[str] = set()  # live embedding requests (their ids)
        self.stats = EngineStats()
        self.lora = None if not args.enable_lora else LoRAManager(
            self.model, args.max_loras, args.max_lora_rank, spec.max_num_seqs, self.dtype,
            self.device)
        self.runner.lora = self.lora

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of this process's model weights: a GGUF file's blocks where
        kept, plus the packed copies of dense weights made so far."""
        return weight_bytes(self.model)

    @property
    def async_scheduling(self) -> bool:
        """Overlapped scheduling (``drain`` keeps a step in flight); the runner then keeps
        the sampled ids on the device that the next step's placeholders read."""
        return self.runner.overlap

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self.runner.overlap = bool(on)

    def close(self) -> bool:
        """End the run: a TP leader stops its followers (returns whether it told them)."""
        return self.runner.close()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | None,
                    prompt_token_ids: list[int] | None, params: SamplingParams, *,
                    messages: list[dict[str, str]] | None = None,
                    chat_template_kwargs: dict | None = None,
                    pooling: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue one request given as text (``prompt``), token ids, or a chat
        (``messages``, the model's chat template applied, with ``chat_template_kwargs`` as
        its variables). ``pooling``: an embedding request (``params`` unused: see
        ``embedding_params``). ``lora_request``: the LoRA adapter it runs with (the
        engine built with ``enable_lora``). Raises ``ValueError`` naming it if it is
        malformed or can never run; nothing is queued then."""
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"request {request_id!r}: lora_request must be a LoRARequest, "
                             f"got {type(lora_request).__name__}")
        if lora_request is not None and self.lora is None:
            raise ValueError(f"request {request_id!r}: lora_request "
                             f"{lora_request.lora_name!r} needs an engine built with "
                             "enable_lora=True")
        if pooling is not None:
            cfg = self.model_config
            params = embedding_params(request_id, pooling, cfg.hidden_size,
                                      self.admission.decode_model_len is not None, cfg.pooling)
        elif self.model_config.embedding_only:
            raise ValueError(f"request {request_id!r}: a base model without a language-"
                             "model head embeds (LLM.embed) but cannot generate")
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        if messages is not None:
            prompt_token_ids = apply_chat_template(self.tokenizer, messages,
                                                   chat_template_kwargs)
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError(f"request {request_id!r}: needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        not_ints = [t for t in prompt_token_ids
                    if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if not_ints:  # 7.5 would be truncated, True taken as 1
            raise ValueError(f"request {request_id!r}: token ids must be integers, got "
                             f"{not_ints[:5]}")
        prompt_token_ids = [int(t) for t in prompt_token_ids]  # numpy ints too
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
            )
        if pooling is None:
            params = params.with_defaults(self.sampling_defaults)
        params = self.admission.fit(request_id, len(prompt_token_ids), params)
        steering = resolve_steering(request_id, params, self.tokenizer, vocab)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        req = RequestState(request_id, prompt, list(prompt_token_ids), params,
                           frozenset(stop_ids), thinking=(chat_template_kwargs or {}).get(
                               "enable_thinking", True) is not False, steering=steering,
                           pooling=pooling)
        if params.structured_outputs is not None:
            # Parked until its grammar is compiled (_launch queues it), checked now as
            # _queue will: a request that can never run fails here, alone.
            validate_request(self.scheduler.config, request_id, req.prompt_token_ids,
                             params.max_tokens, n=params.n, min_tokens=params.min_tokens,
                             max_live=self.scheduler.state_manager.max_live)
        if lora_request is not None:  # last: the adapter is held from here on
            try:
                req.lora = self.lora.acquire(lora_request)
            except ValueError as e:
                raise ValueError(f"request {request_id!r}: {e}") from e
        if pooling is not None:
            self._pooling.add(request_id)
        self._watch_masks(req, stop_ids, park=True)
        if params.structured_outputs is None:
            self._queue(req)
        self.requests[request_id] = req
        self.stats.num_requests += 1

    def _watch_masks(self, req: RequestState, stop_ids, park: bool) -> None:
        """Register a request's grammar (``park``: held until compiled) and host steering."""
        so = req.params.structured_outputs
        if so is not None:
            self.structured.add(req.request_id, so, stop_ids, park=park,
                                after=self.reasoning_end if req.thinking else None)
        self.masks.watch(req.request_id, req.steering, so is not None)

    def _queue(self, req: RequestState) -> None:
        """Hand a request to the scheduler (at once, or when its grammar is compiled)."""
        p = req.params
        # max_tokens 0 (scoring only): the prompt step still samples; that token is dropped.
        self.scheduler.add_request(
            req.request_id, list(req.prompt_token_ids), max(1, p.max_tokens), n=p.n,
            stop_token_ids=sorted(req.stop_token_ids), min_tokens=p.min_tokens,
            score_prompt=p.prompt_logprobs is not None, cache_salt=req.lora)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free what it holds; False if unknown or already finished."""
        req = self.requests.pop(request_id, None)
        self._forget(req)
        return self.scheduler.abort(request_id) or req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.structured.has_parked()

    def abort_all(self) -> None:
        """After a failed or interrupted step loop: abort every request, drop undelivered
        outputs, and apply steps never completed with placeholder tokens (all dropped:
        their sequences ended), so the engine takes new requests as if fresh."""
        for rid in list(self.requests):
            self.abort(rid)
        self._undelivered = []
        while self._open_steps:
            out = self._open_steps.popleft()
            self.scheduler.update(out, [0] * out.num_samples)

    # ------------------------------------------------------------------ the loop
    def drain(self, keep_going: Callable[[], bool] | None = None,
              on_step: Callable[[], None] | None = None) -> Iterator[RequestOutput]:
        """Step while ``keep_going()`` (default: this engine has unfinished work); yield
        each request as it finishes. ``on_step`` runs after every step (progress).
        A DP rank passes a ``keep_going`` that asks the whole group. With
        ``async_scheduling`` one step stays in flight while the next is scheduled."""
        keep_going = keep_going or self.has_unfinished
        overlap = self.async_scheduling
        done = self._take_undelivered()
        inflight = None
        try:
            while done:
                yield done.pop(0)
            while True:
                more = keep_going()
                if not more and inflight is None:
                    return
                if not overlap:  # the plain loop (here ``more`` holds)
                    done += self.step()
                else:
                    launched = self._launch() if more else None
                    # A step being completed is out of flight: if completing it fails,
                    # the ``finally`` below must not complete it again.
                    prev, inflight = inflight, None
                    if prev is not None:
                        done = self._complete(*prev)
                    if launched is not None:
                        # A constrained step samples only now: its masks need the
                        # matchers fed the tokens of the step just completed.
                        launched[1].finish_sampling()
                    inflight = launched
                while done:
                    yield done.pop(0)
                if on_step is not None:
                    on_step()
        finally:
            # The caller stopped iterating: land the step in flight and keep every
            # finished request not handed out yet for the next step() or drain().
            if inflight is not None:
                done += self._complete(*inflight)
            self._undelivered = done + self._undelivered

    def _start_sample(self, req: RequestState, seq: Sequence) -> SampleState:
        """A sample gets its state slot (new, forked, recomputed or imported): its host
        state, and its sampling row in the runner's table."""
        st, created = req.start_sample(seq, self.tokenizer)
        if created and st.watched:
            self._watched[seq.seq_id] = (req, st)
        self.runner.sampling_table.write(seq.slot, req.params, seq.sample_index,
                                         len(req.prompt_token_ids),
                                         tuple(req.stop_token_ids))
        self.runner.steering.write(seq.slot, req.steering)
        if self.lora is not None:
            self.lora.bind_slot(seq.slot, req.lora)
        return st

    def _forget(self, req: RequestState | None) -> None:
        """Drop the per-token watch of a request's samples (finished, aborted, sent)."""
        if req is not None and req.pooling is not None:
            self._pooling.discard(req.request_id)
        if req is not None and req.lora:
            self.lora.release(req.lora)
        if req is not None and self.masks.live:
            self.masks.forget(req.request_id)
        if req is not None and self._watched:
            for st in req.samples.values():
                self._watched.pop(st.seq.seq_id, None)

    def _step_sampling(self, out) -> StepSampling | None:
        """Start the samples that got a slot this step (admitted: new or recomputed, or
        forked); the tokens of the admitted ones for their penalty state."""
        penalised: list[Sequence] = []
        for seq in out.admitted:
            req = self.requests[seq.request_id]
            self._start_sample(req, seq)
            # Only a penalty reads the counts (a fork copies its parent's params).
            if req.params.uses_penalties:
                penalised.append(seq)
        for seq in out.forked:
            self._start_sample(self.requests[seq.request_id], seq)
        return StepSampling.of(penalised) if out.admitted else None

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and wait for it; returns the requests that finished."""
        done = self._take_undelivered()
        return done + self._complete(*self._launch())

    def _take_undelivered(self) -> list[RequestOutput]:
        done, self._undelivered = self._undelivered, []
        return done

    def _launch(self) -> tuple[object, SampledTokens, float, list[str]]:
        """Schedule a step and enqueue it on the device."""
        t0 = time.perf_counter()
        if self.structured.live:
            for rid in self.structured.take_ready(block=not self.scheduler.has_unfinished()):
                self._queue(self.requests[rid])
        out = self.scheduler.schedule()
        self._open_steps.append(out)
        sampling = self._step_sampling(out)
        mask = self.masks.logits_mask(out.sample_seqs) if self.masks.live else None
        k = 0 if out.scores is None else prompt_score_k(self.requests, out.scores)
        pool = ([i for i, s in enumerate(out.sample_seqs) if s.request_id in self._pooling]
                if self._pooling else [])
        sampled = self.runner.launch(out, sampling, mask, score_k=k, pool_rows=pool)
        return out, sampled, t0, [out.sample_seqs[i].request_id for i in pool]

    def _complete(self, out, sampled: SampledTokens, t0: float, pooled_ids: list[str]
                  ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Wait for a launched step's sampled ids and apply them; returns the requests
        that finished. ``pooled_ids``: the embedding requests whose rows it pooled."""
        token_ids, logprobs = sampled.result()
        self._open_steps.popleft()  # ``out``: steps complete in launch order
        if out.scores is not None and sampled.prompt_scores is not None:
            record_prompt_scores(self.requests, out.scores, sampled.prompt_scores)
        if pooled_ids:
            record_embeddings(self.requests, pooled_ids, sampled.pooled)
        finished_seqs = self.scheduler.update(out, token_ids)
        dropped = self.scheduler.dropped
        now = time.perf_counter()
        dt = now - max(t0, self._last_done)  # overlapped steps: count each second once
        self._last_done = now
        stats = self.stats
        stats.steps += 1
        if out.is_prompt:
            stats.prompt_tokens += out.num_batched_tokens
            stats.prompt_time += dt
        else:
            stats.decode_time += dt
        # An embedding request's one sampled token is dropped: not generated output.
        stats.generated_tokens += len(token_ids) - len(dropped) - len(pooled_ids)
        if self._watched:
            watch_sample_tokens(self._watched, out.sample_seqs, token_ids, logprobs,
                                finished_seqs, {s.seq_id for s in dropped},
                                self.scheduler.finish_sequence)
        if self.masks.live:
            finished_seqs += self.masks.after_update(out.sample_seqs,
                                                     self.scheduler.finish_sequence)

        done: list[RequestOutput] = []
        for seq in finished_seqs:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            st = req.samples[seq.sample_index]
            if st.finish_reason is None:
                st.finish_reason = seq.finish_reason or "stop"
                req.num_finished += 1
            if req.num_finished == req.params.n:
                done.append(req.output(self.tokenizer, self.args.reasoning_parser,
                                       self.masks.take_error(req.request_id)))
                del self.requests[req.request_id]
                self._forget(req)
        return done
