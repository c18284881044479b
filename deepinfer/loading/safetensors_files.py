"""Hugging Face checkpoint folders: config.json + one or more ``*.safetensors`` shards."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from deepinfer.models.tensor_parallel import Shard, check_shard_source


def safetensors_files(folder: str) -> list[str]:
    """The shard files of ``folder``, in a stable order.

    With a ``model.safetensors.index.json`` only the shards it names are read: Mistral
    repos also ship a ``consolidated.safetensors`` in another naming scheme.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard(s): {missing}")
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(f for f in glob.glob(os.path.join(folder, "*.safetensors"))
                   if not os.path.basename(f).startswith("consolidated"))
    if not files:
        raise FileNotFoundError(
            f"{folder}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


@contextlib.contextmanager
def open_shard(path: str) -> Iterator[Any]:
    """``safe_open`` on one shard; a file that is not valid safetensors (cut short,
    empty, another format) is a ``ValueError`` naming it."""
    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, or OSError for an unreadable header
        raise ValueError(f"{path}: not a valid safetensors file ({e})") from None
    with f:
        yield f


def count_tensors(files: list[str]) -> int:
    """Number of tensors over all shards (reads headers only). A tensor stored in two
    shards is a ``ValueError`` naming both: which copy to load would be a guess."""
    seen: dict[str, str] = {}
    for path in files:
        with open_shard(path) as f:
            for name in f.keys():
                other = seen.setdefault(name, path)
                if other != path:
                    raise ValueError(f"checkpoint tensor {name!r} is stored twice: in "
                                     f"{other} and {path}")
    return len(seen)


#: ``name ->`` the part of a tensor to read: a :class:`Shard` (its whole size checked
#: too) or a plain ``(dim, start, length)``; None: all of it.
ShardFn = Callable[[str], "Shard | tuple[int, int, int] | None"]


def iter_safetensors(files: list[str], shard: ShardFn | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from each shard, memory-mapped on the CPU, checkpoint dtype.

    ``shard``: a tensor-parallel rank's slice of each tensor, cut with ``get_slice``: a
    cut along rows reads only those rows; a cut along columns reads every row but keeps
    only its columns. The caller copies each one into its parameter (which casts dtype
    and moves device) and keeps no reference to the file, so a rank's memory ends up
    holding its shard, with at most one tensor's worth of extra memory live on the way.
    A :class:`Shard` cut whose whole size disagrees with the tensor's raises
    ``ValueError`` naming it (:func:`check_shard_source`), from the header alone.
    """
    for path in files:
        with open_shard(path) as f:
            for name in f.keys():
                cut = shard(name) if shard is not None else None
                if cut is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                check_shard_source(name, part.get_shape(), cut)
                dim, start, length = cut[:3]
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, part[index]
