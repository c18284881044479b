"""``ModelConfig.from_hf_config`` against transformers' config classes and the models they
build (on the meta device: no weights): the defaults of omitted keys, the attention
biases, which layers are sparse, RoPE parameters, and what is rejected."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer.config import HF_DEFAULTS, SUPPORTED_ARCHITECTURES, ModelConfig
from deepinfer.models.llama import LlamaForCausalLM

#: Only the shape keys: everything else is left to the defaults.
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)


def _hf_config(arch: str, cfg: dict[str, Any]) -> Any:
    import transformers

    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return cls.from_dict({"architectures": [arch], **cfg})


def _hf_meta_model(hf_cfg: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_cfg)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_omitted_keys_take_transformers_defaults(arch):
    """Fails if our table or transformers' config class changes."""
    ours = ModelConfig.from_hf_config({"architectures": [arch], **SHAPE})
    hf = _hf_config(arch, SHAPE)
    moe = hasattr(hf, "num_experts")
    want = {
        "rope_theta": hf.rope_parameters["rope_theta"],
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        # The Qwen families use theirs only with use_sliding_window (off by default).
        "sliding_window": None if getattr(hf, "use_sliding_window", True) is False
        else getattr(hf, "sliding_window", None),
        "num_experts": hf.num_experts if moe else 0,
        "num_experts_per_tok": hf.num_experts_per_tok if moe else 0,
        "moe_intermediate_size": getattr(hf, "moe_intermediate_size", hf.intermediate_size)
        if moe else 0,
        "shared_expert_intermediate_size": getattr(hf, "shared_expert_intermediate_size", 0),
    }
    assert {key: getattr(ours, key) for key in want} == want
    for key, value in HF_DEFAULTS[arch].items():  # the table holds transformers' values
        assert want[key] == value, (arch, key)
    assert hf.rope_parameters["rope_type"] == "default" and ours.rope_scaling is None
    assert hf.hidden_act in ("silu", "swish")


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True},
                                   {"attention_bias": True, "qkv_bias": False},
                                   {"decoder_sparse_step": 2, "mlp_only_layers": [3]}],
                         ids=["defaults", "attention_bias", "no_qkv_bias", "sparse_step"])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_biases_and_sparse_layers_as_transformers_builds_them(arch, extra):
    """The q/k/v and o_proj biases and the sparse layers of transformers' model of the
    same config.json, ours built on meta too."""
    cfg = {**SHAPE, **extra}
    hf = _hf_meta_model(_hf_config(arch, cfg))
    ours_cfg = ModelConfig.from_hf_config({"architectures": [arch], **cfg})
    with torch.device("meta"):
        ours = LlamaForCausalLM(ours_cfg)
    for hf_layer, layer in zip(hf.model.layers, ours.model.layers, strict=True):
        hf_attn, attn = hf_layer.self_attn, layer.self_attn
        assert (attn.qkv_proj.bias is not None) == (hf_attn.q_proj.bias is not None)
        assert (attn.o_proj.bias is not None) == (hf_attn.o_proj.bias is not None)
        assert hasattr(layer.mlp, "w13") == hasattr(hf_layer.mlp, "experts")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MixtralForCausalLM",
                                  "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 50000.0},
    {"rope_parameters": {"rope_type": "linear", "factor": 4.0}},
    {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 7e4},
     "rope_theta": 50000.0},
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 50000.0},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 30000.0},
    {"rope_parameters": None, "rope_theta": 30000.0},
], ids=["params_top_theta", "params_no_theta", "params_theta_wins", "default_type",
        "v4_scaling", "null_params"])
def test_rope_parameters_merge_as_transformers(arch, rope):
    ours = ModelConfig.from_hf_config({"architectures": [arch], **SHAPE, **rope})
    hf = dict(_hf_config(arch, {**SHAPE, **rope}).rope_parameters)
    assert ours.rope_theta == hf.pop("rope_theta")
    rope_type = hf.pop("rope_type")
    hf.pop("type", None)
    if rope_type == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling == {"rope_type": rope_type, **hf}


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh", None])
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "LlamaForCausalLM"])
def test_unsupported_activation_names_arch_and_act(arch, act):
    with pytest.raises(ValueError, match=rf"{arch}: hidden_act={act!r} is not supported"):
        ModelConfig.from_hf_config({"architectures": [arch], **SHAPE, "hidden_act": act})


@pytest.mark.parametrize("act", ["silu", "swish"])
def test_silu_and_swish_accepted(act):
    ModelConfig.from_hf_config({"architectures": ["MistralForCausalLM"], **SHAPE,
                                "hidden_act": act})


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_decoder_sparse_step(arch):
    base = {"architectures": [arch], **SHAPE}
    with pytest.raises(ValueError, match=rf"{arch}: decoder_sparse_step=0 must be >= 1"):
        ModelConfig.from_hf_config({**base, "decoder_sparse_step": 0})
    for step in (None, 1):  # null or absent: every layer
        cfg = ModelConfig.from_hf_config({**base, "decoder_sparse_step": step})
        assert cfg.decoder_sparse_step == 1
    assert ModelConfig.from_hf_config(base).decoder_sparse_step == 1


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "OlmoeForCausalLM"])
def test_qwen_moe_layer_settings_ignored(arch):
    cfg = ModelConfig.from_hf_config({"architectures": [arch], **SHAPE,
                                      "decoder_sparse_step": 0, "mlp_only_layers": [1]})
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def test_mistral_sliding_window_absent_or_null():
    base = {"architectures": ["MistralForCausalLM"], **SHAPE}
    from transformers import MistralConfig

    assert ModelConfig.from_hf_config(base).sliding_window == 4096 == MistralConfig(
        ).sliding_window
    null = {**base, "sliding_window": None}
    assert ModelConfig.from_hf_config(null).sliding_window is None
    assert _hf_config("MistralForCausalLM", null).sliding_window is None


def test_mixtral_experts_use_intermediate_size():
    """Mixtral has no moe_intermediate_size: a stray key is ignored, as in transformers."""
    cfg = ModelConfig.from_hf_config({"architectures": ["MixtralForCausalLM"], **SHAPE,
                                      "moe_intermediate_size": 32})
    assert cfg.moe_intermediate_size == SHAPE["intermediate_size"]


def test_gguf_config_has_no_o_proj_bias():
    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": 64,
            "qwen2.attention.head_count": 4, "qwen2.feed_forward_length": 96,
            "qwen2.block_count": 2, "qwen2.vocab_size": 300}
    cfg = ModelConfig.from_gguf_metadata(meta)
    assert cfg.attention_bias and not cfg.o_proj_bias
