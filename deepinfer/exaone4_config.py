"""EXAONE 4.0's ``config.json`` (``Exaone4ForCausalLM``) as ``ModelConfig`` fields, read
as transformers' ``Exaone4Config`` reads it.

EXAONE 4.0 is a Llama with OLMo 2's block (a norm after the attention and after the MLP,
none before), per-head q/k norms, and, when ``sliding_window`` is set (the class default
4096), hybrid attention: the layers ``layer_types`` marks slide (by default three of each
four, ``sliding_window_pattern``) and the others are global and apply no RoPE (NoPE).
A null window: every layer global, with RoPE.
"""

from __future__ import annotations

from typing import Any

from deepinfer.layer_pattern import all_but_every_nth, sliding_layers_of

__all__ = ["EXAONE4", "EXAONE4_DEFAULTS", "exaone4_fields"]

EXAONE4 = "Exaone4ForCausalLM"
#: Exaone4Config's defaults for the keys read here.
EXAONE4_DEFAULTS: dict[str, Any] = dict(sliding_window=4096, sliding_window_pattern=4)


def _sliding_layers(cfg: dict[str, Any], num_layers: int,
                    window: int | None) -> tuple[int, ...]:
    """The layers that slide, as Exaone4Config fills ``layer_types`` when it is absent."""
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"{EXAONE4}: layer_types lists {len(types)} layers for "
                             f"num_hidden_layers={num_layers}")
        return sliding_layers_of(types)
    if not window:
        return ()
    pattern = cfg.get("sliding_window_pattern", EXAONE4_DEFAULTS["sliding_window_pattern"])
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        # The released checkpoints' spelling: "LLLG", L local (sliding), G global.
        return tuple(i for i in range(num_layers) if pattern[i % len(pattern)] == "L")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{EXAONE4}: sliding_window_pattern={pattern!r} must be a positive "
                         "integer or a string of L and G")
    return all_but_every_nth(num_layers, pattern)


def exaone4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields an EXAONE 4.0 ``config.json`` sets beyond Llama's:
    the block and q/k norms, and the sliding and NoPE layers; ``ValueError`` naming the
    key when ``layer_types`` or ``sliding_window_pattern`` is malformed."""
    window = cfg.get("sliding_window", EXAONE4_DEFAULTS["sliding_window"])
    sliding = _sliding_layers(cfg, num_layers, window)
    out: dict[str, Any] = dict(qk_norm=True, post_norms=True, sliding_window=None,
                               sliding_layers=None)
    if window:  # hybrid: RoPE on the sliding layers only
        out["nope_layers"] = tuple(i for i in range(num_layers) if i not in sliding)
        if sliding:
            out.update(sliding_window=int(window), sliding_layers=sliding)
    return out
