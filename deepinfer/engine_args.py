"""Engine options shared by ``LLM``, the jobs and the ``deepinfer-generate`` command line.

Each field declares its command-line help in its metadata; ``deepinfer.cli`` builds the
flags from these declarations (``--max-model-len`` from ``max_model_len``), so a new
option appears on the command line without being declared twice. ``cli=False`` keeps a
field off the command line (a mode sets it itself: the engine type under ``--pd``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: ``quantization``: keep a GGUF file's block weights where a kernel exists, or dequantize.
QUANTIZATION_CHOICES = ("auto", "none")

#: ``kv_cache_dtype``: the model's dtype, or int8 codes with a scale per 32 values.
KV_CACHE_DTYPE_CHOICES = ("auto", "int8")

#: ``generation_config``: take a checkpoint's sampling defaults, or ignore them.
GENERATION_CONFIG_CHOICES = ("auto", "none")

#: Values of ``EngineArgs.reasoning_parser`` (``deepinfer.reasoning``).
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def option(default: Any, help: str, *, type: Any = None, choices: tuple | None = None,
           flag: str | None = None, aliases: tuple[str, ...] = (), cli: bool = True) -> Any:
    """A dataclass field with its command-line declaration in the metadata. ``type``: the
    argparse type of an optional value (None: the default's type; bools become
    ``--flag/--no-flag``). ``flag``: the flag when not the field name's."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices,
                                            "flag": flag, "aliases": aliases, "cli": cli})


@dataclass
class EngineArgs:
    """What to load and how to run it.

    ``model=None`` is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF).
    ``kv_cache_memory`` (bytes) sizes the KV cache on CPU; on CUDA it is sized from free
    memory after a profiling forward, up to ``gpu_memory_utilization`` of the device.
    """

    model: str | None = option(
        None, "HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)", type=str)
    dtype: str = option("auto", "weights and activations: auto, float32, float16 or "
                        "bfloat16 (auto: the checkpoint's on CUDA, bf16 for GGUF; on CPU "
                        "bf16 for GGUF/bf16 checkpoints where the CPU has native bf16, "
                        "bf16 for GGUF kept quantized where it has AVX2, else float32)")
    quantization: str = option(
        "auto", "GGUF weights: auto keeps them as stored (4-8 bits) where the device has a "
        "kernel for the type (CPU: every type), dequantizing the others with a warning; "
        "none dequantizes every tensor at load", choices=QUANTIZATION_CHOICES)
    prepack_weights: bool | None = option(
        None, "CPU, dense bf16 weights: a oneDNN-packed copy of each, made on first use, "
        "for products of 8 rows or more (default: where the copies fit in a quarter of "
        "the available memory)", type=bool)
    reasoning_parser: str | None = option(
        None, "split a thinking model's <think>...</think> from its answer: qwen3 or "
        "deepseek_r1 (default: none)", type=str, choices=REASONING_PARSERS)
    generation_config: str = option(
        "auto", "sampling defaults from the checkpoint's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) for "
        "requests that leave them out: auto takes them, none ignores them",
        choices=GENERATION_CONFIG_CHOICES)
    device: str = option("auto", "auto, cpu or cuda[:N] (auto: CUDA when available)")
    attention_backend: str = option(
        "auto", "attention and cache kernels (auto: triton on CUDA, torch on CPU)",
        choices=("auto", "triton", "torch"))
    max_model_len: int | None = option(
        None, "longest prompt + output, in tokens (default: the model's, at most 8192)",
        type=int)
    max_num_seqs: int | None = option(
        None, "sequences decoded together (default: 256)", type=int)
    max_num_batched_tokens: int | None = option(
        None, "tokens per prompt step (default: 8192 on CUDA, 2048 on CPU)", type=int)
    block_size: int = option(16, "tokens per KV-cache block", choices=(8, 16, 32, 64))
    kv_cache_memory: int = option(1 << 30, "bytes of KV cache on CPU")
    kv_cache_dtype: str = option(
        "auto", "KV cache elements: auto (the model's dtype) or int8 (a scale per 32 "
        "values: 0.56x a bf16 cache's bytes, about 1.8x the tokens in the same memory)",
        choices=KV_CACHE_DTYPE_CHOICES)
    gpu_memory_utilization: float = option(
        0.9, "fraction of GPU memory for weights, activations and KV cache (CUDA)")
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of prompt prefixes seen before",
        flag="--prefix-caching")
    enforce_eager: bool = option(False, "no CUDA graphs for decode steps")
    async_scheduling: bool | None = option(
        None, "schedule step k+1 while step k runs (default: on for CUDA, off on CPU)",
        type=bool)
    tensor_parallel_size: int = option(
        1, "ranks one model is split over (one GPU each on CUDA; gloo processes on CPU)",
        flag="--tp", aliases=("--tensor-parallel-size",))
    engine_type: str = option("normal", "normal, prompt or completion", cli=False)
    enable_lora: bool = option(
        False, "serve PEFT LoRA adapters named per request (LoRARequest; on the command "
        "line --lora sets it)", cli=False)
    max_loras: int = option(
        4, "LoRA adapters kept loaded while no request uses them (those in use always "
        "stay)")
    max_lora_rank: int = option(64, "the largest LoRA rank an adapter may have")
    seed: int | None = option(
        None, "seed of the random stream that requests without a seed of their own draw "
        "from (None: torch's global generator)", type=int, flag="--engine-seed")

    def num_seqs(self) -> int:
        """``max_num_seqs``, or its default, 256 on every device. On CPU 256 was
        measured against 64 (the earlier default): 256 requests of 16-128 tokens ran
        1.12-1.31x faster (fewer, larger prompt steps; products at more rows), long
        contexts (KV-read bound) the same."""
        return self.max_num_seqs or 256

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid option."""
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype={self.dtype!r}: expected auto, float32, float16 or bfloat16"
            )
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization={self.quantization!r}: expected one of "
                             f"{', '.join(QUANTIZATION_CHOICES)}")
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(f"generation_config={self.generation_config!r}: expected one "
                             f"of {', '.join(GENERATION_CONFIG_CHOICES)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r}: expected one of "
                             f"{', '.join(REASONING_PARSERS)} or None")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r}: expected a positive integer or None")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r}: expected a positive integer")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size={self.block_size}: expected 8, 16, 32 or 64")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: expected one of "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory}: expected bytes > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: expected (0, 1]"
            )
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool)):
            raise ValueError(f"seed={self.seed!r}: expected an integer or None")
        if self.engine_type.lower() not in ("normal", "prompt", "completion"):
            raise ValueError(
                f"engine_type={self.engine_type!r}: expected normal, prompt or completion"
            )
        self._validate_lora()

    def _validate_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected a positive integer")
        if not self.enable_lora:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1: LoRA adapters are "
                             "served on one rank only so far (data parallel works)")
        if self.engine_type.lower() != "normal":
            raise ValueError("enable_lora with disaggregated prefill/decode (engine_type "
                             f"{self.engine_type!r}): not supported so far")
