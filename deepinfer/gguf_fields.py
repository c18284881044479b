"""Per-architecture GGUF metadata as ``ModelConfig`` fields, read as llama.cpp reads its
keys (``{arch}.<key>``): Phi-3's RoPE and window, Granite's scalars, the MoE counts and
routing. ``get(key)`` / ``need(key)`` read ``{arch}.{key}`` (``need``: a ``ValueError``
naming it if absent)."""

from __future__ import annotations

from typing import Any

from deepinfer.hf_config import GGUF_EXPERT_WEIGHTS_NORM, MOE_ARCHITECTURES

__all__ = ["gguf_granite_fields", "gguf_moe_fields", "gguf_phi3_fields"]


def gguf_phi3_fields(get: Any, head_dim: int,
                     longrope: tuple[tuple[float, ...], tuple[float, ...]] | None
                     ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A Phi-3 file's RoPE scaling and fields, from llama.cpp's keys: LongRoPE from the
    factor tensors, ``rope.scaling.original_context_length`` (absent: the context length)
    and ``rope.scaling.attn_factor``; the rotary width ``rope.dimension_count``
    (Phi-4-mini: 3/4 of a head); ``attention.sliding_window`` (0 or absent: none)."""
    fields: dict[str, Any] = {}
    rot = get("rope.dimension_count")
    if rot:
        fields["partial_rotary_factor"] = int(rot) / head_dim
    window = get("attention.sliding_window")
    if window:
        fields["sliding_window"] = int(window)
    if longrope is None:
        return None, fields
    ctx = int(get("context_length", 4096))
    orig = int(get("rope.scaling.original_context_length") or ctx)
    scaling: dict[str, Any] = {
        "rope_type": "longrope", "short_factor": list(longrope[0]),
        "long_factor": list(longrope[1]), "original_max_position_embeddings": orig,
        "factor": ctx / orig}
    if get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
    return scaling, fields


def gguf_granite_fields(get: Any) -> dict[str, Any]:
    """Granite's scalars from llama.cpp's keys, as llama.cpp applies them:
    ``embedding_scale``, ``residual_scale``, ``logit_scale`` (logits divided by it) and
    ``attention.scale`` (0 or absent: 1 / sqrt(head_dim)); an absent scale is 1."""
    out: dict[str, Any] = {}
    for field_name, key in (("embedding_multiplier", "embedding_scale"),
                            ("residual_multiplier", "residual_scale"),
                            ("logits_scaling", "logit_scale"),
                            ("attention_multiplier", "attention.scale")):
        value = get(key)
        if value is None or (field_name == "attention_multiplier" and float(value) == 0):
            continue
        if not 0 < float(value) < float("inf"):
            raise ValueError(f"GGUF metadata granite.{key}={value!r} must be a positive "
                             "number")
        out[field_name] = float(value)
    return out


def gguf_moe_fields(arch: str, get: Any, need: Any, dense_layers: tuple[int, ...]
                    ) -> dict[str, Any]:
    """The MoE fields of a GGUF file's :class:`ModelConfig` (``{}`` for a dense ``arch``),
    from llama.cpp's keys: ``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length`` (else ``feed_forward_length``, as Mixtral's and OLMoE's
    experts, or for the Qwen MoE files written before that key, a ``expert_used_count``-th
    of it, as llama.cpp reads them),
    ``expert_shared_feed_forward_length``, ``expert_weights_norm`` (absent: llama.cpp's
    choice for the architecture) and OLMoE's ``attention.clamp_kqv``. ``get(key)`` /
    ``need(key)`` read ``{arch}.{key}`` (``need``: a ``ValueError`` naming it if absent)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    norm = get("expert_weights_norm")
    top_k = need("expert_used_count")
    width = get("expert_feed_forward_length")
    if not width:  # as llama.cpp reads files written before the key existed
        width = need("feed_forward_length")
        if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            width //= top_k
    out: dict[str, Any] = dict(
        num_experts=need("expert_count"),
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(width),
        norm_topk_prob=GGUF_EXPERT_WEIGHTS_NORM[arch] if norm is None else bool(norm),
        mlp_only_layers=tuple(dense_layers),
    )
    if arch == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = int(
            get("expert_shared_feed_forward_length") or need("feed_forward_length"))
    if arch == "OlmoeForCausalLM":
        clip = get("attention.clamp_kqv")
        out.update(qk_norm_full_width=True, clip_qkv=None if clip is None else float(clip))
    return out
