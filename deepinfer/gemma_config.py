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
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["GEMMA3", "GEMMA3_DEFAULTS", "gemma3_fields"]

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
