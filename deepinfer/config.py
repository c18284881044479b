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

#: transformers' config-class defaults for the keys a ``config.json`` may omit, per
#: architecture (tests/models/test_hf_config_parity.py holds them against the classes).
#: ``sliding_window`` is a default only where the key is absent (an explicit null: none);
#: a MoE row without ``moe_intermediate_size`` has experts of ``intermediate_size``.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                             max_position_embeddings=2048),
    "MistralForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                               max_position_embeddings=131072, sliding_window=4096),
    "Qwen2ForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                             max_position_embeddings=32768),
    "Qwen3ForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                             max_position_embeddings=32768),
    "Qwen3MoeForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                                max_position_embeddings=32768, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=768),
    "MixtralForCausalLM": dict(rope_theta=1e6, rms_norm_eps=1e-5,
                               max_position_embeddings=131072, num_experts=8,
                               num_experts_per_tok=2),
    "OlmoeForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-5,
                             max_position_embeddings=4096, num_experts=64,
                             num_experts_per_tok=8),
    "Qwen2MoeForCausalLM": dict(rope_theta=1e4, rms_norm_eps=1e-6,
                                max_position_embeddings=32768, num_experts=60,
                                num_experts_per_tok=4, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632),
}

#: Activations of the gated MLP the kernels implement (transformers maps both to SiLU).
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "swish")

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
    ``attention_bias`` is the q/k/v bias, ``o_proj_bias`` the output projection's (Llama,
    Qwen3, Qwen3-MoE and OLMoE have both or neither; Qwen2 and Qwen2-MoE only the first).
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
    o_proj_bias: bool = False
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
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{arch}: hidden_act={act!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        defaults = HF_DEFAULTS[arch]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _hf_rope(cfg, defaults["rope_theta"])
        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            for i in _as_list(src.get("eos_token_id")):
                if i not in eos:
                    eos.append(int(i))
        qkv_bias, o_bias = _hf_attention_bias(arch, cfg)
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
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", defaults)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(_get(cfg, "max_position_embeddings", defaults)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_hf_sliding_window(arch, cfg),
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


def _get(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    """``cfg[key]``, or the architecture's default when the key is absent or null."""
    value = cfg.get(key)
    return defaults[key] if value is None else value


def _hf_attention_bias(arch: str, cfg: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as transformers builds the attention of ``arch``."""
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return False, False  # no bias whatever the config says
    if arch == "Qwen2ForCausalLM":
        return True, False  # hard-coded qkv bias, no switch in its config
    if arch == "Qwen2MoeForCausalLM":
        return bool(cfg.get("qkv_bias", True)), False
    bias = bool(cfg.get("attention_bias", False))  # Llama, Qwen3(-MoE), OLMoE: all four
    return bias, bias


def _hf_sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    """The attention window (None: full attention). The Qwen families only use theirs
    with ``use_sliding_window``; Mistral's key defaults to 4096 when absent (an explicit
    null means none)."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window"):
        return None
    sliding = cfg.get("sliding_window", HF_DEFAULTS[arch].get("sliding_window"))
    return int(sliding) if sliding else None


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
        "qwen2_moe": "Qwen2MoeForCausalLM",
    }.get(model_type or "", model_type)


def _hf_rope(cfg: dict[str, Any],
             default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout, as transformers merges them.

    transformers 5 writes ``rope_parameters`` (theta inside, ``rope_type`` always set);
    4.x writes top-level ``rope_theta`` plus an optional ``rope_scaling`` whose type key is
    ``rope_type`` or the older ``type``. A non-empty ``rope_scaling`` wins over
    ``rope_parameters`` (as in transformers); theta comes from the chosen dict, else the
    top-level key, else the architecture's default.
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
    return theta, {"rope_type": rope_type, **scaling}


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _first(x: Any) -> int | None:
    xs = _as_list(x)
    return int(xs[0]) if xs else None
