"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) made
with transformers' own config classes and ``save_pretrained``: shared by the MoE model
tests and the tensor-parallel tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.testing.random_model import build_bpe_tokenizer

_COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    initializer_range=0.1,  # as the dense tiny models: far from uniform attention/routing
    tie_word_embeddings=False,
)



def moe_configs() -> dict[str, Any]:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {
        # Layer 1 dense via mlp_only_layers; renormalised top-k.
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, head_dim=32, num_experts=6,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1],
                                    decoder_sparse_step=1),
        "mixtral": MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=None),
        # Raw (not renormalised) top-k weights; clip_qkv low enough to clip.
        "olmoe": OlmoeConfig(**_COMMON, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=False, clip_qkv=1.5),
        # decoder_sparse_step 2: layer 1 sparse, layers 0 and 2 dense.
        "qwen2_moe": Qwen2MoeConfig(**_COMMON, num_experts=5, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48,
                                    norm_topk_prob=False, decoder_sparse_step=2),
    }


@dataclass
class MoeCheckpoint:
    """A saved random MoE checkpoint and the in-memory HF model it came from."""

    path: str
    hf_model: Any


def make_moe_checkpoints(root) -> dict[str, MoeCheckpoint]:
    """Save every ``moe_configs()`` model (seeded random weights) under ``root``."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_bpe_tokenizer()
    out = {}
    for i, (name, cfg) in enumerate(moe_configs().items()):
        torch.manual_seed(2000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        if name == "qwen2_moe":  # HF zero-inits biases; random ones make them observable
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.1)
        path = str(root / name)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        out[name] = MoeCheckpoint(path, model)
    return out
