"""The Hugging Face architectures the engine runs, and how a ``config.json`` maps onto
:class:`~deepinfer.config.ModelConfig` the way transformers reads it: per-architecture
defaults for the keys a file leaves out (``HF_DEFAULTS``, held against transformers'
config classes by tests/models/test_hf_config_parity.py), which keys each architecture
reads or ignores, which nulls it accepts, its attention biases, sliding window, RoPE
layout and MoE keys.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.exaone4_config import EXAONE4, exaone4_fields
from deepinfer.gemma_config import (
    GEMMA2,
    GEMMA3,
    GEMMA_ARCHITECTURES,
    gemma2_fields,
    gemma3_fields,
)
from deepinfer.layer_pattern import sliding_layers_of
from deepinfer.phi3_config import phi3_partial_rotary, phi3_rope
from deepinfer.smollm3_config import SMOLLM3, smollm3_fields

OLMO2 = "Olmo2ForCausalLM"
#: OLMo 2's switches (HF folders and GGUF files): q/k norms over the whole projection,
#: norms after the attention and the MLP only.
OLMO2_FIELDS: dict[str, Any] = dict(qk_norm_full_width=True, post_norms=True)

#: HF ``architectures`` names the engine can run (all share one decoder implementation).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM",
    "GraniteForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "SmolLM3ForCausalLM", OLMO2, "Exaone4ForCausalLM",
)

#: Base-model architectures (the decoder without its language-model head, as embedding
#: models such as e5-mistral are saved) -> the one whose decoder they are. Such a
#: checkpoint embeds (``LLM.embed``) and never generates (``ModelConfig.embedding_only``).
BASE_MODEL_ARCHITECTURES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}

#: The mixture-of-experts subset of :data:`SUPPORTED_ARCHITECTURES`.
MOE_ARCHITECTURES: tuple[str, ...] = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
)

#: GGUF ``general.architecture`` -> HF architecture. Mistral GGUFs are written as "llama",
#: and so are Mixtral's (a "llama" file with experts is read as Mixtral).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "smollm3": SMOLLM3,
    "olmo2": OLMO2,
}

#: Whether llama.cpp renormalises the top-k routing weights of a GGUF architecture when
#: the file has no ``{arch}.expert_weights_norm`` key (as its model graphs hard-code it).
GGUF_EXPERT_WEIGHTS_NORM: dict[str, bool] = {
    "MixtralForCausalLM": True, "Qwen3MoeForCausalLM": True,
    "Qwen2MoeForCausalLM": False, "OlmoeForCausalLM": False,
}

#: transformers' config-class defaults for the keys a ``config.json`` may omit, per
#: architecture (tests/models/test_hf_config_parity.py holds them against the classes); a
#: key missing from a row defaults to None there: ``num_key_value_heads`` then means
#: ``num_attention_heads``, ``head_dim`` ``hidden_size // num_attention_heads``, the rest
#: none. ``sliding_window`` is a default only where the key is absent (an explicit null:
#: none); a MoE row without ``moe_intermediate_size`` has experts of ``intermediate_size``.
_QWEN: dict[str, Any] = dict(rope_theta=1e4, rms_norm_eps=1e-6,
                             max_position_embeddings=32768, sliding_window=4096)
_MISTRAL: dict[str, Any] = dict(max_position_embeddings=131072, num_key_value_heads=8,
                                bos_token_id=1, eos_token_id=2)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                             max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "MistralForCausalLM": dict(_MISTRAL, rope_theta=1e4, rms_norm_eps=1e-6,
                               sliding_window=4096),
    "Qwen2ForCausalLM": dict(_QWEN, num_key_value_heads=32, max_window_layers=28),
    "Qwen3ForCausalLM": dict(_QWEN, num_key_value_heads=32, max_window_layers=28,
                             head_dim=128),
    "Qwen3MoeForCausalLM": dict(_QWEN, num_key_value_heads=4, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=768),
    "MixtralForCausalLM": dict(_MISTRAL, rope_theta=1e6, rms_norm_eps=1e-5, num_experts=8,
                               num_experts_per_tok=2),
    "OlmoeForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=4096,
                             eos_token_id=50279, num_experts=64, num_experts_per_tok=8),
    OLMO2: dict(rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=2048,
                             eos_token_id=50279),
    EXAONE4: dict(rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=2048,
                  num_key_value_heads=32, sliding_window=4096, bos_token_id=0,
                  eos_token_id=2),
    "Qwen2MoeForCausalLM": dict(_QWEN, num_key_value_heads=16, max_window_layers=28,
                                num_experts=60, num_experts_per_tok=4,
                                moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
    "GraniteForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                               max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "Phi3ForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=4096,
                            bos_token_id=1, eos_token_id=32000),
    # Gemma2Config's and Gemma3TextConfig's; their other keys: deepinfer.gemma_config.
    GEMMA2: dict(rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=8192,
                 num_key_value_heads=4, head_dim=256, sliding_window=4096, bos_token_id=2,
                 eos_token_id=1),
    "Gemma3ForCausalLM": dict(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072,
                              num_key_value_heads=4, head_dim=256, sliding_window=4096,
                              bos_token_id=2, eos_token_id=1),
    # SmolLM3Config's; its NoPE layers and window: deepinfer.smollm3_config.
    SMOLLM3: dict(rope_theta=2e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  num_key_value_heads=4, bos_token_id=128000, eos_token_id=128001),
}

#: Granite's four scalars (a Llama otherwise) and their defaults in its config class:
#: the embeddings times ``embedding_multiplier``, each block's output times
#: ``residual_multiplier`` before the residual add, attention scores times
#: ``attention_multiplier`` (instead of 1 / sqrt(head_dim)), logits over
#: ``logits_scaling``.
GRANITE_MULTIPLIERS: dict[str, float] = dict(embedding_multiplier=1.0, residual_multiplier=1.0,
                                             attention_multiplier=1.0, logits_scaling=1.0)

#: Where transformers maps an explicit null of these keys to their fallback (above); the
#: other classes refuse it or build a broken model, so we refuse it too.
_NULL_FALLBACK: dict[str, tuple[str, ...]] = {
    "num_key_value_heads": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                            "OlmoeForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM",
                            SMOLLM3, OLMO2),
    "head_dim": ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
}

#: Activations of the gated MLP the kernels implement (transformers maps both to SiLU).
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "swish")

#: ``torch_dtype`` / ``dtype`` names of config.json.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def hf_config_fields(cfg: dict[str, Any],
                     generation_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a parsed HF ``config.json`` (and of its
    ``generation_config.json``, which contributes EOS ids). ``ValueError`` naming the
    architecture and the key for what the engine or transformers would refuse;
    ``KeyError`` for a missing shape key."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
    headless = arch in BASE_MODEL_ARCHITECTURES
    arch = BASE_MODEL_ARCHITECTURES.get(arch, arch)
    check_architecture(arch)
    # Llama, Granite and SmolLM3 build MLP biases with mlp_bias; the others ignore it.
    if arch in ("LlamaForCausalLM", "GraniteForCausalLM", SMOLLM3) and cfg.get("mlp_bias"):
        raise ValueError(f"{arch}: mlp_bias=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if arch not in GEMMA_ARCHITECTURES and act not in SUPPORTED_ACTIVATIONS:  # Gemma's own
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    defaults = HF_DEFAULTS[arch]
    num_heads = _count(arch, "num_attention_heads", cfg["num_attention_heads"])
    hidden = _count(arch, "hidden_size", cfg["hidden_size"])
    max_positions = int(_get(cfg, "max_position_embeddings", defaults))
    theta, scaling = _hf_rope(cfg, defaults["rope_theta"], max_positions)
    if arch == "Phi3ForCausalLM":
        scaling = phi3_rope(cfg, scaling, max_positions)
    elif scaling is not None and scaling["rope_type"] == "longrope":
        raise ValueError(f"{arch}: rope scaling type 'longrope' is not supported for this "
                         "architecture (Phi3ForCausalLM only)")
    gen = generation_config or {}
    # The class's EOS only if neither file names one (transformers' generate reads it).
    own = cfg if "eos_token_id" in cfg or "eos_token_id" in gen else defaults
    eos = dict.fromkeys(int(i) for src in (own, gen) for i in _as_list(src.get("eos_token_id")))
    qkv_bias, o_bias = _hf_attention_bias(arch, cfg)
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    fields = dict(
        architecture=arch,
        vocab_size=_count(arch, "vocab_size", cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=_count(arch, "intermediate_size", cfg["intermediate_size"]),
        num_layers=_count(arch, "num_hidden_layers", cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=_hf_count(arch, cfg, "num_key_value_heads", num_heads),
        head_dim=_hf_count(arch, cfg, "head_dim", hidden // num_heads),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", defaults)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        # Headless: no lm_head to load; the one token an embedding request samples (and
        # drops) is scored against the embedding matrix.
        tie_word_embeddings=headless or bool(cfg.get("tie_word_embeddings", False)),
        embedding_only=headless,
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        **_hf_sliding_window(arch, cfg),
        bos_token_id=_first(cfg.get("bos_token_id", defaults.get("bos_token_id"))),
        eos_token_ids=tuple(eos),
        torch_dtype=DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
        generation_defaults=generation_sampling_keys(gen),
        **_hf_moe(arch, cfg),
        **_hf_multipliers(arch, cfg),
        **({"partial_rotary_factor": phi3_partial_rotary(cfg)}
           if arch == "Phi3ForCausalLM" else {}),
        **(OLMO2_FIELDS if arch == OLMO2 else {}),
    )
    if arch == GEMMA3:
        fields.update(gemma3_fields(cfg, hidden, fields["num_layers"]))
    elif arch == GEMMA2:
        fields.update(gemma2_fields(cfg, hidden, fields["num_layers"]))
    elif arch == SMOLLM3:
        fields.update(smollm3_fields(cfg, fields["num_layers"]))
    elif arch == EXAONE4:
        fields.update(exaone4_fields(cfg, fields["num_layers"]))
    return fields


#: generation_config.json's sampling keys (as vLLM reads them) -> SamplingParams fields.
GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p",
                            "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_sampling_keys(gen: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a parsed ``generation_config.json`` gives, under
    ``SamplingParams`` names (nulls left out; values unchecked)."""
    return {field: gen[key] for key, field in GENERATION_SAMPLING_KEYS.items()
            if gen.get(key) is not None}


def _get(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    """``cfg[key]``, or the architecture's default when the key is absent or null."""
    value = cfg.get(key)
    return defaults[key] if value is None else value


def _count(arch: str, key: str, value: Any) -> int:
    """``value`` if it is a positive integer, else ``ValueError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arch}: {key}={value!r} must be a positive integer")
    return value


def _hf_count(arch: str, cfg: dict[str, Any], key: str, fallback: int) -> int:
    """``key`` as transformers resolves it: absent, the class default (``fallback`` where that
    is None); null, ``fallback`` only where the class maps it so (:data:`_NULL_FALLBACK`)."""
    value = cfg[key] if key in cfg else HF_DEFAULTS[arch].get(key)
    if value is None:
        if key in cfg and arch not in _NULL_FALLBACK[key]:
            raise ValueError(f"{arch}: {key}=null is refused by transformers; give an integer")
        return fallback
    return _count(arch, key, value)


def _hf_attention_bias(arch: str, cfg: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as transformers builds the attention of ``arch``."""
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", EXAONE4):
        return False, False  # no bias whatever the config says
    if arch == "Qwen2ForCausalLM":
        return True, False  # hard-coded qkv bias, no switch in its config
    if arch == "Qwen2MoeForCausalLM":
        return bool(cfg.get("qkv_bias", True)), False
    bias = bool(cfg.get("attention_bias", False))  # Llama, Qwen3(-MoE), OLMoE: all four
    return bias, bias


def _hf_sliding_window(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` (the window, if transformers slides any layer of ``arch``) and
    ``sliding_layers`` (which ones; None: all) as ``ModelConfig`` fields; none when no
    layer slides (a null or 0 window is none). Llama and OLMoE never slide (causal masks
    whatever the key says); the Qwen families only with ``use_sliding_window``, and Qwen2,
    Qwen3 and Qwen2-MoE only on the layers ``layer_types`` marks, by default from
    ``max_window_layers`` (Qwen2/Qwen3: layers >= it; Qwen2-MoE: even layers < it)."""
    if arch in ("LlamaForCausalLM", "OlmoeForCausalLM", OLMO2,
                "GraniteForCausalLM", SMOLLM3) or (
            arch.startswith("Qwen") and not cfg.get("use_sliding_window")):
        return {}
    window = cfg.get("sliding_window", HF_DEFAULTS[arch].get("sliding_window"))
    if not window:
        return {}
    layers = None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        types, first = cfg.get("layer_types"), _get(cfg, "max_window_layers", HF_DEFAULTS[arch])
        n = int(cfg["num_hidden_layers"])
        if types is not None:
            layers = sliding_layers_of(types)
        elif arch == "Qwen2MoeForCausalLM":
            layers = tuple(i for i in range(min(first, n)) if i % 2 == 0)
        else:
            layers = tuple(range(first, n))
        if not layers:
            return {}
    return {"sliding_window": _count(arch, "sliding_window", window), "sliding_layers": layers}


def _hf_multipliers(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's scalars (:data:`GRANITE_MULTIPLIERS`; ``{}`` for the other architectures,
    which have none): a missing or null key takes the class default; each must be a
    positive finite number."""
    if arch != "GraniteForCausalLM":
        return {}
    out = {}
    for key, default in GRANITE_MULTIPLIERS.items():
        value = cfg.get(key)
        value = default if value is None else value
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not 0 < value < float("inf")):
            raise ValueError(f"{arch}: {key}={value!r} must be a positive number")
        out[key] = float(value)
    return out


def _hf_moe(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig` from an HF config (``{}`` for dense ones).

    transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``; Mixtral and
    OLMoE experts have ``intermediate_size``, every one of their layers is sparse (they
    have no ``decoder_sparse_step``/``mlp_only_layers``); Mixtral always renormalises its
    top-k. A missing (or null) key takes transformers' default for ``arch``.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    defaults = HF_DEFAULTS[arch]
    experts = cfg.get("num_experts")
    if experts is None:
        experts = cfg.get("num_local_experts")
    if experts is None:
        experts = defaults["num_experts"]
    qwen = arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    out: dict[str, Any] = dict(
        num_experts=int(experts),
        num_experts_per_tok=int(_get(cfg, "num_experts_per_tok", defaults)),
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", defaults)) if qwen
        else int(cfg["intermediate_size"]),
        norm_topk_prob=True if arch == "MixtralForCausalLM"
        else bool(cfg.get("norm_topk_prob", False)),
    )
    if qwen:
        # A missing or null step means every layer; 0 is rejected by __post_init__
        # (transformers would divide by it).
        step = cfg.get("decoder_sparse_step")
        out["decoder_sparse_step"] = 1 if step is None else int(step)
        out["mlp_only_layers"] = tuple(int(i) for i in cfg.get("mlp_only_layers") or ())
    if arch == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = int(
            _get(cfg, "shared_expert_intermediate_size", defaults))
    if arch == "OlmoeForCausalLM":
        out["qk_norm_full_width"] = True
        clip = cfg.get("clip_qkv")
        out["clip_qkv"] = float(clip) if clip is not None else None
    return out


def _arch_from_model_type(model_type: str | None) -> str | None:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "olmoe": "OlmoeForCausalLM",
        "olmo2": OLMO2,
        "exaone4": EXAONE4,
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "granite": "GraniteForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "gemma2": GEMMA2,
        "gemma3_text": GEMMA3,
        "smollm3": SMOLLM3,
    }.get(model_type or "", model_type)


def _hf_rope(cfg: dict[str, Any], default_theta: float,
             max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout, as transformers merges them.

    transformers 5 writes ``rope_parameters`` (theta inside, ``rope_type`` always set);
    4.x writes top-level ``rope_theta`` plus an optional ``rope_scaling`` whose type key is
    ``rope_type`` or the older ``type``. A non-empty ``rope_scaling`` wins over
    ``rope_parameters`` (as in transformers); theta comes from the chosen dict, else the
    top-level key, else the architecture's default. ``llama3`` and ``yarn`` without an
    ``original_max_position_embeddings`` take ``max_positions``, as transformers fills it
    for these architectures (a top-level key of that name is not read: their config
    classes do not declare it); a ``yarn`` factor of null is ``max_positions`` over it.
    """
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters {params!r}: expected a JSON object")
    scaling = dict(params)
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta")
    theta = float(default_theta if theta is None else theta)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        orig = scaling.setdefault("original_max_position_embeddings", max_positions)
        if rope_type == "yarn" and scaling.get("factor") is None and isinstance(orig, int) \
                and orig > 0:
            scaling["factor"] = max_positions / orig
    return theta, {"rope_type": rope_type, **scaling}


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _first(x: Any) -> int | None:
    xs = _as_list(x)
    return int(xs[0]) if xs else None


def check_architecture(arch: str | None) -> None:
    """Raise ``ValueError`` naming ``arch`` and the supported ones if it is unknown."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (GGUF: {', '.join(GGUF_ARCHITECTURES)})"
        )
