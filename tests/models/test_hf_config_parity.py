"""``ModelConfig.from_hf_config`` against transformers' config classes and the models they
build (on the meta device: no weights): the defaults of omitted keys (HF_DEFAULTS against
the classes' fields), explicit nulls, the attention biases, which layers are sparse, RoPE
parameters (YaRN's extended position limit), sliding windows, EOS ids, and what is
rejected."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
import transformers
from huggingface_hub.errors import StrictDataclassFieldValidationError

from deepinfer.config import ModelConfig
from deepinfer.hf_config import HF_DEFAULTS, SUPPORTED_ARCHITECTURES
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.worker import model_len_limit

#: Only the shape keys: everything else is left to the defaults.
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)


def _config_class(arch: str) -> Any:
    """transformers' config class of ``arch`` (Gemma 3's text one, not the multimodal)."""
    name = "Gemma3TextConfig" if arch == "Gemma3ForCausalLM" else arch.replace(
        "ForCausalLM", "Config")
    return getattr(transformers, name)


def _rope_theta(hf: Any) -> float:
    """A config's (global) RoPE base: Gemma 3 keeps one per layer type."""
    params = hf.rope_parameters
    return (params["full_attention"] if "full_attention" in params else params)["rope_theta"]


def _hf_config(arch: str, cfg: dict[str, Any]) -> Any:
    cls = _config_class(arch)
    if arch in ("Phi3ForCausalLM", "SmolLM3ForCausalLM"):
        cfg = {"pad_token_id": 0, **cfg}  # their default pad ids are past these vocabularies
    return cls.from_dict({"architectures": [arch], **cfg})


def _hf_qkv(attn: Any) -> tuple[int, int, bool]:
    """(q rows, k rows, whether q has a bias) of a transformers attention: separate
    q/k/v projections, or Phi-3's fused ``qkv_proj`` (q, k, v rows; no bias)."""
    if hasattr(attn, "qkv_proj"):
        kv = attn.num_key_value_heads * attn.head_dim
        return attn.qkv_proj.out_features - 2 * kv, kv, attn.qkv_proj.bias is not None
    return attn.q_proj.out_features, attn.k_proj.out_features, attn.q_proj.bias is not None


def _hf_meta_model(hf_cfg: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_cfg)


#: Every key of HF_DEFAULTS' rows (a row without one: None in the class).
TABLE_KEYS = ("rope_theta", "rms_norm_eps", "max_position_embeddings", "num_key_value_heads",
              "head_dim", "sliding_window", "max_window_layers", "bos_token_id",
              "eos_token_id", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")
#: The fallbacks from_hf_config hard-codes for an omitted key: each class has that default
#: or no such key.
FIXED_FALLBACKS = dict(hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                       qkv_bias=True, mlp_bias=False, norm_topk_prob=False,
                       use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=None,
                       clip_qkv=None, layer_types=None)
#: Shape keys only, heads a multiple of every class's default num_key_value_heads.
BARE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=32)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_defaults_table_is_the_config_class_defaults(arch):
    """Fails if our table or transformers' config class changes: each HF_DEFAULTS value is
    the class's field default (read from its dataclass fields, before __post_init__)."""
    cls = _config_class(arch)
    fields = {f.name: f.default for f in dataclasses.fields(cls)}

    def class_default(key: str) -> Any:
        if key == "rope_theta":  # no field: the class puts it into rope_parameters
            return _rope_theta(cls())
        return fields[key] if key in fields else fields.get(cls.attribute_map.get(key))

    assert set(HF_DEFAULTS[arch]) <= set(TABLE_KEYS)
    assert {k: class_default(k) for k in TABLE_KEYS} == {
        k: HF_DEFAULTS[arch].get(k) for k in TABLE_KEYS}
    # Gemma 2 and 3 and SmolLM3 tie their embeddings by default (gemma_config and
    # smollm3_config read that default).
    fixed = {**FIXED_FALLBACKS, **({"tie_word_embeddings": True} if arch in (
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM") else {})}
    assert {k: fields.get(k, v) for k, v in fixed.items()} == fixed


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_omitted_keys_as_transformers_builds_them(arch):
    """Only the shape keys: the attention transformers builds (on meta) and the config
    values it resolves, ours from the same config.json."""
    ours = ModelConfig.from_hf_config({"architectures": [arch], **BARE})
    hf = _hf_config(arch, BARE)
    hf_model = _hf_meta_model(hf)
    attn = hf_model.model.layers[0].self_attn
    moe = hasattr(hf, "num_experts")
    eos = hf_model.generation_config.eos_token_id  # what generate() uses without a
    q_rows, k_rows, _ = _hf_qkv(attn)
    want = {  # generation_config.json
        "num_heads": q_rows // attn.head_dim,
        "num_kv_heads": k_rows // attn.head_dim,
        "head_dim": attn.head_dim,
        "rope_theta": _rope_theta(hf),
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "bos_token_id": hf_model.generation_config.bos_token_id,
        "eos_token_ids": () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        # Mistral's, Gemma's and EXAONE's default window; the Qwen families slide only with
        # use_sliding_window
        "sliding_window": 4096 if arch in ("MistralForCausalLM", "Gemma2ForCausalLM",
                                           "Gemma3ForCausalLM", "Exaone4ForCausalLM")
        else None,
        "num_experts": hf.num_experts if moe else 0,
        "num_experts_per_tok": hf.num_experts_per_tok if moe else 0,
        "moe_intermediate_size": getattr(hf, "moe_intermediate_size", hf.intermediate_size)
        if moe else 0,
        "norm_topk_prob": getattr(hf, "norm_topk_prob", arch == "MixtralForCausalLM"),
        "shared_expert_intermediate_size": getattr(hf, "shared_expert_intermediate_size", 0),
    }
    assert {key: getattr(ours, key) for key in want} == want
    assert (getattr(hf, "sliding_window", None) or None) == want["sliding_window"]  # 0: none
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)
    assert rope["rope_type"] == "default" and ours.rope_scaling is None
    assert getattr(hf, "hidden_activation", None) == "gelu_pytorch_tanh" if \
        arch.startswith("Gemma") else hf.hidden_act in ("silu", "swish")
    with torch.device("meta"):
        qkv = LlamaForCausalLM(ours).model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape[0] == q_rows + 2 * k_rows


@pytest.mark.parametrize("key", ["num_key_value_heads", "head_dim"])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_null_count_as_transformers(arch, key):
    """An explicit null: the same value where transformers builds the model, else refused
    naming the key (transformers raises, or fails building the attention)."""
    cfg = {**BARE, key: None}
    try:
        attn = _hf_meta_model(_hf_config(arch, cfg)).model.layers[0].self_attn
    except (TypeError, ValueError, StrictDataclassFieldValidationError):
        with pytest.raises(ValueError, match=rf"{arch}: {key}=null is refused"):
            ModelConfig.from_hf_config({"architectures": [arch], **cfg})
        return
    ours = ModelConfig.from_hf_config({"architectures": [arch], **cfg})
    assert (ours.num_kv_heads, ours.head_dim) == (_hf_qkv(attn)[1] // attn.head_dim,
                                                  attn.head_dim)


@pytest.mark.parametrize("value", [0, -2, "8", 2.0, True, [4]])
@pytest.mark.parametrize("key", ["num_key_value_heads", "head_dim", "num_attention_heads",
                                 "hidden_size", "sliding_window"])
def test_bad_counts_name_the_key(key, value):
    cfg = {"architectures": ["MistralForCausalLM"], **SHAPE, key: value}
    if key == "sliding_window" and value == 0:
        assert ModelConfig.from_hf_config(cfg).sliding_window is None  # 0: no window
        return
    with pytest.raises(ValueError, match=re.escape(
            f"MistralForCausalLM: {key}={value!r} must be a positive integer")):
        ModelConfig.from_hf_config(cfg)


#: (architecture, config.json keys beyond SHAPE, our window) for windows transformers
#: resolves from defaults; test_hf_logits_parity.py checks which layers really slide.
WINDOWS = {
    "qwen2_below_max_window_layers": ("Qwen2ForCausalLM", {"use_sliding_window": True}, None),
    "qwen2_default_window": ("Qwen2ForCausalLM", {"use_sliding_window": True,
                                                  "max_window_layers": 3}, 4096),
    "qwen3_default_window": ("Qwen3ForCausalLM", {"use_sliding_window": True,
                                                  "max_window_layers": 0}, 4096),
    "qwen3_layer_types": ("Qwen3ForCausalLM", {"use_sliding_window": True, "layer_types": [
        "full_attention", "full_attention", "sliding_attention", "full_attention"]}, 4096),
    "qwen3_null_window": ("Qwen3ForCausalLM", {"use_sliding_window": True,
                                               "sliding_window": None,
                                               "max_window_layers": 0}, None),
    "qwen3_no_use_sliding_window": ("Qwen3ForCausalLM", {"sliding_window": 64,
                                                         "max_window_layers": 0}, None),
    "qwen3_moe_default_window": ("Qwen3MoeForCausalLM", {"use_sliding_window": True}, 4096),
    "qwen2_moe_default_window": ("Qwen2MoeForCausalLM", {"use_sliding_window": True}, 4096),
    "qwen2_moe_max_window_layers_0": ("Qwen2MoeForCausalLM", {"use_sliding_window": True,
                                                              "max_window_layers": 0}, None),
    "mixtral_default": ("MixtralForCausalLM", {}, None),
    "mixtral_window": ("MixtralForCausalLM", {"sliding_window": 64}, 64),
    "llama_window_key": ("LlamaForCausalLM", {"sliding_window": 64}, None),
    "olmoe_window_key": ("OlmoeForCausalLM", {"sliding_window": 64}, None),
}


@pytest.mark.parametrize("case", list(WINDOWS))
def test_sliding_window_defaults_as_transformers(case):
    arch, extra, window = WINDOWS[case]
    ours = ModelConfig.from_hf_config({"architectures": [arch], **SHAPE, **extra})
    assert ours.sliding_window == window
    hf = _hf_config(arch, {**SHAPE, **extra})
    types = getattr(hf, "layer_types", None)
    if window is not None:  # transformers' own window, on some layer
        assert hf.sliding_window == window
        assert types is None or "sliding_attention" in types
    elif arch.startswith("Qwen"):  # transformers: no window or no sliding layer
        assert not hf.sliding_window or "sliding_attention" not in types


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
        assert (attn.qkv_proj.bias is not None) == _hf_qkv(hf_attn)[2]
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
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 512},
    {"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                      "beta_fast": 16}, "original_max_position_embeddings": 128},
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0}, "max_position_embeddings": 1024},
], ids=["params_top_theta", "params_no_theta", "params_theta_wins", "default_type",
        "v4_scaling", "null_params", "yarn_original_from_max_positions",
        "yarn_top_level_original_ignored", "llama3_original_from_max_positions"])
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


@pytest.mark.parametrize("cfg_eos, gen, want", [
    ("absent", None, (2,)),  # LlamaConfig's default, what generate() falls back to
    ("absent", {"eos_token_id": [7, 9]}, (7, 9)),  # generation_config.json wins
    ("absent", {"eos_token_id": None}, ()),
    (None, None, ()),  # an explicit null: no EOS, as in transformers
    (5, {"eos_token_id": [7, 5]}, (5, 7)),
])
def test_eos_default_only_when_no_file_names_one(cfg_eos, gen, want):
    cfg = {"architectures": ["LlamaForCausalLM"], **SHAPE}
    if cfg_eos != "absent":
        cfg["eos_token_id"] = cfg_eos
    assert ModelConfig.from_hf_config(cfg, gen).eos_token_ids == want


def test_mlp_bias_refused_on_llama_granite_and_smollm3_only():
    """Only Llama's, Granite's and SmolLM3's MLPs have biases with mlp_bias (unsupported
    here); the other classes ignore the key (test_hf_logits_parity.py loads such
    checkpoints)."""
    biased = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")
    for arch in biased:
        with pytest.raises(ValueError, match=f"{arch}: mlp_bias=true is not supported"):
            ModelConfig.from_hf_config({"architectures": [arch], **SHAPE, "mlp_bias": True})
        assert "bias=True" in repr(_hf_meta_model(_hf_config(arch, {**SHAPE,
                                                                    "mlp_bias": True})).model
                                   .layers[0].mlp)
    for arch in set(SUPPORTED_ARCHITECTURES) - set(biased):
        ModelConfig.from_hf_config({"architectures": [arch], **SHAPE, "mlp_bias": True})


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope scaling type 'dynamic' is not supported"),
    ({"rope_type": "yarn", "factor": 0.5}, "'yarn': factor=0.5 must be >= 1"),
    ({"rope_type": "yarn", "factor": "4"}, "'yarn': factor='4' must be a positive number"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1},
     "'yarn': beta_fast=-1 must be a non-negative number"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0},
     "'yarn': attention_factor=0.0 must be a positive number"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"},
     "'yarn': truncate='yes' must be true or false"),
    ({"rope_type": "linear"}, "'linear': factor=None must be a positive number"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     "'llama3': high_freq_factor=None must be a positive number"),
], ids=["unknown_type", "yarn_factor_below_1", "yarn_factor_string", "yarn_negative_beta",
        "yarn_zero_attention_factor", "yarn_truncate_not_bool", "linear_no_factor",
        "llama3_missing_key"])
def test_bad_rope_parameters_name_the_key(rope, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **SHAPE,
                                    "rope_parameters": rope})


@pytest.mark.parametrize("rope, max_pos, limit", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960,
     131072),  # Qwen3's recipe: served to factor x the original length, as vLLM does
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}, 163840,
     163840),
    ({"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096}, 8192,
     8192),  # never below max_position_embeddings
    ({"rope_type": "linear", "factor": 4.0}, 8192, 8192),
])
def test_yarn_extends_the_position_limit(rope, max_pos, limit):
    cfg = ModelConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"], **SHAPE,
                                      "rope_parameters": rope,
                                      "max_position_embeddings": max_pos})
    assert cfg.max_positions == limit
    assert model_len_limit(cfg, limit) == limit
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} exceeds the model's "
                                         f"limit of {limit} positions"):
        model_len_limit(cfg, limit + 1)
