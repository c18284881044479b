"""Model hyper-parameters, read from a Hugging Face ``config.json`` or from GGUF metadata.

One dataclass covers every supported decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and
the mixture-of-experts Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE): they differ only in a few
switches (qkv bias, per-head or full-width q/k RMSNorm, RoPE scaling, tied embeddings,
which layers are sparse, routing renormalisation, a shared expert), so the model code
reads those switches instead of branching on names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

#: HF ``architectures`` names the engine can run (all share one decoder implementation).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
)

#: The mixture-of-experts subset of :data:`SUPPORTED_ARCHITECTURES`.
MOE_ARCHITECTURES: tuple[str, ...] = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
)

#: GGUF ``general.architecture`` -> HF architecture. Mistral GGUFs are written as "llama".
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: RoPE variants the rotary embedding implements.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    """Everything the decoder needs to be built; no field depends on the runtime device.

    ``torch_dtype`` is the checkpoint's own dtype (what ``dtype="auto"`` resolves to on
    CUDA), not necessarily the dtype the model was loaded in: read that from the model's
    parameters. ``rope_scaling`` is ``None`` or a dict with a ``rope_type`` key plus that
    type's parameters (``factor``; for ``llama3`` also ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings``).
    ``rope_freq_factors`` (GGUF ``rope_freqs.weight``) divides the inverse frequencies
    elementwise: that is how llama.cpp files store Llama 3.1 scaling.

    Mixture of experts (``num_experts > 0``): a layer ``i`` is sparse unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (see
    :meth:`is_moe_layer`); its experts have ``moe_intermediate_size``, the router keeps
    ``num_experts_per_tok`` of them, renormalised when ``norm_topk_prob``; a
    ``shared_expert_intermediate_size > 0`` adds Qwen2-MoE's sigmoid-gated shared expert.
    ``qk_norm_full_width`` (OLMoE) normalises q and k over the whole projection instead
    of per head; ``clip_qkv`` clamps q, k and v to ``[-clip, clip]`` after that.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: torch.dtype = torch.float32
    qk_norm_full_width: bool = False
    clip_qkv: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.architecture in MOE_ARCHITECTURES:
            check_moe_counts(self.architecture, self.num_experts, self.num_experts_per_tok)
            if self.decoder_sparse_step < 1:
                raise ValueError(f"{self.architecture}: decoder_sparse_step="
                                 f"{self.decoder_sparse_step} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has a sparse MoE block."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (``None`` if the checkpoint names none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any],
                       generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        ``generation_config`` (a parsed ``generation_config.json``) contributes extra EOS
        ids: Llama 3 instruct checkpoints list ``<|eot_id|>`` only there.
        """
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        check_architecture(arch)
        if cfg.get("mlp_bias"):
            raise ValueError(f"{arch}: mlp_bias=true is not supported")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _hf_rope(cfg)
        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            for i in _as_list(src.get("eos_token_id")):
                if i not in eos:
                    eos.append(int(i))
        # Qwen2 hard-codes a qkv bias (its config has no switch); Qwen3 and Llama read
        # ``attention_bias``.
        bias = True if arch == "Qwen2ForCausalLM" else bool(cfg.get("attention_bias", False))
        if arch == "Qwen2MoeForCausalLM":
            bias = bool(cfg.get("qkv_bias", True))
        sliding = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                    "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window"):
            sliding = None
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=_first(cfg.get("bos_token_id")),
            eos_token_ids=tuple(eos),
            torch_dtype=_DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            **_hf_moe(arch, cfg),
        )

    @classmethod
    def from_hf_folder(cls, folder: str) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) in ``folder``."""
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face "
                                    f"checkpoint folder)")
        with open(path) as f:
            cfg = json.load(f)
        gen_path = os.path.join(folder, "generation_config.json")
        gen = None
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        try:
            return cls.from_hf_config(cfg, gen)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_size: int | None = None,
                           tied: bool = False,
                           rope_freq_factors: tuple[float, ...] | None = None) -> ModelConfig:
        """Build from GGUF key/values (already decoded to Python values).

        ``tied``: the file has no ``output.weight`` (the LM head reuses the embedding).
        ``vocab_size`` falls back to the token list length when the metadata lacks it.
        """
        gguf_arch = meta.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {gguf_arch!r} is not supported; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        arch = GGUF_ARCHITECTURES[gguf_arch]

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{gguf_arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv = get("attention.head_count_kv") or num_heads
        scaling = None
        stype = get("rope.scaling.type")
        if stype and stype != "none":
            if stype != "linear":
                raise ValueError(f"GGUF rope scaling type {stype!r} is not supported")
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        vocab = get("vocab_size") or vocab_size
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=int(get("attention.key_length") or hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tied,
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=_first(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=() if eos is None else (int(eos),),
            torch_dtype=torch.float16,
        )


def check_architecture(arch: str | None) -> None:
    """Raise ``ValueError`` naming ``arch`` and the supported ones if it is unknown."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (GGUF: {', '.join(GGUF_ARCHITECTURES)})"
        )


def check_moe_counts(arch: str, num_experts: int, top_k: int) -> None:
    """``ValueError`` naming ``arch`` unless ``1 <= top_k <= num_experts``."""
    if num_experts < 1:
        raise ValueError(f"{arch}: num_experts={num_experts}, a mixture-of-experts model "
                         f"needs at least one expert")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} must be between 1 and "
                         f"num_experts={num_experts}")


def _hf_moe(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig` from an HF config (``{}`` for dense ones).

    transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``; Mixtral and
    OLMoE experts have ``intermediate_size``; Mixtral always renormalises its top-k.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = cfg.get("num_experts")
    if experts is None:
        experts = cfg.get("num_local_experts", 0)
    out: dict[str, Any] = dict(
        num_experts=int(experts or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size")
                                  or cfg["intermediate_size"]),
        norm_topk_prob=True if arch == "MixtralForCausalLM"
        else bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )
    if arch == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = int(
            cfg.get("shared_expert_intermediate_size") or 0)
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
        "qwen2_moe": "Qwen2MoeForCausalLM",
    }.get(model_type or "", model_type)


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout.

    transformers 5 writes ``rope_parameters`` (theta inside, ``rope_type`` always set);
    4.x writes top-level ``rope_theta`` plus an optional ``rope_scaling`` whose type key is
    ``rope_type`` or the older ``type``.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = dict(params)
        theta = float(scaling.pop("rope_theta"))
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if not scaling:
        return theta, None
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _first(x: Any) -> int | None:
    xs = _as_list(x)
    return int(xs[0]) if xs else None
