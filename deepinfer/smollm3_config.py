"""SmolLM3's ``config.json`` (``SmolLM3ForCausalLM``) as ``ModelConfig`` fields, read as
transformers' ``SmolLM3Config`` reads it, and its GGUF files as llama.cpp reads them.

SmolLM3 is a Llama whose every fourth layer applies no rotary embedding ("NoPE": its
q and k attend as projected). ``no_rope_layers`` flags each layer (1: RoPE, 0: none),
by default from ``no_rope_layer_interval``; llama.cpp's ``smollm3`` files store neither
and it hard-codes the interval 4. Sliding windows only with ``use_sliding_window``, on
the layers ``layer_types`` marks (by default the NoPE ones, as the config class fills it).
"""

from __future__ import annotations

from typing import Any

from deepinfer.layer_pattern import every_nth, sliding_layers_of

__all__ = ["NOPE_INTERVAL", "SMOLLM3", "gguf_smollm3_fields", "smollm3_fields"]

SMOLLM3 = "SmolLM3ForCausalLM"
#: SmolLM3Config's ``no_rope_layer_interval`` default, and llama.cpp's fixed step.
NOPE_INTERVAL = 4


def smollm3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields a SmolLM3 ``config.json`` sets beyond Llama's:
    ``nope_layers``, the tied embeddings (its class default), a sliding window where
    ``use_sliding_window`` asks for one. ``ValueError`` naming the key when
    ``no_rope_layers`` or ``no_rope_layer_interval`` is malformed."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", NOPE_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{SMOLLM3}: no_rope_layer_interval={interval!r} must be a "
                             "positive integer")
        nope = every_nth(num_layers, interval)
    elif (not isinstance(flags, list) or len(flags) != num_layers
          or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
        raise ValueError(f"{SMOLLM3}: no_rope_layers must list a 0 or 1 for each of the "
                         f"{num_layers} layers, got {flags!r}"[:300])
    else:
        nope = tuple(i for i, f in enumerate(flags) if not f)
    out: dict[str, Any] = dict(nope_layers=nope,
                               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types")
        layers = nope if types is None else sliding_layers_of(types)
        if layers:
            out.update(sliding_window=int(window), sliding_layers=layers)
    return out


def gguf_smollm3_fields(num_layers: int) -> dict[str, Any]:
    """A llama.cpp ``smollm3`` file's NoPE layers: every fourth, as llama.cpp hard-codes
    (the file stores no key for them)."""
    return dict(nope_layers=every_nth(num_layers, NOPE_INTERVAL))
