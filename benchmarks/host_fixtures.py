"""What ``bench_host.py``'s measurements share: the near-free model (a 1-layer, 64-wide
random Llama written as a checkpoint), the ``LLM`` sized for a decode batch, fresh random
prompts, the model instance an engine runs and a stand-in forward that costs nothing."""

from __future__ import annotations

import os
import random
import statistics
from dataclasses import fields

import torch

PROMPT_LEN = 100
# The near-free model of the issue: 1 layer, 64 wide, ~300-token tokenizer.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.1)


def make_tiny_checkpoint(out_dir: str, seed: int = 0) -> str:
    """config.json + model.safetensors + the BPE tokenizer of deepinfer.testing.random_model, for
    the tiny Llama. The tensors are written directly under their HF names (building the HF model
    first only costs start-up)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from deepinfer.testing.random_model import build_bpe_tokenizer

    tok = build_bpe_tokenizer(290)
    spec = dict(TINY_LLAMA)
    std = spec.pop("initializer_range")
    cfg = LlamaConfig(**spec, vocab_size=len(tok), architectures=["LlamaForCausalLM"],
                      dtype="float32")
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    weights = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h),
               "model.norm.weight": torch.ones(h)}
    for n in range(cfg.num_hidden_layers):
        pre = f"model.layers.{n}."
        weights.update({
            pre + "self_attn.q_proj.weight": rnd(q, h),
            pre + "self_attn.k_proj.weight": rnd(kv, h),
            pre + "self_attn.v_proj.weight": rnd(kv, h),
            pre + "self_attn.o_proj.weight": rnd(h, q),
            pre + "mlp.gate_proj.weight": rnd(i, h),
            pre + "mlp.up_proj.weight": rnd(i, h),
            pre + "mlp.down_proj.weight": rnd(h, i),
            pre + "input_layernorm.weight": torch.ones(h),
            pre + "post_attention_layernorm.weight": torch.ones(h),
        })
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out_dir)
    return out_dir


def median(xs: list[float]) -> float:
    """The median of ``xs``; NaN when empty (a figure that was not measured)."""
    return statistics.median(xs) if xs else float("nan")


def engine_arg_names() -> set[str]:
    """The fields of ``EngineArgs``: what this engine version can be asked for."""
    from deepinfer.engine_args import EngineArgs

    return {f.name for f in fields(EngineArgs)}


def make_llm(path: str, num_seqs: int, steps: int, **extra):
    """An ``LLM`` on the CPU sized for ``num_seqs`` prompts of PROMPT_LEN + ``steps``
    tokens. The host table runs without async scheduling, when the engine has it, so
    that host + forward is the whole step."""
    from deepinfer import LLM

    if "async_scheduling" in engine_arg_names():
        extra.setdefault("async_scheduling", False)
    max_len = -(-(PROMPT_LEN + steps + 8) // 64) * 64
    return LLM(path, device="cpu", max_num_seqs=num_seqs, max_model_len=max_len,
               max_num_batched_tokens=max(2048, 16 * PROMPT_LEN),
               kv_cache_memory=1 << 30, **extra)


def random_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    """Fresh random prompts per run: no prefix-cache hits between repetitions."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(num)]


def model_of(engine):
    """The model instance the engine runs (its runner's, else its own)."""
    model = getattr(getattr(engine, "runner", None), "model", None)
    return engine.model if model is None else model


class zero_forward:
    """Within the block the model's forward returns zeros at once (no CPU work)."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self) -> None:
        hidden = self.model.config.hidden_size
        dtype = self.model.activation_dtype
        self.model.forward = lambda ids, *a, **k: torch.zeros(ids.shape[0], hidden,
                                                              dtype=dtype)

    def __exit__(self, *exc) -> None:
        self.model.__dict__.pop("forward", None)
