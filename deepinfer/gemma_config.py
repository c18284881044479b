"""Gemma 2's and Gemma 3's ``config.json`` (``Gemma2ForCausalLM``; ``Gemma3ForCausalLM``,
model type ``gemma3_text``: the text models, Gemma-3-270M and 1B, and the language part
of the larger ones saved alone) as ``ModelConfig`` fields, read as transformers'
``Gemma2Config`` and ``Gemma3TextConfig`` read them.

What sets Gemma 3 apart from the Llama layout the decoder runs: RMSNorm weights stored as
offsets from 1 (``ModelConfig.norm_weight_offset``: folded in at load), a norm after the
attention and after the MLP as well as before them (``sandwich_norms``), a GeGLU MLP
(``gelu_pytorch_tanh``), q/k norms, the embeddings times ``sqrt(hidden_size)``, attention
scaled by ``query_pre_attn_scalar ** -0.5``, and five sliding-window layers for each
global one, the sliding ones with their own RoPE base (``local_rope_theta``).

Both layouts are read: transformers 5's ``rope_parameters`` per layer type, and 4.x's
``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding ones) and
``rope_scaling`` (global layers only). Bidirectional attention is refused by name.

Gemma 2 is the same block without q/k norms, every other layer sliding, one RoPE base,
and soft caps (``c * tanh(x / c)``) on the attention scores and on the final logits.

GGUF files (llama.cpp's ``gemma2`` and ``gemma3``) store the norms with the 1 already
added, and leave out what llama.cpp hard-codes: :func:`gguf_gemma_fields` reads them as
it does.
"""

from __future__ import annotations

import math
from typing import Any

from deepinfer.layer_pattern import all_but_every_nth, sliding_layers_of

__all__ = ["GEMMA2", "GEMMA3", "GEMMA3_DEFAULTS", "GEMMA_ARCHITECTURES", "gemma2_fields",
           "gemma3_fields", "gguf_gemma_fields"]

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GEMMA_ARCHITECTURES = (GEMMA2, GEMMA3)
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


def _sliding_layers(cfg: dict[str, Any], num_layers: int, period: int) -> tuple[int, ...]:
    """``layer_types``' sliding layers, else every layer but each ``period``-th (Gemma 3:
    ``sliding_window_pattern``, default 6; Gemma 2: 2, the even layers)."""
    types = cfg.get("layer_types")
    if types is not None:
        return sliding_layers_of(types)
    return all_but_every_nth(num_layers, int(cfg.get("sliding_window_pattern") or period))


def _positive(arch: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
            0 < value < math.inf:
        raise ValueError(f"{arch}: {key}={value!r} must be a positive number")
    return float(value)


def _gemma_fields(arch: str, cfg: dict[str, Any], hidden_size: int, num_layers: int,
                  period: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: GeGLU, the four norms stored as offsets from 1, the
    embedding scale, ``query_pre_attn_scalar``, the window's layers, tied embeddings."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: use_bidirectional_attention=true is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or \
        GEMMA3_DEFAULTS["hidden_activation"]
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{arch}: hidden_activation={act!r} is not supported; supported: "
                         "gelu_pytorch_tanh")
    scalar = _positive(arch, "query_pre_attn_scalar", cfg.get("query_pre_attn_scalar")
                       or GEMMA3_DEFAULTS["query_pre_attn_scalar"])
    window = cfg.get("sliding_window", GEMMA3_DEFAULTS["sliding_window"])
    layers = _sliding_layers(cfg, num_layers, period)
    return dict(
        sliding_window=int(window) if window and layers else None,
        sliding_layers=layers if window and layers else None,
        attention_multiplier=scalar ** -0.5, embedding_multiplier=math.sqrt(hidden_size),
        hidden_act="gelu_tanh", norm_weight_offset=True, sandwich_norms=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def gemma3_fields(cfg: dict[str, Any], hidden_size: int, num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Gemma 3 ``config.json`` sets beyond the common ones;
    ``ValueError`` naming the key for what is not supported."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:  # Gemma3TextConfig has them, its models do not
            raise ValueError(f"{GEMMA3}: {key}={cfg[key]!r} is not supported (Gemma 2's "
                             "soft caps are read for Gemma2ForCausalLM only)")
    theta, scaling, local_theta = _rope(cfg)
    return dict(_gemma_fields(GEMMA3, cfg, hidden_size, num_layers,
                              GEMMA3_DEFAULTS["sliding_window_pattern"]),
                rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                qk_norm=True)


#: Gemma2Config's soft caps, taken where the keys are absent (an explicit null: none).
GEMMA2_SOFTCAPS: dict[str, float] = dict(attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0)


def gemma2_fields(cfg: dict[str, Any], hidden_size: int, num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Gemma 2 ``config.json`` sets beyond the common ones
    (its RoPE is the common one): the soft caps, every other layer sliding."""
    caps = {key: None if cfg.get(key, default) is None else
            _positive(GEMMA2, key, cfg.get(key, default))
            for key, default in GEMMA2_SOFTCAPS.items()}
    return dict(_gemma_fields(GEMMA2, cfg, hidden_size, num_layers, 2), **caps)


#: What llama.cpp assumes for a ``gemma2`` / ``gemma3`` file that lacks the newer keys:
#: the sliding layers' period and RoPE base (Gemma 3's own), and the layer count of the
#: 27B model, whose attention is scaled by hidden_size / heads instead of head_dim.
GGUF_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(sliding_window_pattern=2, layers_27b=46),
    "gemma3": dict(sliding_window_pattern=6, layers_27b=62, rope_freq_base_swa=1e4),
}


def gguf_gemma_fields(gguf_arch: str, get: Any, hidden_size: int, num_heads: int,
                      head_dim: int, num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a llama.cpp ``gemma2`` or ``gemma3`` file beyond the
    common ones, as llama.cpp reads it: ``attention.sliding_window`` (0 or absent: none),
    ``attention.sliding_window_pattern`` (a period, or one flag per layer; absent: 2 or
    6), Gemma 3's ``rope.freq_base_swa`` (absent: 10000; rope scaling is the global
    layers' only), ``attention.scale`` (absent: head_dim ** -0.5, or (hidden_size /
    heads) ** -0.5 for the 27B), Gemma 2's ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (Gemma 3 files have none). ``get(key)`` reads
    ``{gguf_arch}.{key}``. The norms are stored as plain weights (the converter added
    the 1)."""
    defaults = GGUF_GEMMA_DEFAULTS[gguf_arch]
    caps = {key: float(get(key)) if get(key) else None
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    for key, cap in caps.items():
        if gguf_arch == "gemma3" and cap:
            raise ValueError(f"GGUF metadata gemma3.{key}={get(key)!r} is not supported "
                             "(soft caps are Gemma 2's)")
    window = int(get("attention.sliding_window") or 0)
    pattern = get("attention.sliding_window_pattern", defaults["sliding_window_pattern"])
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF metadata {gguf_arch}.attention.sliding_window_pattern "
                             f"has {len(pattern)} flags for {num_layers} layers")
        layers = tuple(i for i, sliding in enumerate(pattern) if sliding)
    else:  # llama.cpp's period: layer i slides unless (i + 1) % period == 0; 0: all do
        layers = all_but_every_nth(num_layers, int(pattern))
    scale = get("attention.scale")
    if not scale:
        width = hidden_size // num_heads if num_layers == defaults["layers_27b"] else head_dim
        scale = width ** -0.5
    sliding = bool(window and layers)
    local_theta = None
    if sliding and gguf_arch == "gemma3":
        local_theta = float(get("rope.freq_base_swa") or defaults["rope_freq_base_swa"])
    return dict(
        hidden_act="gelu_tanh", sandwich_norms=True, norm_weight_offset=False,
        embedding_multiplier=math.sqrt(hidden_size), attention_multiplier=float(scale),
        sliding_window=window if sliding else None,
        sliding_layers=layers if sliding else None, local_rope_theta=local_theta, **caps,
    )
