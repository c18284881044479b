"""Model hyper-parameters, read from a Hugging Face ``config.json`` or from GGUF metadata.

One dataclass covers every supported decoder (``hf_config.SUPPORTED_ARCHITECTURES``):
they differ only in switches (qkv bias, q/k norms, RoPE scaling and which layers and how
much of a head it rotates, tied embeddings, Granite's and Gemma's scalars, windows, which
layers are sparse, routing), so the model code reads those instead of branching on names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from deepinfer.gemma_config import GEMMA3, GEMMA_ARCHITECTURES, gguf_gemma_fields
from deepinfer.gguf_fields import gguf_granite_fields, gguf_moe_fields, gguf_phi3_fields
from deepinfer.hf_config import (
    GGUF_ARCHITECTURES,
    MOE_ARCHITECTURES,
    OLMO2,
    OLMO2_FIELDS,
    check_architecture,
    hf_config_fields,
)
from deepinfer.pooling_config import gguf_pooling, hf_folder_pooling
from deepinfer.smollm3_config import SMOLLM3, gguf_smollm3_fields

#: RoPE variants the rotary embedding implements.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope")

#: Each RoPE variant's required numeric parameters (``yarn`` also reads the optional
#: ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor`` and
#: ``truncate``).
ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings"),
}

@dataclass
class ModelConfig:
    """Everything the decoder needs to be built; no field depends on the runtime device.

    ``torch_dtype`` is the checkpoint's own dtype (what ``dtype="auto"`` resolves to on
    CUDA), not necessarily the dtype the model was loaded in: read that from the model's
    parameters. ``rope_scaling`` is ``None`` or a dict with a ``rope_type`` key plus that
    type's parameters (:data:`ROPE_REQUIRED_KEYS`). ``yarn`` extends the context to
    ``factor * original_max_position_embeddings`` positions (:attr:`max_positions`).
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

    ``partial_rotary_factor`` (Phi-4-mini: 0.75): RoPE rotates the first
    :attr:`rotary_dim` values of each head and leaves the rest. ``longrope`` (Phi-3.5,
    Phi-4-mini): ``short_factor`` and ``long_factor`` divide the inverse frequencies of
    positions below and from ``original_max_position_embeddings`` respectively.

    Granite's scalars (1.0 and None elsewhere: no effect): the embeddings are multiplied
    by ``embedding_multiplier``, each attention and MLP output by ``residual_multiplier``
    before its residual add, the attention scores by ``attention_multiplier`` (None: 1 /
    sqrt(head_dim)), and the logits divided by ``logits_scaling``.
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
    #: A base-model checkpoint (``LlamaModel``...: no lm_head): it embeds, never generates.
    embedding_only: bool = False
    #: The embedding pooling the checkpoint's files name (``pooling_config``; None: none).
    pooling: str | None = None
    #: The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    #: Gemma 3 (``gemma_config``): RMSNorm weights stored as offsets from 1 (folded in at
    #: load), norms after the attention and the MLP too, the sliding layers' RoPE base.
    norm_weight_offset: bool = False
    sandwich_norms: bool = False
    #: OLMo 2: no norm before the attention and the MLP, one after each.
    post_norms: bool = False
    local_rope_theta: float | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    #: The layers that slide (None: all of them, when ``sliding_window`` is set).
    sliding_layers: tuple[int, ...] | None = None
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
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    partial_rotary_factor: float = 1.0
    #: Gemma 2's soft caps ``c * tanh(x / c)`` of the attention scores and of the logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    #: The layers that apply no RoPE (SmolLM3's NoPE layers: every fourth).
    nope_layers: tuple[int, ...] = ()
    # The sampling keys of generation_config.json (SamplingParams names), unchecked.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.architecture in MOE_ARCHITECTURES:
            check_moe_counts(self.architecture, self.num_experts, self.num_experts_per_tok)
            if self.decoder_sparse_step < 1:
                raise ValueError(f"{self.architecture}: decoder_sparse_step="
                                 f"{self.decoder_sparse_step} must be >= 1")
        check_rope_scaling(self.rope_scaling)
        check_rotary_dims(self)
        if self.num_heads % self.num_kv_heads:  # HF names: an omitted key has a default
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")

    @property
    def rotary_dim(self) -> int:
        """How many values of each head RoPE rotates (the first ones): ``head_dim`` times
        ``partial_rotary_factor``, truncated as transformers does."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_positions(self) -> int:
        """How many positions the model's RoPE serves: ``max_position_embeddings``, or
        YaRN's extended length where that is longer (as vLLM counts it)."""
        s = self.rope_scaling or {}
        if s.get("rope_type") == "yarn":
            extended = int(float(s["factor"]) * int(s["original_max_position_embeddings"]))
            return max(self.max_position_embeddings, extended)
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding attention window: the positions a query
        sees, itself included (None: every earlier one)."""
        if not self.sliding_window or (self.sliding_layers is not None
                                       and layer not in self.sliding_layers):
            return None
        return self.sliding_window

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
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout), as
        transformers reads it (``deepinfer.hf_config``).

        ``generation_config`` (a parsed ``generation_config.json``) contributes extra EOS
        ids: Llama 3 instruct checkpoints list ``<|eot_id|>`` only there.
        """
        return cls(**hf_config_fields(cfg, generation_config))

    @classmethod
    def from_hf_folder(cls, folder: str) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) in ``folder``."""
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face "
                                    f"checkpoint folder)")
        cfg = read_json_object(path)
        gen_path = os.path.join(folder, "generation_config.json")
        gen = read_json_object(gen_path) if os.path.isfile(gen_path) else None
        try:
            return replace(cls.from_hf_config(cfg, gen), pooling=hf_folder_pooling(folder))
        except KeyError as e:
            raise ValueError(f"{path}: missing key {e}") from e
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_size: int | None = None,
                           tied: bool = False,
                           rope_freq_factors: tuple[float, ...] | None = None,
                           dense_layers: tuple[int, ...] = (),
                           qkv_bias: bool | None = None,
                           longrope_factors: tuple[tuple[float, ...], tuple[float, ...]]
                           | None = None) -> ModelConfig:
        """Build from GGUF key/values (already decoded to Python values).

        ``tied``: the file has no ``output.weight`` (the LM head reuses the embedding).
        ``vocab_size`` falls back to the token list length when the metadata lacks it.
        ``dense_layers``: the layers of a mixture-of-experts file that have no router
        (plain MLP). ``qkv_bias``: whether the file has q/k/v biases (None: as the
        architecture always has them, Qwen2 and Qwen2-MoE). ``longrope_factors``: a
        Phi-3 file's ``rope_factors_short`` and ``rope_factors_long`` tensors.
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

        def need(key: str) -> int:
            value = get(key)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {gguf_arch}.{key}")
            return int(value)

        if gguf_arch == "llama" and get("expert_count"):
            arch = "MixtralForCausalLM"
        moe = gguf_moe_fields(arch, get, need, dense_layers)

        hidden = need("embedding_length")
        num_heads = need("attention.head_count")
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
        # llama.cpp ends generation on the end-of-turn / end-of-message ids too: Llama 3
        # instruct files name <|eot_id|> there.
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        scalars = gguf_granite_fields(get) if arch == "GraniteForCausalLM" else {}
        head_dim = int(get("attention.key_length") or hidden // num_heads)
        if arch == "Phi3ForCausalLM":
            scaling, phi3 = gguf_phi3_fields(get, head_dim, longrope_factors)
            scalars.update(phi3)
        if arch in GEMMA_ARCHITECTURES:
            scalars.update(gguf_gemma_fields(gguf_arch, get, hidden, num_heads, head_dim,
                                             need("block_count")))
        elif arch == SMOLLM3:
            scalars.update(gguf_smollm3_fields(need("block_count")))
        elif arch == OLMO2:
            scalars.update(OLMO2_FIELDS)
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=need("block_count"),
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tied,
            pooling=gguf_pooling(get("pooling_type")),
            attention_bias=(arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                            if qkv_bias is None else qkv_bias),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", GEMMA3),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
            torch_dtype=torch.float16,
            **moe,
            **scalars,
        )


def check_moe_counts(arch: str, num_experts: int, top_k: int) -> None:
    """``ValueError`` naming ``arch`` unless ``1 <= top_k <= num_experts``."""
    if num_experts < 1:
        raise ValueError(f"{arch}: num_experts={num_experts}, a mixture-of-experts model "
                         f"needs at least one expert")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} must be between 1 and "
                         f"num_experts={num_experts}")


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """``ValueError`` naming the RoPE type or parameter that is unsupported or missing,
    or a value out of range (a factor below 1 for ``yarn``)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if scaling is None:
        return
    required = ROPE_REQUIRED_KEYS.get(rope_type, ())
    # Zero means "the default" for these, as transformers reads them (``x or default``).
    zero_ok = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    optional = zero_ok + ("attention_factor",) if rope_type == "yarn" else ()
    for key in required + optional:
        value = scaling.get(key)
        if value is None and key not in required:
            continue
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not (value >= 0 if key in zero_ok else value > 0)):
            raise ValueError(f"rope scaling {rope_type!r}: {key}={value!r} must be a "
                             f"{'non-negative' if key in zero_ok else 'positive'} number")
    if rope_type == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"rope scaling 'yarn': truncate={scaling['truncate']!r} must be "
                         "true or false")
    if rope_type == "yarn" and float(scaling["factor"]) < 1:
        raise ValueError(f"rope scaling 'yarn': factor={scaling['factor']!r} must be >= 1")


def check_rotary_dims(cfg: ModelConfig) -> None:
    """``ValueError`` naming the value unless RoPE rotates an even number of values, at
    least 2, per head, and a ``longrope`` factor list has one entry per rotated pair."""
    rot = cfg.rotary_dim
    if rot < 2 or rot % 2 or rot > cfg.head_dim:
        raise ValueError(f"{cfg.architecture}: partial_rotary_factor="
                         f"{cfg.partial_rotary_factor} rotates {rot} of head_dim "
                         f"{cfg.head_dim} values; expected an even count from 2 to head_dim")
    if rot < cfg.head_dim and (cfg.qk_norm or cfg.qk_norm_full_width):
        raise ValueError(f"{cfg.architecture}: a partial rotary with q/k norms is not "
                         "supported")
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if (not isinstance(value, (list, tuple)) or len(value) != rot // 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                           for v in value)):
            raise ValueError(f"rope scaling 'longrope': {key} must list {rot // 2} positive "
                             f"numbers (one per rotated pair of head_dim {cfg.head_dim}), "
                             f"got {value!r}"[:300])


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in file ``path``; ``ValueError`` naming the file if it is not
    valid JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
