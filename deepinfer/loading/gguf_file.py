"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors -> dequantized HF-named weights.

Two layout facts matter:

* GGUF records shapes in ggml ``ne`` order (fastest dim first), the reverse of torch;
  the reader (``gguf_reader``) gives numpy arrays in row-major order, and dequantization
  returns ``[rows, cols]`` = torch's ``[out, in]``.
* llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of *llama*-architecture
  models (each head's two rotary halves interleaved, for its GPT-J-style RoPE). The model
  uses HF's rotate-half layout, so that permutation is undone here (Mixtral is a llama
  file with experts; Granite's and SmolLM3's converters are the llama one). Qwen2/Qwen3
  (and their MoE), OLMoE, OLMo 2 and Gemma 2/3 files are written unpermuted.

Mixture-of-experts files hold each layer's experts stacked, ``ffn_{gate,up}_exps``
``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]`` (older Mixtral files: one
``ffn_{gate,up,down}.{e}`` tensor per expert), the router as ``ffn_gate_inp`` and
Qwen2-MoE's shared expert as ``ffn_*_shexp``; they are yielded under the per-expert HF
names the model's loader places.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from deepinfer.config import ModelConfig
from deepinfer.loading.checkpoint_parts import fused_part_names
from deepinfer.loading.gguf_dequant import dequantize
from deepinfer.loading.gguf_reader import GGUFFile
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS

Q = GGMLQuantizationType

#: Tensor types this loader dequantizes (all through ``gguf.quants``).
SUPPORTED_GGUF_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

# Metadata arrays that are big and not needed for the model config.
_SKIP_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_qkv": "self_attn.qkv_proj",
}
#: Where an architecture's files name a layer's tensors otherwise: Phi-3 stores gate and
#: up as one ``ffn_up`` tensor (gate rows first); Gemma 2 and 3 have a norm before and
#: after both the attention and the MLP, ``ffn_norm`` the one before the MLP; OLMo 2 the
#: ones after only.
_NORMS_AFTER = {"post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_NAMES = {**_LAYER_NAMES, **_NORMS_AFTER, "ffn_norm": "pre_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "phi3": {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
    "olmo2": {**_LAYER_NAMES, **_NORMS_AFTER},
}
#: Tensors folded into the config: Llama 3.1's frequency divisors, Phi-3's LongRoPE factors.
_CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
#: Stacked expert tensors ``[E, ...]`` -> the per-expert projection of each slice.
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}
#: Older Mixtral files: one tensor per expert, ``blk.{i}.ffn_{gate,up,down}.{e}.weight``.
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def check_gguf_type(tensor_name: str, qtype: GGMLQuantizationType | int) -> None:
    """``ValueError`` naming the tensor and its type if this loader cannot dequantize it."""
    qtype = Q(qtype)
    if qtype not in SUPPORTED_GGUF_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
        raise ValueError(f"GGUF tensor {tensor_name!r} has unsupported quantization "
                         f"{qtype.name}; supported: {names}")


def read_metadata(gguf: GGUFFile) -> dict[str, Any]:
    """Key-values as Python values, the tokenizer's big arrays left out."""
    return {k: v for k, v in gguf.metadata.items() if k not in _SKIP_FIELDS}


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The :class:`ModelConfig` of an opened GGUF file."""
    meta = read_metadata(gguf)
    names = {t.name: t for t in gguf.tensors}
    vocab = None
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens)
    elif "token_embd.weight" in names:
        vocab = int(names["token_embd.weight"].shape[-1])
    def floats(name: str) -> tuple[float, ...] | None:
        t = names.get(name)
        return None if t is None else tuple(float(x) for x in tensor_to_numpy(t).ravel())

    freq = floats("rope_freqs.weight")
    longrope = (floats("rope_factors_short.weight"), floats("rope_factors_long.weight"))
    # A MoE file's layers without a router are dense (llama.cpp's own MoE graphs have
    # none such; files written from checkpoints with mlp_only_layers do).
    layers = int(meta.get(f"{meta.get('general.architecture')}.block_count") or 0)
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    return ModelConfig.from_gguf_metadata(
        meta, vocab_size=vocab, tied="output.weight" not in names, rope_freq_factors=freq,
        dense_layers=dense if len(dense) < layers else (),
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        longrope_factors=longrope if None not in longrope else None)


def tensor_to_numpy(t: Any) -> np.ndarray:
    """Dequantize one ``GGUFTensor`` to a float32 array in torch (row-major) shape."""
    check_gguf_type(t.name, t.tensor_type)
    qtype = Q(t.tensor_type)
    if qtype in (Q.F32, Q.F16):
        arr = np.array(t.data, dtype=np.float32)  # copy: the memmap is read-only
    else:
        arr = dequantize(t.data, qtype)
    # ``t.shape`` is the ggml ``ne`` order: reversed, it is the torch shape.
    return arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows ``(half, pair)`` interleaved
    back to ``(pair, half)``. Works for weights ``[out, in]`` and biases ``[out]``."""
    out = w.shape[0]
    return (w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def hf_name(gguf_name: str, arch: str = "") -> str | None:
    """HF parameter name of a GGUF tensor of a file of llama.cpp architecture ``arch``
    (``None`` for tensors with no parameter; a stacked expert tensor's name ends in
    ``experts.{}.<proj>.weight``, ``{}`` the expert)."""
    m = _PER_EXPERT_RE.fullmatch(gguf_name)
    if m:
        layer, proj, e = m.groups()
        return f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m[2] in _EXPERT_STACKS and m[3] == "weight":
        return f"model.layers.{m[1]}.mlp.experts.{{}}.{_EXPERT_STACKS[m[2]]}.weight"
    if m:
        layer, part, kind = m.groups()
        names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
        if part not in names:
            raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported decoder")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _CONFIG_TENSORS:
        return None  # folded into the config (rope_freq_factors, LongRoPE's factors)
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported decoder")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def quantized_plan(gguf: GGUFFile, kernel_types: frozenset[int],
                   expert_types: frozenset[int] = frozenset()
                   ) -> tuple[dict[str, int], set[str]]:
    """Which weights can stay GGUF blocks: ``({hf_name: ggml type id}, names of the block
    types found without a kernel)``. Candidates are the weights of block types (not
    F32/F16/BF16) that land in one Linear or embedding, and the experts (per expert, a
    stacked tensor's slices each named) where their type is in ``expert_types``;
    Qwen2-MoE's vector-shaped shared-expert gate is left out. A candidate whose type has
    no kernel is dequantized instead (experts on a device with no expert kernels at all
    are named in the second set as ``"<type> experts"``)."""
    plan: dict[str, int] = {}
    missing: set[str] = set()
    arch = gguf.metadata.get("general.architecture", "")
    for t in gguf.tensors:
        qtype = Q(t.tensor_type)
        if int(qtype) not in BLOCK_FORMATS:
            continue
        name = hf_name(t.name, arch)
        if name is None or name.endswith("shared_expert_gate.weight"):
            continue
        if "{}" in name or ".experts." in name:
            if not expert_types:
                missing.add(f"{qtype.name} experts")
                continue
            names = ([name.format(e) for e in range(int(t.shape[-1]))] if "{}" in name
                     else [name])
            types = expert_types
        elif len(t.shape) == 2:
            names, types = fused_part_names(name), kernel_types  # Phi-3's: its parts
        else:
            continue
        if int(qtype) in types:
            plan.update(dict.fromkeys(names, int(qtype)))
        else:
            missing.add(qtype.name)
    return plan, missing


def iter_gguf(gguf: GGUFFile, cfg: ModelConfig, keep: Container[str] = ()
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight, q/k rows un-permuted, stacked experts
    one slice each: float32, or for the names in ``keep`` the raw blocks, uint8
    ``[rows, row_bytes]`` (a copy: the file's map is not held)."""
    arch = gguf.metadata["general.architecture"]
    # llama.cpp's converter permutes q/k of llama files, and of granite and smollm3 ones.
    llama = arch in ("llama", "granite", "smollm3")
    for t in gguf.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        if (fused_part_names(name)[0] in keep
                or ("{}" in name and name.format(0) in keep)):
            w = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
        else:
            w = torch.from_numpy(np.ascontiguousarray(tensor_to_numpy(t)))
        if llama and ".q_proj." in name:
            w = unpermute_rotary(w, cfg.num_heads)
        elif llama and ".k_proj." in name:
            w = unpermute_rotary(w, cfg.num_kv_heads)
        elif name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # stored as a vector; HF's Linear(hidden, 1)
        if "{}" in name:
            if w.dim() != 3:
                raise ValueError(f"GGUF tensor {t.name!r}: shape {tuple(w.shape)}, expected "
                                 f"[experts, rows, cols]")
            for e in range(w.shape[0]):
                yield name.format(e), w[e]
            continue
        yield name, w


def count_gguf_weights(gguf: GGUFFile) -> int:
    """How many tensors :func:`iter_gguf` yields (a stacked expert tensor: one each)."""
    n = 0
    for t in gguf.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        n += int(t.shape[-1]) if m and m[2] in _EXPERT_STACKS else 1
    return n


def check_gguf_types(gguf: GGUFFile) -> None:
    """Fail before allocating the model if any tensor cannot be dequantized."""
    for t in gguf.tensors:
        check_gguf_type(t.name, t.tensor_type)
