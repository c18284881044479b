"""One rank's device side: the model (or its tensor-parallel shard) loaded on a device,
the KV cache and the runner. The engine builds one for itself; a TP follower builds one
and runs the steps its leader sends (``run_follower``) until the leader says stop."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.engine_args import EngineArgs
from deepinfer.kv_cache_spec import KVCacheSpec
from deepinfer.loading.loader import load_model, resolve_model_path
from deepinfer.model_runner import ModelRunner
from deepinfer.models.backend import KernelBackend
from deepinfer.models.tensor_parallel import SINGLE, TPGroup
from deepinfer.step_channel import StepChannel
from deepinfer_kernels.kv_quant import KV_GROUP


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when available, else CPU. Raises ``ValueError`` naming ``device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'auto', 'cpu' or 'cuda[:N]'")
    return dev


def resolve_backend(name: str, device: torch.device) -> KernelBackend:
    """``auto``: Triton on CUDA, torch on CPU; ``triton`` on CPU interprets. Each choice is
    a module of ``deepinfer_kernels`` that provides the declared ops (``KernelBackend``).

    ``torch`` runs ``deepinfer_kernels.cpu_backend`` on the CPU (the reference's
    signatures, made fast there: decode attention in C) and the plain reference on a GPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        if device.type == "cpu":
            from deepinfer_kernels import cpu_backend, cpu_native

            # Built (or found in the cache) now: a first build takes ~1-2 s, better at
            # start-up than as a stall inside the first decode step.
            cpu_native.native_library()
            return cpu_backend
        from deepinfer_kernels import reference

        return reference
    if name == "triton":
        import deepinfer_kernels

        return deepinfer_kernels
    raise ValueError(f"attention_backend={name!r}: expected 'auto', 'triton' or 'torch'")


@dataclass
class TensorParallel:
    """A rank's tensor-parallel wiring: its group and the leader's step channel."""

    group: TPGroup
    channel: StepChannel


@dataclass
class Worker:
    """What ``build_worker`` made: the model, its config, and the runner over it."""

    device: torch.device
    backend: KernelBackend
    model_path: str
    model: nn.Module
    config: ModelConfig
    dtype: torch.dtype
    max_model_len: int
    spec: KVCacheSpec
    runner: ModelRunner


def model_len_limit(cfg: ModelConfig, requested: int | None) -> int:
    """``max_model_len``: the requested one (checked against the model) or the model's,
    at most 8192. ``ValueError`` when the request exceeds the model's positions."""
    limit = cfg.max_positions
    max_len = requested or min(limit, 8192)
    if max_len > limit:
        raise ValueError(
            f"max_model_len={max_len} exceeds the model's limit of {limit} "
            "positions (max_position_embeddings or YaRN's extended length)"
        )
    return max_len


def build_worker(args: EngineArgs, tp: TensorParallel | None = None,
                 capture_graphs: bool = True) -> Worker:
    """Load ``args.model`` (this rank's shard under ``tp``) and build its runner.
    ``capture_graphs``: unless ``args.enforce_eager`` (a prompt-only engine never
    decodes and passes False)."""
    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is not None:
        # Triton launches, CUDA graph capture and the launch buffers' streams all use the
        # current device: it must be the engine's (cuda:1 would otherwise run on cuda:0).
        torch.cuda.set_device(device)
    backend = resolve_backend(args.attention_backend, device)
    # Only the Triton ops are graph-safe: the torch reference's ops sync the host
    # (boolean indexing) and gather whole block tables, so that backend runs eagerly.
    triton = isinstance(backend, ModuleType) and backend.__name__ == "deepinfer_kernels"
    path = resolve_model_path(args.model)
    group = tp.group if tp is not None else SINGLE
    model, cfg = load_model(path, dtype=args.dtype, device=str(device), tp=group,
                            quantization=args.quantization,
                            prepack_weights=args.prepack_weights)
    max_len = model_len_limit(cfg, args.max_model_len)
    if args.kv_cache_dtype == "int8" and cfg.head_dim % KV_GROUP:
        raise ValueError(f"kv_cache_dtype='int8' needs a head_dim that is a multiple of "
                         f"{KV_GROUP} (a scale per {KV_GROUP} values); this model's is "
                         f"{cfg.head_dim}")
    on_cuda = device.type == "cuda"
    spec = KVCacheSpec(
        block_size=args.block_size,
        max_num_seqs=args.num_seqs(),
        max_model_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens or (8192 if on_cuda else 2048),
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    dtype = model.activation_dtype
    graphs = capture_graphs and not args.enforce_eager and triton
    runner = ModelRunner(
        model, cfg, device=device, dtype=dtype, backend=backend, spec=spec,
        capture_graphs=graphs, tp=group,
        channel=tp.channel if tp is not None else None, seed=args.seed,
    )
    return Worker(device, backend, path, model, cfg, dtype, max_len, spec, runner)


def run_follower(args: EngineArgs, tp: TensorParallel) -> int:
    """A TP follower: build this rank's shard, then run every step the leader sends
    until it says stop. Returns the number of steps run."""
    worker = build_worker(args, tp, capture_graphs=args.engine_type.lower() != "prompt")
    runner, channel = worker.runner, tp.channel
    steps = 0
    while (step := channel.recv()) is not None:
        runner.follow(step)
        steps += 1
    runner.release_graphs()  # before the caller destroys the group they captured
    return steps
