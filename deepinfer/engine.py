"""The engine loop: requests in, finished ``RequestOutput``s out, one step at a time.

``LLMEngine.step()`` is one scheduler step: ``schedule()`` -> ``ModelRunner.execute()`` ->
``Scheduler.update()`` -> detokenize, stop strings, logprobs. ``LLM`` (llm.py) and the
``deepinfer-generate`` script both drive it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType

import torch

from deepinfer.config import ModelConfig
from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.engine_args import EngineArgs
from deepinfer.loader import load_model, resolve_model_path
from deepinfer.model_runner import ModelRunner, StepSampling, kv_block_bytes
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer
from scheduler import EngineType, Scheduler, SchedulerConfig


@dataclass
class _SampleState:
    """Host-side state of one output sequence (one of a request's ``n`` samples)."""

    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    samples: dict[int, _SampleState] = field(default_factory=dict)
    num_finished: int = 0


@dataclass
class EngineStats:
    """Counters for progress bars and the end-of-run summary."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prompt_time: float = 0.0
    decode_time: float = 0.0


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'auto', 'cpu' or 'cuda[:N]'")
    return dev


def _resolve_backend(name: str, device: torch.device) -> ModuleType:
    """``auto``: Triton on CUDA, the torch reference on CPU; ``triton`` on CPU interprets."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from kernels import reference

        return reference
    if name == "triton":
        import kernels

        return kernels
    raise ValueError(f"attention_backend={name!r}: expected 'auto', 'triton' or 'torch'")


class LLMEngine:
    """Tokenizer + scheduler + model runner for one rank."""

    def __init__(self, args: EngineArgs, dp_group=None) -> None:
        args.validate()
        self.args = args
        self.device = _resolve_device(args.device)
        self.backend = _resolve_backend(args.attention_backend, self.device)
        self.model_path = resolve_model_path(args.model)
        self.model, self.model_config = load_model(
            self.model_path, dtype=args.dtype, device=str(self.device)
        )
        cfg: ModelConfig = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(self.model_path)
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:
            # Sliding-window attention is not implemented: stay inside one window.
            limit = min(limit, cfg.sliding_window)
        self.max_model_len = args.max_model_len or min(limit, 8192)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's limit of {limit} "
                "positions (max_position_embeddings, or its sliding window)"
            )
        on_cuda = self.device.type == "cuda"
        max_num_seqs = args.max_num_seqs or (256 if on_cuda else 64)
        max_batched = args.max_num_batched_tokens or (8192 if on_cuda else 2048)
        num_blocks = self._num_kv_blocks(max_num_seqs, max_batched)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=args.block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=self.max_model_len,
                enable_prefix_caching=args.enable_prefix_caching,
                engine_type=EngineType[args.engine_type.upper()],
                device=str(self.device),
            ),
            dp_group=dp_group,
        )
        self.runner = ModelRunner(
            self.model, cfg, device=self.device, dtype=self.dtype, backend=self.backend,
            num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len, enforce_eager=args.enforce_eager,
        )
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        self.stats = EngineStats()

    # ------------------------------------------------------------------ sizing
    def _num_kv_blocks(self, max_num_seqs: int, max_batched: int) -> int:
        block_bytes = kv_block_bytes(self.model_config, self.args.block_size, self.dtype)
        # Never more than every sequence at full length could use.
        useful = max_num_seqs * -(-self.max_model_len // self.args.block_size) + 1
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget(max_batched)
        else:
            budget = self.args.kv_cache_memory
        num_blocks = min(useful, budget // block_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
                f"{block_bytes} bytes: raise kv_cache_memory / gpu_memory_utilization"
            )
        return int(num_blocks)

    def _profile_cuda_budget(self, max_batched: int) -> int:
        """Bytes left for the KV cache after a forward at the largest prompt batch."""
        from deepinfer.attention import AttentionMetadata
        from deepinfer.model_runner import kv_cache_shape

        bs = self.args.block_size
        n_blocks = -(-max_batched // bs)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        cache = torch.zeros(kv_cache_shape(self.model_config, n_blocks, bs),
                            dtype=self.dtype, device=self.device)
        meta = AttentionMetadata(
            is_prompt=True,
            slot_mapping=torch.arange(max_batched, device=self.device),
            block_tables=torch.arange(n_blocks, dtype=torch.int32,
                                      device=self.device)[None],
            seq_lens=torch.tensor([max_batched], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, max_batched], dtype=torch.int32,
                                         device=self.device),
            max_query_len=max_batched, max_seq_len=max_batched,
        )
        ids = torch.zeros(max_batched, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(max_batched, device=self.device), cache,
                                meta, self.backend)
            self.model.compute_logits(hidden[-min(max_batched, 256):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache.numel() * cache.element_size()
        del cache, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free - torch.cuda.memory_allocated(self.device)
        return int(total * self.args.gpu_memory_utilization - peak - used_elsewhere)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | None,
                    prompt_token_ids: list[int] | None, params: SamplingParams) -> None:
        """Queue one request; raises ``ValueError`` naming it if it can never run."""
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError(f"request {request_id!r}: needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
            )
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        self.scheduler.add_request(
            request_id, list(prompt_token_ids), params.max_tokens, n=params.n,
            stop_token_ids=sorted(stop_ids), min_tokens=params.min_tokens,
        )
        self.requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), params, frozenset(stop_ids)
        )
        self.stats.num_requests += 1

    def abort(self, request_id: str) -> bool:
        """Drop a request and free what it holds; False if unknown or already finished."""
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    def _sample_state(self, req: _RequestState, sample_index: int) -> _SampleState:
        st = req.samples.get(sample_index)
        if st is None:
            p = req.params
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=self.device)
                # Distinct, reproducible streams for the n samples of one seed.
                gen.manual_seed((p.seed * 1_000_003 + sample_index) % (1 << 63))
            st = _SampleState(
                detok=IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids,
                    skip_special_tokens=p.skip_special_tokens, stop=p.stop_list(),
                ),
                generator=gen,
                logprobs=[] if p.logprobs is not None else None,
            )
            req.samples[sample_index] = st
        return st

    def _step_sampling(self, out) -> StepSampling:
        sampling = StepSampling([], [], [])
        params, gens, banned = sampling.params, sampling.generators, sampling.banned_token_ids
        if out.zero_states.numel():
            self._record_new_sequences(out, sampling)
        for seq in out.sample_seqs:
            req = self.requests[seq.request_id]
            st = self._sample_state(req, seq.sample_index)
            params.append(req.params)
            gens.append(st.generator)
            early = len(seq.output_token_ids) < req.params.min_tokens
            banned.append(tuple(req.stop_token_ids) if early else ())
        return sampling

    @staticmethod
    def _record_new_sequences(out, sampling: StepSampling) -> None:
        """Penalty state of sequences whose slot is zeroed this step (new or recomputed)."""
        fresh = set(out.zero_states.tolist())
        p_tok: list[int] = []
        p_slot: list[int] = []
        o_tok: list[int] = []
        o_slot: list[int] = []
        for seq, slot in zip(out.seqs, out.batch.state_slots.tolist()):
            if slot not in fresh:
                continue
            fresh.discard(slot)  # a chunked prompt is recorded at its first chunk only
            p_tok += seq.prompt_token_ids
            p_slot += [slot] * len(seq.prompt_token_ids)
            o_tok += seq.output_token_ids
            o_slot += [slot] * len(seq.output_token_ids)
        sampling.prompt_tokens = torch.tensor(p_tok, dtype=torch.int64)
        sampling.prompt_slots = torch.tensor(p_slot, dtype=torch.int64)
        sampling.output_tokens = torch.tensor(o_tok, dtype=torch.int64)
        sampling.output_slots = torch.tensor(o_slot, dtype=torch.int64)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        sampling = self._step_sampling(out)
        token_ids, logprobs = self.runner.execute(out, sampling)
        sample_seqs = list(out.sample_seqs)
        finished_seqs = self.scheduler.update(out, token_ids)
        dt = time.perf_counter() - t0
        self.stats.steps += 1
        if out.is_prompt:
            self.stats.prompt_tokens += out.num_batched_tokens
            self.stats.prompt_time += dt
        else:
            self.stats.decode_time += dt
        self.stats.generated_tokens += len(token_ids)

        done: list[RequestOutput] = []
        for i, (seq, tok) in enumerate(zip(sample_seqs, token_ids)):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            st = req.samples[seq.sample_index]
            st.token_ids.append(tok)
            if st.logprobs is not None and logprobs is not None:
                st.logprobs.append(logprobs[i])
            if tok in req.stop_token_ids and seq.finish_reason == "stop":
                continue  # the stop token itself is not part of the text
            st.detok.add(tok)
            if st.detok.stopped and seq.finish_reason is None:
                self.scheduler.finish_sequence(seq.seq_id, "stop")
                finished_seqs.append(seq)
        for seq in finished_seqs:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            st = self._sample_state(req, seq.sample_index)
            if st.finish_reason is None:
                st.finish_reason = seq.finish_reason or "stop"
                req.num_finished += 1
            if req.num_finished == req.params.n:
                done.append(self._request_output(req))
                del self.requests[req.request_id]
        return done

    def _request_output(self, req: _RequestState) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=i, text=st.detok.text, token_ids=list(st.token_ids),
                finish_reason=st.finish_reason, logprobs=st.logprobs,
            )
            for i, st in sorted(req.samples.items())
        ]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids, outputs=outs, finished=True,
        )
