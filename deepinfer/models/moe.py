"""The sparse mixture-of-experts block and how its checkpoint tensors map onto it.

One block serves Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE: a router (``gate``, a bias-free
``Linear(hidden, E)``), experts stacked into ``w13 [E, 2I, H]`` (gate rows ``0..I``, then
up rows ``I..2I``) and ``w2 [E, H, I]``, and for Qwen2-MoE a shared expert whose output is
scaled by ``sigmoid(shared_expert_gate(x))`` and added (none at width 0: it would add 0).
Routing and the expert MLPs go through the kernel backend the engine passes in
(``moe_route`` then ``fused_moe``), so the same weights run on the Triton kernels and on
the torch reference.

Checkpoints store experts one tensor each (``mlp.experts.{e}.gate_proj/up_proj/down_proj``
for Qwen/OLMoE, ``block_sparse_moe.experts.{e}.w1/w3/w2`` for Mixtral) or already stacked
(``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``, as
transformers 5 holds them in memory); :func:`load_expert_tensor` copies either into place.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.models.backend import ModelBackend
from deepinfer.models.layers import GatedMLP
from deepinfer.models.parallel_layers import Linear
from deepinfer.models.quantized import block_parameter
from deepinfer.models.quantized_experts import ExpertMatmuls, experts_from_blocks
from deepinfer.models.tensor_parallel import (
    SINGLE,
    TPGroup,
    local_sizes,
    stacked_gate_up_shard,
)
from deepinfer_kernels import gguf_kernels

#: Per-expert tensor name -> (block prefix, expert, projection).
_PER_EXPERT = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.weight$")
#: Already-stacked tensor name -> (block prefix, which stack).
_STACKED = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)"
                      r"(?:\.weight)?$")
#: A Qwen2-MoE shared-expert tensor -> (block prefix, whether it is the sigmoid gate).
_SHARED = re.compile(r"^(?P<block>.+\.mlp)\.shared_expert(?P<gate>_gate)?\.")
#: Projection -> (our stacked parameter, is it the up half of w13).
_PROJ = {"gate_proj": ("w13", False), "w1": ("w13", False),
         "up_proj": ("w13", True), "w3": ("w13", True),
         "down_proj": ("w2", False), "w2": ("w2", False)}


class SparseMoeBlock(nn.Module):
    """Router + top-k SwiGLU experts (+ optional sigmoid-gated shared expert).

    Under tensor parallelism every rank holds all experts, each over its block of the
    intermediate size (w13 rows, w2 columns), and the shared expert likewise; the router
    is whole. The partial sums of both are all-reduced once, at the end."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        sizes = local_sizes(cfg, tp)
        e, i, h = cfg.num_experts, sizes.moe_intermediate_size, cfg.hidden_size
        self.tp = tp
        self.num_experts, self.top_k = e, cfg.num_experts_per_tok
        self.intermediate_size = i
        self.renormalize = cfg.norm_topk_prob
        self.gate = Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        if cfg.shared_expert_intermediate_size > 0:
            # No all-reduce of its own: its partial sum joins the experts'.
            self.shared_expert = GatedMLP(h, sizes.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        # (w13 type, w2 type) when the experts are kept as GGUF blocks, and their products
        # bound after loading (bind_expert_kernels).
        self.experts_qtypes: tuple[int, int] | None = None
        self.expert_matmuls: list[ExpertMatmuls] = []

    def keep_quantized(self, parts: dict[str, int]) -> set[str]:
        """Hold the experts as GGUF blocks (before they are materialised): ``w13`` uint8
        ``[E, 2I, row_bytes(H)]`` and ``w2`` ``[E, H, row_bytes(I)]``. ``parts``: this
        block's per-expert checkpoint names planned quantized -> ggml type id. Taken only
        whole: every expert's gate, up and down planned, gate and up of one type, down of
        one type; returns the names kept (none otherwise). ``ValueError`` naming a tensor
        whose rows (this rank's part under tensor parallelism) are not whole blocks."""
        stacks: dict[str, dict[str, int]] = {"w13": {}, "w2": {}}
        for name, qtype in parts.items():
            stack = expert_stack(canonical_moe_name(name))
            if stack is not None:
                stacks[stack[1]][name] = qtype
        w13, w2 = stacks["w13"], stacks["w2"]
        if (len(w13) != 2 * self.num_experts or len(w2) != self.num_experts
                or len(set(w13.values())) != 1 or len(set(w2.values())) != 1):
            return set()
        q13, q2 = next(iter(w13.values())), next(iter(w2.values()))
        self.w13 = block_parameter(self.w13, q13, min(w13))
        self.w2 = block_parameter(self.w2, q2, min(w2))
        self.experts_qtypes = (q13, q2)
        return set(w13) | set(w2)

    def bind_expert_kernels(self) -> None:
        """On the CPU, bind each expert's GGUF products to its blocks (after loading;
        again after the weights move). Elsewhere the backend's ``fused_moe_gguf`` reads
        the stacks whole (no host sync: CUDA graphs capture it)."""
        q13, q2 = self.experts_qtypes
        if self.w13.device.type != "cpu":
            self.expert_matmuls = []
            return
        self.expert_matmuls = [
            (gguf_kernels.bind_gguf_matmul(self.w13[e], q13),
             gguf_kernels.bind_gguf_matmul(self.w2[e], q2)) for e in range(self.num_experts)]

    def forward(self, x: torch.Tensor, backend: ModelBackend) -> torch.Tensor:
        """x ``[T, hidden]`` (model dtype, contiguous) -> ``[T, hidden]`` same dtype."""
        weights, ids = backend.moe_route(self.gate(x), self.top_k, self.renormalize)
        if self.experts_qtypes is None:
            out = backend.fused_moe(x, self.w13, self.w2, weights, ids)
        elif self.expert_matmuls:
            out = experts_from_blocks(x, self.expert_matmuls, weights, ids,
                                      backend.silu_and_mul)
        else:
            out = backend.fused_moe_gguf(x, self.w13, self.w2, *self.experts_qtypes,
                                         weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, backend)
        return self.tp.all_reduce(out)


def is_expert_tensor(name: str) -> bool:
    """Whether checkpoint tensor ``name`` (after :func:`canonical_moe_name`) is an expert
    weight that :func:`load_expert_tensor` places."""
    return bool(_PER_EXPERT.match(name) or _STACKED.match(name))


def is_absent_shared_expert_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig,
                                   params: dict[str, nn.Parameter]) -> bool:
    """Whether ``name`` belongs to the zero-width shared expert of a Qwen2-MoE sparse
    layer (``shared_expert_intermediate_size`` 0), which the model leaves out: in
    transformers its output is 0, and so is whatever its gate scales. Its projections
    must then be zero-size (``ValueError`` naming the tensor otherwise); the gate's
    ``[1, hidden]`` weight is simply skipped."""
    if cfg.architecture != "Qwen2MoeForCausalLM" or cfg.shared_expert_intermediate_size:
        return False
    m = _SHARED.match(name)
    if m is None or f"{m['block']}.w13" not in params:  # not a sparse layer: no place
        return False
    if m["gate"] is None and tensor.numel():
        raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, "
                         f"expected a zero-size tensor (shared_expert_intermediate_size=0)")
    return True


def expert_stack(name: str) -> tuple[str, str] | None:
    """``(block prefix, "w13" or "w2")`` of a per-expert checkpoint tensor name (after
    :func:`canonical_moe_name`); None for any other name."""
    m = _PER_EXPERT.match(name)
    return None if m is None else (m["block"], _PROJ[m["proj"]][0])


def canonical_moe_name(name: str) -> str:
    """Mixtral's ``block_sparse_moe`` module is our ``mlp``."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def expert_weight_keys(param_name: str, num_experts: int, intermediate: int) -> list[str]:
    """Load keys of a stacked parameter: ``w13`` has a gate and an up half per expert,
    ``w2`` one tensor per expert."""
    if param_name.endswith(".w13"):
        return [f"{param_name}#{e}#{off}" for e in range(num_experts)
                for off in (0, intermediate)]
    return [f"{param_name}#{e}" for e in range(num_experts)]


def load_expert_tensor(params: dict[str, nn.Parameter], name: str,
                       tensor: torch.Tensor, tp: TPGroup = SINGLE) -> list[str]:
    """Copy expert tensor ``name`` into its stacked parameter; returns the load keys it
    filled (see :func:`expert_weight_keys`). ``ValueError`` naming the tensor when it has
    no place (e.g. a dense layer) or the wrong shape.

    Per-expert: gate/w1 ``[I, H]`` -> ``w13[e, :I]``, up/w3 ``[I, H]`` -> ``w13[e, I:]``,
    down/w2 ``[H, I]`` -> ``w2[e]``. Stacked: ``gate_up_proj [E, 2I, H]`` -> ``w13``,
    ``down_proj [E, H, I]`` -> ``w2``. Copies convert to the parameter's dtype. Under
    tensor parallelism the loader already cut every tensor to this rank's share except a
    stacked ``gate_up_proj`` (two blocks, one per half), cut here.
    """
    m = _PER_EXPERT.match(name)
    if m is not None:
        stack, is_up = _PROJ[m["proj"]]
        target = f"{m['block']}.{stack}"
        param = _param(params, target, name)
        e = int(m["e"])
        if e >= param.shape[0]:
            raise ValueError(f"checkpoint tensor {name!r}: expert {e} but the config has "
                             f"{param.shape[0]} experts")
        dst = param.data[e]
        off = 0
        if stack == "w13":
            inter = param.shape[1] // 2
            off = inter if is_up else 0
            dst = dst.narrow(0, off, inter)
        _copy(dst, tensor, name)
        return [f"{target}#{e}#{off}" if stack == "w13" else f"{target}#{e}"]
    m = _STACKED.match(name)
    if m is None:
        raise ValueError(f"checkpoint tensor {name!r} is not an expert weight")
    is_w13 = m["proj"] == "gate_up_proj"
    target = f"{m['block']}.{'w13' if is_w13 else 'w2'}"
    param = _param(params, target, name)
    if is_w13:  # the config's (whole) intermediate size, checked before the cut
        tensor = stacked_gate_up_shard(tensor, tp, name, param.shape[1] // 2 * tp.size)
    _copy(param.data, tensor, name)
    inter = param.shape[1] // 2 if is_w13 else param.shape[2]
    return expert_weight_keys(target, param.shape[0], inter)


def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model (no MoE "
                         f"block {target.rsplit('.', 1)[0]!r})")
    return param


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(src.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(src)
