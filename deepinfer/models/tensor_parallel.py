"""Tensor parallelism inside one model: who this rank is in its TP group, which slice of
each checkpoint tensor it holds, and the two collectives the layers need.

Megatron's split: q/k/v and gate/up are column-parallel (each rank holds a block of
output rows: its heads, its share of the intermediate size), o_proj and down_proj are
row-parallel (the matching block of input columns, partial sums all-reduced), the
embedding and the LM head are vocab-parallel (a block of vocabulary rows). When the TP
size exceeds the number of KV heads, KV heads are replicated: rank ``r`` holds KV head
``r // (tp / num_kv_heads)``, the one its query heads read. Norms, RoPE and routers are
whole on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from deepinfer.config import ModelConfig
from deepinfer_kernels.gguf_blocks import block_format


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group. ``group``: the
    ``torch.distributed`` group of the device collectives (NCCL on CUDA, gloo on CPU;
    None when ``size == 1``). Rank 0 of the group schedules and samples."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (the identity when alone)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the group (host int)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64,
                         device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_to_leader(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x [N, C]`` from every rank -> ``[N, size * C]`` (rank order along the last
        dim) on the leader, None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.leader else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=-1) if self.leader else None


SINGLE = TPGroup()


def _collective_device(group: Any) -> torch.device:
    """Where a group's tensors live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------- sizes
def tp_size_errors(cfg: ModelConfig, tp: int) -> list[str]:
    """What keeps ``cfg`` from splitting over ``tp`` ranks (empty: it splits)."""
    if tp == 1:
        return []
    errors = []

    def need(name: str, value: int) -> None:
        if value % tp:
            errors.append(f"{name}={value} is not divisible by {tp}")

    need("num_attention_heads", cfg.num_heads)
    if tp <= cfg.num_kv_heads:
        need("num_key_value_heads", cfg.num_kv_heads)
    elif tp % cfg.num_kv_heads:
        errors.append(f"{tp} ranks cannot share num_key_value_heads={cfg.num_kv_heads} "
                      f"evenly (a KV head is replicated only when the TP size is a "
                      f"multiple of it)")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):  # a dense MLP uses it
        need("intermediate_size", cfg.intermediate_size)
    need("vocab_size", cfg.vocab_size)
    if cfg.num_experts:
        need("moe_intermediate_size", cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            need("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)
    return errors


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` naming each dimension that does not split over ``tp`` ranks
    and the TP sizes that would work."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r}: expected a positive integer")
    errors = tp_size_errors(cfg, tp)
    if errors:
        ok = [t for t in range(1, cfg.num_heads + 1) if not tp_size_errors(cfg, t)]
        raise ValueError(f"tensor_parallel_size={tp} does not fit {cfg.architecture}: "
                         f"{'; '.join(errors)}. Sizes that work: "
                         f"{', '.join(map(str, ok))}")


@dataclass(frozen=True)
class LocalSizes:
    """The per-rank sizes of a model split over a TP group."""

    num_heads: int
    num_kv_heads: int
    kv_head_start: int  # first global KV head this rank holds
    intermediate_size: int
    vocab_size: int
    vocab_start: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int


def local_sizes(cfg: ModelConfig, tp: TPGroup) -> LocalSizes:
    """This rank's share (``check_tp_size`` must have passed)."""
    n, r = tp.size, tp.rank
    if n <= cfg.num_kv_heads:
        kv = cfg.num_kv_heads // n
        kv_start = r * kv
    else:  # replicated: the KV head that this rank's query heads read
        kv, kv_start = 1, r // (n // cfg.num_kv_heads)
    vocab = cfg.vocab_size // n
    return LocalSizes(cfg.num_heads // n, kv, kv_start, cfg.intermediate_size // n,
                      vocab, r * vocab, cfg.moe_intermediate_size // n,
                      cfg.shared_expert_intermediate_size // n)


# ---------------------------------------------------------------------------- shards
#: Checkpoint name pattern -> (split dim, what is split); the first match wins, so the
#: expert and shared-expert projections come before the dense MLP's.
_SPLITS = tuple((re.compile(p), dim, what) for p, dim, what in (
    (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$", 0, "expert"),
    (r"\.experts\.\d+\.(down_proj|w2)\.weight$", 1, "expert"),
    (r"\.experts\.down_proj(\.weight)?$", 2, "expert"),  # stacked [E, H, I]
    (r"\.shared_expert\.(gate_proj|up_proj)\.weight$", 0, "shared"),
    (r"\.shared_expert\.down_proj\.weight$", 1, "shared"),
    (r"\.q_proj\.", 0, "q"), (r"\.k_proj\.", 0, "kv"), (r"\.v_proj\.", 0, "kv"),
    (r"\.q_norm\.weight$", 0, "q_wide"), (r"\.k_norm\.weight$", 0, "kv_wide"),
    (r"\.o_proj\.weight$", 1, "q"),  # not its bias: whole, added after the all-reduce
    (r"\.(gate_proj|up_proj)\.weight$", 0, "ffn"), (r"\.down_proj\.weight$", 1, "ffn"),
    (r"embed_tokens\.weight$", 0, "vocab"), (r"^lm_head\.weight$", 0, "vocab"),
))


class Shard(NamedTuple):
    """The part of a checkpoint tensor one rank holds: ``length`` entries from ``start``
    along ``dim``, of the ``full`` size the config implies there (``source`` says which
    config sizes, for errors)."""

    dim: int
    start: int
    length: int
    full: int
    source: str


def shard_slice(name: str, cfg: ModelConfig, tp: TPGroup) -> Shard | None:
    """The :class:`Shard` of checkpoint tensor ``name`` (HF naming) that this rank holds,
    or None when every rank holds it whole."""
    if tp.size == 1:
        return None
    sizes = local_sizes(cfg, tp)
    d = cfg.head_dim
    for pattern, dim, what in _SPLITS:
        if not pattern.search(name):
            continue
        if what.endswith("_wide"):
            if not cfg.qk_norm_full_width:
                return None  # a per-head norm [head_dim]: whole on every rank
            what = what[:-5]
        if what == "q":
            return Shard(dim, tp.rank * sizes.num_heads * d, sizes.num_heads * d,
                         cfg.num_heads * d,
                         f"num_attention_heads={cfg.num_heads} x head_dim={d}")
        if what == "kv":
            # The whole tensor has every KV head once, replicated on the ranks or not.
            return Shard(dim, sizes.kv_head_start * d, sizes.num_kv_heads * d,
                         cfg.num_kv_heads * d,
                         f"num_key_value_heads={cfg.num_kv_heads} x head_dim={d}")
        key, full, n, start = {
            "ffn": ("intermediate_size", cfg.intermediate_size, sizes.intermediate_size,
                    tp.rank * sizes.intermediate_size),
            "expert": ("moe_intermediate_size", cfg.moe_intermediate_size,
                       sizes.moe_intermediate_size, tp.rank * sizes.moe_intermediate_size),
            "shared": ("shared_expert_intermediate_size",
                       cfg.shared_expert_intermediate_size,
                       sizes.shared_expert_intermediate_size,
                       tp.rank * sizes.shared_expert_intermediate_size),
            "vocab": ("vocab_size", cfg.vocab_size, sizes.vocab_size, sizes.vocab_start),
        }[what]
        return Shard(dim, start, n, full, f"{key}={full}")
    return None


def check_shard_source(name: str, shape: Sequence[int], cut: Shard | tuple | None) -> None:
    """``ValueError`` naming tensor ``name`` unless its whole ``shape`` has the size the
    config implies along the split dim: a rank reads only its slice, so a checkpoint
    that disagrees with its config.json would otherwise load a wrong slice silently
    (one rank compares whole shapes instead). A plain ``(dim, start, length)`` cut, or
    None, is not checked."""
    if not isinstance(cut, Shard):
        return
    shape = tuple(int(x) for x in shape)
    if cut.dim >= len(shape) or shape[cut.dim] != cut.full:
        raise ValueError(f"checkpoint tensor {name!r}: shape {shape}, expected size "
                         f"{cut.full} along dim {cut.dim} ({cut.source} in the config)")


def stacked_gate_up_shard(tensor: torch.Tensor, tp: TPGroup, name: str = "",
                          inter: int | None = None) -> torch.Tensor:
    """This rank's rows of a stacked expert ``gate_up_proj [E, 2I, H]``: its block of the
    gate half and the same block of the up half -> ``[E, 2I / tp, H]``. ``inter``: the
    config's ``I`` (``ValueError`` naming tensor ``name`` if the tensor's differs)."""
    if tp.size == 1:
        return tensor
    if inter is not None:
        check_shard_source(name, tensor.shape, Shard(
            1, 0, 0, 2 * inter, f"2 x moe_intermediate_size={inter}"))
    inter = tensor.shape[1] // 2
    n = inter // tp.size
    lo = tp.rank * n
    return torch.cat([tensor[:, lo:lo + n], tensor[:, inter + lo:inter + lo + n]], dim=1)


def take_shard(tensor: torch.Tensor, cut: Shard | None, name: str = "",
               qtype: int | None = None) -> torch.Tensor:
    """The ``shard_slice`` part of a whole tensor, owning its memory (so the whole one can
    be freed); ``ValueError`` naming tensor ``name`` if its size along the split dim is
    not the config's (see :func:`check_shard_source`).

    ``qtype``: the tensor is GGUF blocks of that ggml type, uint8 ``[rows, row_bytes]``
    for a weight ``[rows, K]``: a cut along the rows is taken as is, a cut along K in
    whole blocks; ``ValueError`` naming the tensor when it would cut through a block."""
    if cut is None:
        return tensor
    dim, start, length = cut[:3]
    if qtype is not None and dim == 1:
        fmt = block_format(qtype)
        k = fmt.row_weights(tensor.shape[1], name=name)
        check_shard_source(name, (tensor.shape[0], k), cut)
        if start % fmt.block_weights or length % fmt.block_weights:
            raise ValueError(
                f"checkpoint tensor {name!r}: this rank's columns {start}..{start + length} "
                f"of {k} cut through a {fmt.name} block of {fmt.block_weights} weights; "
                f"pick a tensor-parallel size that splits it at block boundaries, or load "
                f"with quantization='none'")
        return tensor.narrow(1, fmt.row_bytes(start, name) if start else 0,
                             fmt.row_bytes(length, name)).clone()
    check_shard_source(name, tensor.shape, cut)
    return tensor.narrow(dim, start, length).clone()
