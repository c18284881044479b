"""Engine options shared by ``LLM`` and the ``deepinfer-generate`` script."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    """What to load and how to run it.

    ``model=None`` is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF).
    ``kv_cache_memory`` (bytes) sizes the KV cache on CPU; on CUDA it is sized from free
    memory after a profiling forward, up to ``gpu_memory_utilization`` of the device.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    engine_type: str = "normal"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid option."""
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype={self.dtype!r}: expected auto, float32, float16 or bfloat16"
            )
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r}: expected a positive integer or None")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size={self.block_size}: expected 8, 16, 32 or 64")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory}: expected bytes > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: expected (0, 1]"
            )
        if self.engine_type.lower() not in ("normal", "prompt", "completion"):
            raise ValueError(
                f"engine_type={self.engine_type!r}: expected normal, prompt or completion"
            )
