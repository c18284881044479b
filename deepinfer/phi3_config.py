"""Phi-3's ``config.json`` keys that differ from the common ones (``Phi3ForCausalLM``:
Phi-3-mini, Phi-3.5-mini, Phi-4-mini), read as transformers' ``Phi3Config`` reads them:
LongRoPE under its old names, its original context, a partial rotary."""

from __future__ import annotations

from typing import Any

__all__ = ["PHI3_ORIGINAL_POSITIONS", "phi3_partial_rotary", "phi3_rope"]

#: Phi3Config's pre-training context, its default ``original_max_position_embeddings``.
PHI3_ORIGINAL_POSITIONS = 4096


def phi3_rope(cfg: dict[str, Any], scaling: dict[str, Any] | None,
               max_positions: int) -> dict[str, Any] | None:
    """Phi-3's RoPE scaling as Phi3Config reads it: ``su`` and ``yarn`` are old names of
    ``longrope``, whose ``original_max_position_embeddings`` is the top-level key (class
    default 4096) unless the parameters give one, and whose ``factor`` defaults to
    ``max_position_embeddings`` over it (what sizes the attention factor)."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    if scaling["rope_type"] in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] == "longrope":
        orig = scaling.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings") or PHI3_ORIGINAL_POSITIONS
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("factor") is None and isinstance(orig, int) and orig > 0:
            scaling["factor"] = max_positions / orig
    scaling.pop("partial_rotary_factor", None)
    return scaling


def phi3_partial_rotary(cfg: dict[str, Any]) -> float:
    """The share of each head RoPE rotates: ``partial_rotary_factor`` of the RoPE
    parameters or the top level (Phi-4-mini: 0.75), else 1."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = cfg.get("partial_rotary_factor")
    value = 1.0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor={value!r} must be a "
                         "number in (0, 1]")
    return float(value)
