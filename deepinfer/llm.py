"""``LLM``: the offline batch-generation API (vLLM-like)."""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Sequence

from deepinfer.distributed.tp import LLMFollowers, start_llm_followers
from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.progress import RunProgress
from deepinfer.loading.loader import load_config
from deepinfer.lora.request import LoRARequest
from deepinfer.models.tensor_parallel import check_tp_size
from deepinfer.outputs import EmbeddingRequestOutput, RequestOutput
from deepinfer.pooling import PoolingParams
from deepinfer.sampling.params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``LLM()`` loads the embedded default model (SmolLM2-135M-Instruct). ``model`` may be
    a local Hugging Face folder (config.json + safetensors + tokenizer) or a ``.gguf``
    file. Other keyword arguments are ``EngineArgs`` fields (``max_model_len``,
    ``max_num_seqs``, ``kv_cache_memory``, ``gpu_memory_utilization``, ``enforce_eager``...).

    ``tensor_parallel_size=N`` splits the model over N ranks: this process is rank 0 (it
    joins a ``torch.distributed`` group, so it must not be in one already) and N - 1
    spawned processes hold the other shards, one GPU each on CUDA. ``close()`` (or the
    end of a ``with`` block, or interpreter exit) stops them. ``tp_timeout_s`` bounds each
    collective of a step (the followers wait for the next step without limit).
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 attention_backend: str = "auto", tp_timeout_s: float = 120.0,
                 **kwargs) -> None:
        args = EngineArgs(model=model, dtype=dtype, device=device,
                          attention_backend=attention_backend, **kwargs)
        args.validate()
        self._followers: LLMFollowers | None = None
        self.engine: LLMEngine | None = None
        if args.tensor_parallel_size > 1:
            check_tp_size(load_config(args.model), args.tensor_parallel_size)
            args, self._followers = start_llm_followers(args, tp_timeout_s)
            atexit.register(self.close)
        try:
            self.engine = LLMEngine(args, tp=self._followers.tp if self._followers else None)
        except BaseException:
            self.close()
            raise
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def weight_bytes(self) -> int:
        """Bytes of model weights this process holds (GGUF blocks as stored where kept
        quantized; this rank's shard under tensor parallelism)."""
        return self.engine.weight_bytes

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that sets nothing samples with: the model's
        ``generation_config.json`` defaults (unless ``generation_config="none"``) over the
        built-in ones (vLLM's method of the same name)."""
        return SamplingParams().with_defaults(self.engine.sampling_defaults)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (idempotent; nothing to do without)."""
        if self._followers is None:
            return
        followers, self._followers = self._followers, None
        atexit.unregister(self.close)
        stopped = False
        try:
            if self.engine is not None:
                # Not told after a step that failed part-way: no waiting for them then.
                stopped = self.engine.close()
        except RuntimeError:
            if followers.failure() is None:  # a dead follower cannot hear "stop": fine
                raise
        finally:
            # Followers never told to stop (the engine failed to build) are killed now.
            followers.close(timeout_s=30.0 if stopped else 0.0)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in input order.

        ``sampling_params``: one for all prompts, or one per prompt. ``lora_request``
        (an ``LLM(..., enable_lora=True)``): one ``LoRARequest`` for all prompts, or one
        (or None: the base model) per prompt. Every request is validated before any work
        starts; an invalid one raises ``ValueError``.
        """
        prompts = self._prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm,
                         loras=self._loras_per_prompt(lora_request, len(prompts)))

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then ``generate``.
        ``chat_template_kwargs``: variables for the template (``{"enable_thinking":
        False}`` for Qwen3's); ``ValueError`` naming it when malformed."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # one conversation
        convs = [list(m) for m in messages]
        params = self._params_per_prompt(sampling_params, len(convs))
        return self._run(convs, params, use_tqdm, chat_template_kwargs,
                         loras=self._loras_per_prompt(lora_request, len(convs)))

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True,
              lora_request: LoRAArg = None) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (text, or a list of token ids): the final-normed hidden
        state of its last token (``deepinfer.pooling``), unit length unless
        ``PoolingParams(normalize=False)``; ``outputs.embedding`` is a list of floats
        (``dimensions`` or ``hidden_size`` of them). Outputs in input order.

        ``pooling_params``: one for all prompts, or one per prompt. Every request is
        validated before any work starts; an invalid one raises ``ValueError``. The
        prompts run as prefill steps of the engine (batched, chunked, prefix-cached)."""
        prompts = self._prompt_list(prompts)
        pooling = self._params_per_prompt(pooling_params, len(prompts), PoolingParams,
                                          "pooling_params")
        unused = [SamplingParams()] * len(prompts)
        return self._run(prompts, unused, use_tqdm, pooling=pooling,
                         loras=self._loras_per_prompt(lora_request, len(prompts)))

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        """The prompts as a list: a string or a list of token ids alone is one prompt."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            return [prompts]
        return list(prompts)

    @staticmethod
    def _params_per_prompt(sp, n: int, kind: type = SamplingParams,
                           name: str = "sampling_params") -> list:
        if sp is None:
            return [kind() for _ in range(n)]
        if isinstance(sp, kind):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"{name}: got {len(sp)} for {n} prompts; "
                             f"pass one {kind.__name__} or one per prompt")
        bad = [type(p).__name__ for p in sp if not isinstance(p, kind)]
        if bad:
            raise ValueError(f"{name}: expected {kind.__name__} objects, got {bad[0]}")
        return sp

    @staticmethod
    def _loras_per_prompt(lora: LoRAArg, n: int) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * n
        if isinstance(lora, (str, bytes)) or not isinstance(lora, Sequence):
            raise ValueError("lora_request: expected a LoRARequest, None, or one of them "
                             f"per prompt, got {type(lora).__name__}")
        loras = list(lora)
        if len(loras) != n:
            raise ValueError(f"lora_request: got {len(loras)} for {n} prompts; pass one "
                             "LoRARequest or one (or None) per prompt")
        return loras

    def _run(self, prompts: list[Prompt] | list[Messages], params: list[SamplingParams],
             use_tqdm: bool, template_kwargs: dict | None = None,
             pooling: list[PoolingParams] | None = None,
             loras: list[LoRARequest | None] | None = None) -> list:
        engine = self.engine
        ids = [f"{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        pools = pooling or [None] * len(prompts)
        loras = loras or [None] * len(prompts)
        try:
            for rid, prompt, sp, pool, lora in zip(ids, prompts, params, pools, loras):
                if isinstance(prompt, str):
                    engine.add_request(rid, prompt, None, sp, pooling=pool, lora_request=lora)
                elif prompt and isinstance(prompt[0], dict):  # a conversation (chat)
                    engine.add_request(rid, None, None, sp, messages=prompt,
                                       chat_template_kwargs=template_kwargs,
                                       lora_request=lora)
                elif isinstance(prompt, (list, tuple)):
                    engine.add_request(rid, None, list(prompt), sp, pooling=pool,
                                       lora_request=lora)
                else:
                    raise ValueError("expected a string or a list of token ids, got "
                                     f"{type(prompt).__name__}")
                added.append(rid)
        except BaseException as e:
            for rid in added:  # all-or-nothing: nothing runs if one request is invalid
                engine.abort(rid)
            if isinstance(e, ValueError):
                raise ValueError(f"prompt {len(added)}: {e}") from e
            raise

        results: dict[str, RequestOutput] = {}
        bar = RunProgress(len(ids), disable=not use_tqdm)
        stats = engine.stats
        p0, g0 = stats.prompt_tokens, stats.generated_tokens

        def progress() -> None:
            bar.update(len(results), stats.prompt_tokens - p0, stats.generated_tokens - g0)

        try:
            for out in engine.drain(on_step=progress):
                results[out.request_id] = out
        except BaseException as e:
            # A collective with a dead TP rank fails with gloo's or NCCL's words: name it.
            failure = self._followers.failure() if self._followers else None
            if failure is not None and isinstance(e, RuntimeError):
                raise RuntimeError(f"{failure}; this LLM cannot go on: close it and "
                                   "create a new one") from e
            if not engine.runner.broken:
                # Ctrl-C or a failed step: nothing of this call is left to run first in
                # the next one. (A TP leader whose step failed part-way refuses further
                # steps: there the LLM must be closed.)
                engine.abort_all()
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]
