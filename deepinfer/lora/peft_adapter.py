"""Reading a PEFT LoRA adapter folder into per-layer weights of a loaded model.

PEFT saves ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern`` / ``alpha_pattern``...) and ``adapter_model.safetensors``, whose tensors
are named ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``); the module's output gains
``scale * x @ A.T @ B.T`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

The decoder fuses q/k/v and gate/up into one Linear each, so each module's B lands on
its rows of the fused layer: per layer, the adapter is one ``A [R, in]`` (the parts' A
stacked) and one ``B [out, R]`` (each part's B, scaled, in its rows and its rank's
columns; zeros elsewhere), and the delta is one pair of products. B goes through the
same reading as a checkpoint weight (``checkpoint_parts``): Phi-3's fused tensors are
split, a partial rotary's q/k rows reordered.

Supported: the attention projections (q/k/v/o, or Phi-3's fused qkv) and the dense MLP
(gate/up/down) of every architecture the engine loads. Anything else an adapter trains
(embeddings, lm_head, MoE experts, biases, DoRA magnitudes, ``modules_to_save``) is a
``ValueError`` naming it: served without it, the adapter would silently be another
model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.loading.checkpoint_parts import checkpoint_parts
from deepinfer.models.parallel_layers import Linear
from deepinfer.models.tensor_parallel import SINGLE

__all__ = ["AdapterConfig", "LoRALayerWeights", "read_adapter_config", "read_peft_adapter"]

_PREFIX = "base_model.model."
# PEFT names the adapter in memory (``lora_A.default.weight``), not in saved files.
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_TARGETS = (".self_attn.qkv_proj", ".self_attn.o_proj", ".mlp.gate_up_proj",
            ".mlp.down_proj")
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` that set the scales."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict

    def scale(self, module: str, rank: int) -> float:
        """The delta's factor for ``module`` (its name in the model) of rank ``rank``."""
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def rank(self, module: str) -> int:
        """The rank the config gives ``module``."""
        return int(_pattern_value(self.rank_pattern, module, self.r))


@dataclass(frozen=True)
class LoRALayerWeights:
    """One Linear's adapter: ``a [R, in]``, ``b [out, R]`` (scale folded into b)."""

    a: torch.Tensor
    b: torch.Tensor


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches
    the end of the module's dotted name, as a regular expression."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def read_adapter_config(path: str) -> AdapterConfig:
    """The adapter folder's ``adapter_config.json``; ``ValueError`` naming the folder and
    the field when it is not a LoRA adapter this engine serves."""
    where = f"LoRA adapter {path!r}"
    if not os.path.isdir(path):
        raise ValueError(f"{where}: not a folder (a PEFT adapter folder holds "
                         "adapter_config.json and adapter_model.safetensors)")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{where}: no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: adapter_config.json is not readable JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{where}: peft_type {kind!r}; only LORA adapters are served")
    for flag, what in (("use_dora", "DoRA"), ("lora_bias", "trained LoRA biases"),
                       ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)")):
        if cfg.get(flag):
            raise ValueError(f"{where}: {flag} is set: {what} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg['bias']!r} trains the base model's biases; "
                         "only bias='none' adapters are supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']!r} are whole "
                         "trained copies of base modules, which are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    patterns = {k: cfg.get(k) or {} for k in ("rank_pattern", "alpha_pattern")}
    for k, v in patterns.items():
        if not isinstance(v, dict):
            raise ValueError(f"{where}: {k} must be an object, got {v!r}")
    return AdapterConfig(r, float(alpha), bool(cfg.get("use_rslora", False)),
                         patterns["rank_pattern"], patterns["alpha_pattern"])


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(f)
        return torch.load(f, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r}: no {' or '.join(_WEIGHT_FILES)}")


def _pairs(path: str, tensors: dict[str, torch.Tensor]
           ) -> dict[str, dict[str, tuple[str, torch.Tensor]]]:
    """module name -> {"A"/"B": (tensor's name in the file, tensor)}."""
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA A or B "
                             "weight (embedding LoRA, DoRA magnitudes and trained copies "
                             "of base modules are not supported)")
        pairs.setdefault(m["module"], {})[m["which"]] = (key, t)
    for ab in pairs.values():
        if len(ab) != 2:
            have = next(iter(ab.values()))[0]
            raise ValueError(f"LoRA adapter {path!r}: tensor {have!r} has no "
                             f"lora_{'B' if 'A' in ab else 'A'} partner")
    return pairs


def read_peft_adapter(path: str, model: nn.Module, max_rank: int, dtype: torch.dtype,
                      device: torch.device) -> dict[str, LoRALayerWeights]:
    """The adapter at ``path`` for ``model`` (a loaded ``LlamaForCausalLM``): Linear
    module name -> its :class:`LoRALayerWeights` in ``dtype`` on ``device``.
    ``ValueError`` naming the folder and the tensor or field that does not fit: a rank
    over ``max_rank``, a module the engine does not adapt, a shape that is not the
    layer's."""
    cfg = read_adapter_config(path)
    pairs = _pairs(path, _read_tensors(path))
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: no LoRA tensors")
    modules = dict(model.named_modules())
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for module, ab in sorted(pairs.items()):
        (a_key, a), (b_key, b) = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {path!r}: tensors {a_key!r} {tuple(a.shape)} "
                             f"and {b_key!r} {tuple(b.shape)} are not a rank-r pair "
                             "[r, in], [out, r]")
        if rank != cfg.rank(module):
            raise ValueError(f"LoRA adapter {path!r}: tensor {a_key!r} has rank {rank}, "
                             f"adapter_config.json gives {module!r} rank {cfg.rank(module)}")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: tensor {a_key!r} has rank {rank}, "
                             f"over max_lora_rank={max_rank}")
        scale = cfg.scale(module, rank)
        for part_name, b_part in checkpoint_parts([(f"{module}.weight", b)],
                                                  model.config, SINGLE):
            target, offset, rows = model.fused_target(part_name)
            layer_name = target.removesuffix(".weight")
            layer = modules.get(layer_name)
            if not isinstance(layer, Linear) or not layer_name.endswith(_TARGETS):
                raise ValueError(
                    f"LoRA adapter {path!r}: tensor {b_key!r} adapts {module!r}, which is "
                    f"not an attention or dense MLP projection of this "
                    f"{model.config.architecture} model (those are what LoRA adapts here)")
            want_rows = layer.out_features if offset is None else rows
            if a.shape[1] != layer.in_features or b_part.shape[0] != want_rows:
                raise ValueError(
                    f"LoRA adapter {path!r}: tensors {a_key!r} {tuple(a.shape)} and "
                    f"{b_key!r} {tuple(b.shape)} do not fit {module!r} "
                    f"({layer.in_features} inputs, {want_rows} outputs)")
            parts.setdefault(layer_name, []).append(
                (offset or 0, a, b_part.float() * scale))
    return {name: _stacked(ps, modules[name], dtype, device) for name, ps in parts.items()}


def _stacked(parts: list[tuple[int, torch.Tensor, torch.Tensor]], layer: Linear,
             dtype: torch.dtype, device: torch.device) -> LoRALayerWeights:
    """The parts of one (fused) Linear as one ``A [R, in]`` and ``B [out, R]``."""
    total = sum(a.shape[0] for _, a, _ in parts)
    a_all = torch.cat([a.float() for _, a, _ in parts]).to(dtype=dtype, device=device)
    b_all = torch.zeros(layer.out_features, total, dtype=torch.float32)
    col = 0
    for row, a, b in parts:
        b_all[row:row + b.shape[0], col:col + a.shape[0]] = b
        col += a.shape[0]
    return LoRALayerWeights(a_all.contiguous(), b_all.to(dtype=dtype, device=device))
