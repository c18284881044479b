"""Gemma 3's ``config.json`` (``Gemma3ForCausalLM``, model type ``gemma3_text``: the text
models, Gemma-3-270M and 1B, and the language part of the larger ones saved alone) as
``ModelConfig`` fields, read as transformers' ``Gemma3TextConfig`` reads it.

What sets Gemma 3 apart from the Llama layout the decoder runs: RMSNorm weights stored as
offsets from 1 (``ModelConfig.norm_weight_offset``: folded in at load), a norm after the
attention and after the MLP as well as before them (``sandwich_norms``), a GeGLU MLP
(``gelu_pytorch_tanh``), q/k norms, the embeddings times ``sqrt(hidden_size)``, attention
scaled by ``query_pre_attn_scalar ** -0.5``, and five sliding-window layers for each
global one, the sliding ones with their own RoPE base (``local_rope_theta``).

Both layouts are read: transformers 5's ``rope_parameters`` per layer type, and 4.x's
``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding ones) and
``rope_scaling`` (global layers only). Soft-capping (Gemma 2's) and bidirectional
attention are refused by name: no kernel implements them.

GGUF files (llama.cpp's ``gemma3``) store the norms with the 1 already added, and leave
out what llama.cpp hard-codes: :func:`gguf_gemma3_fields` reads them as it does.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["GEMMA3", "GEMMA3_DEFAULTS", "gemma3_fields", "gguf_gemma3_fields"]

GEMMA3 = "Gemma3ForCausalLM"
#: Gemma3TextConfig's defaults for the keys this module reads (the shape-independent ones).
GEMMA3_DEFAULTS: dict[str, Any] = dict(
    rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=4096, sliding_window_pattern=6,
    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling or None, local theta)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta = full.get("rope_theta", GEMMA3_DEFAULTS["rope_theta"])
        local_theta = local.get("rope_theta", GEMMA3_DEFAULTS["rope_local_base_freq"])
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"{GEMMA3}: rope scaling of the sliding layers "
                             f"({local.get('rope_type')!r}) is not supported")
    else:
        theta = cfg.get("rope_theta") or GEMMA3_DEFAULTS["rope_theta"]
        local_theta = cfg.get("rope_local_base_freq") or GEMMA3_DEFAULTS["rope_local_base_freq"]
        scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if kind == "default":
        return float(theta), None, float(local_theta)
    if kind != "linear" or not isinstance(scaling.get("factor"), (int, float)):
        raise ValueError(f"{GEMMA3}: rope scaling {kind!r} is not supported (linear only, "
                         "with a numeric factor)")
    return float(theta), {"rope_type": "linear", "factor": float(scaling["factor"])}, \
        float(local_theta)


def _sliding_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    pattern = cfg.get("sliding_window_pattern") or GEMMA3_DEFAULTS["sliding_window_pattern"]
    return tuple(i for i in range(num_layers) if (i + 1) % int(pattern))


def gemma3_fields(cfg: dict[str, Any], hidden_size: int, num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Gemma 3 ``config.json`` sets beyond the common ones;
    ``ValueError`` naming the key for what is not supported."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{GEMMA3}: {key}={cfg[key]!r} is not supported (no "
                             "soft-capping kernel)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{GEMMA3}: use_bidirectional_attention=true is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or \
        GEMMA3_DEFAULTS["hidden_activation"]
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{GEMMA3}: hidden_activation={act!r} is not supported; supported: "
                         "gelu_pytorch_tanh")
    scalar = cfg.get("query_pre_attn_scalar") or GEMMA3_DEFAULTS["query_pre_attn_scalar"]
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"{GEMMA3}: query_pre_attn_scalar={scalar!r} must be a positive "
                         "number")
    theta, scaling, local_theta = _rope(cfg)
    window = cfg.get("sliding_window", GEMMA3_DEFAULTS["sliding_window"])
    layers = _sliding_layers(cfg, num_layers)
    return dict(
        rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
        sliding_window=int(window) if window and layers else None,
        sliding_layers=layers if window and layers else None,
        attention_multiplier=float(scalar) ** -0.5,
        embedding_multiplier=math.sqrt(hidden_size),
        hidden_act="gelu_tanh", norm_weight_offset=True, sandwich_norms=True, qk_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


#: What llama.cpp assumes for a ``gemma3`` file that lacks the newer keys: the sliding
#: layers' RoPE base, five sliding layers then a global one, and the layer count of the
#: 27B model, whose attention is scaled by hidden_size / heads instead of head_dim.
GGUF_GEMMA3_DEFAULTS: dict[str, Any] = dict(rope_freq_base_swa=1e4, sliding_window_pattern=6,
                                            layers_27b=62)


def gguf_gemma3_fields(get: Any, hidden_size: int, num_heads: int, head_dim: int,
                       num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a llama.cpp ``gemma3`` file beyond the common ones,
    as llama.cpp reads it: ``attention.sliding_window`` (0 or absent: none),
    ``attention.sliding_window_pattern`` (a period, or one flag per layer; absent: 6),
    ``rope.freq_base_swa`` (absent: 10000; rope scaling is the global layers' only),
    ``attention.scale`` (absent: head_dim ** -0.5, or (hidden_size / heads) ** -0.5 for
    the 62-layer 27B). ``get(key)`` reads ``gemma3.{key}``. The norms are stored as plain
    weights (the converter added the 1)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key):
            raise ValueError(f"GGUF metadata gemma3.{key}={get(key)!r} is not supported "
                             "(no soft-capping kernel)")
    window = int(get("attention.sliding_window") or 0)
    pattern = get("attention.sliding_window_pattern",
                  GGUF_GEMMA3_DEFAULTS["sliding_window_pattern"])
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF metadata gemma3.attention.sliding_window_pattern has "
                             f"{len(pattern)} flags for {num_layers} layers")
        layers = tuple(i for i, sliding in enumerate(pattern) if sliding)
    else:  # llama.cpp's period: layer i slides unless (i + 1) % period == 0; 0: all do
        period = int(pattern)
        layers = tuple(i for i in range(num_layers) if period == 0 or (i + 1) % period)
    scale = get("attention.scale")
    if not scale:
        width = hidden_size // num_heads if num_layers == GGUF_GEMMA3_DEFAULTS[
            "layers_27b"] else head_dim
        scale = width ** -0.5
    sliding = bool(window and layers)
    return dict(
        hidden_act="gelu_tanh", sandwich_norms=True, norm_weight_offset=False,
        embedding_multiplier=math.sqrt(hidden_size), attention_multiplier=float(scale),
        sliding_window=window if sliding else None,
        sliding_layers=layers if sliding else None,
        local_rope_theta=float(get("rope.freq_base_swa")
                               or GGUF_GEMMA3_DEFAULTS["rope_freq_base_swa"])
        if sliding else None,
    )
