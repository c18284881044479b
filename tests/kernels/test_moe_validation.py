"""MoE ops: bad arguments raise ValueError naming them (before any launch), the Triton
ops and the reference share signatures, and no op reads device data on the host."""

from __future__ import annotations

import inspect

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from tests.kernels.helpers import DEVICE, generator, randn
from tests.kernels.moe_helpers import experts, routing

F32 = torch.float32


def _layer_args():
    g = generator(41)
    weights, ids = routing(4, 5, 2, g)
    w13, w2 = experts(5, 32, 16, F32, g)
    return dict(x=randn((4, 32), F32, g), w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)


def _gemm_args():
    a = _layer_args()
    align = deepinfer_kernels.moe_align(a["topk_ids"], 5, 16)
    return dict(a=a["x"], w=a["w2"].transpose(1, 2).contiguous(), sorted_ids=align[0],
                block_expert=align[1], num_padded=align[2], topk_weights=a["topk_weights"],
                out=torch.empty((8, 16), device=DEVICE), top_k=2, mul_routed_weight=True)


@pytest.mark.parametrize("name, mutate", [
    ("router_logits", lambda a: a["router_logits"].int()),
    ("router_logits", lambda a: a["router_logits"][0]),
    ("router_logits", lambda a: a["router_logits"][:, ::2]),
    ("top_k", lambda a: 0),
    ("top_k", lambda a: 6),  # more than E
    ("top_k", lambda a: torch.tensor(2)),
    ("renormalize", lambda a: 1),
])
def test_route_rejects(name, mutate):
    args = dict(router_logits=randn((3, 5), F32, generator(42)), top_k=2, renormalize=True)
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        deepinfer_kernels.moe_route(**args)


@pytest.mark.parametrize("name, mutate", [
    ("topk_ids", lambda a: a["topk_ids"].long()),
    ("topk_ids", lambda a: a["topk_ids"].reshape(-1)),
    ("topk_ids", lambda a: a["topk_ids"].t()),
    ("num_experts", lambda a: 0),
    ("block_m", lambda a: 8),
    ("block_m", lambda a: 24),
])
def test_align_rejects(name, mutate):
    args = dict(topk_ids=_layer_args()["topk_ids"], num_experts=5, block_m=16)
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        deepinfer_kernels.moe_align(**args)


@pytest.mark.parametrize("name, mutate", [
    ("a", lambda a: a["a"].int()),
    ("a", lambda a: a["a"][:3]),  # neither T nor T * top_k rows
    ("a", lambda a: a["a"][:, ::2]),
    ("w", lambda a: a["w"][:, :, :16]),  # K differs from a's
    ("w", lambda a: a["w"][0]),
    ("w", lambda a: a["w"].to(torch.bfloat16)),
    ("sorted_ids", lambda a: a["sorted_ids"].long()),
    ("block_expert", lambda a: a["block_expert"][:-1]),
    ("num_padded", lambda a: a["num_padded"].long()),
    ("topk_weights", lambda a: a["topk_weights"].half()),
    ("topk_weights", lambda a: a["topk_weights"][:1]),
    ("out", lambda a: a["out"][:, :8]),
    ("top_k", lambda a: 0),
    ("mul_routed_weight", lambda a: None),
])
def test_gemm_rejects_and_writes_nothing(name, mutate):
    args = _gemm_args()
    args[name] = mutate(args)
    out = args["out"]
    out.fill_(3.0)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        deepinfer_kernels.fused_moe_gemm(**args)
    assert (out == 3.0).all()


def test_gemm_rejects_odd_gated_width():
    args = _gemm_args()
    args["w"] = args["w"][:, :15].contiguous()
    args["out"] = args["out"][:, :7]
    with pytest.raises(ValueError, match="^w:"):
        deepinfer_kernels.fused_moe_gemm(**args, gated=True)


@pytest.mark.parametrize("name, mutate", [
    ("x", lambda a: a["x"].int()),
    ("x", lambda a: a["x"][None]),
    ("w13", lambda a: a["w13"][:, :-1]),  # odd 2I
    ("w13", lambda a: a["w13"][..., :16]),  # H differs from x's
    ("w13", lambda a: a["w13"].half()),
    ("w2", lambda a: a["w2"][:4]),  # expert count differs
    ("w2", lambda a: a["w2"].transpose(1, 2)),
    ("topk_ids", lambda a: a["topk_ids"][:3]),
    ("topk_ids", lambda a: a["topk_ids"].long()),
    ("topk_weights", lambda a: a["topk_weights"][:, :1]),
    ("topk_weights", lambda a: a["topk_weights"].double()),
    ("out", lambda a: torch.empty((4, 16), device=DEVICE)),
    ("out", lambda a: torch.empty((4, 32), dtype=torch.float16, device=DEVICE)),
])
def test_fused_moe_rejects(name, mutate):
    args = _layer_args()
    args["out"] = None
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        deepinfer_kernels.fused_moe(**args)


@pytest.mark.parametrize("name", ["moe_route", "moe_align", "fused_moe_gemm", "fused_moe"])
def test_signature_matches_reference(name):
    ours = inspect.signature(getattr(deepinfer_kernels, name))
    ref = inspect.signature(getattr(reference, name))
    assert list(ours.parameters) == list(ref.parameters)
    for p in ours.parameters.values():
        assert p.default == ref.parameters[p.name].default, p.name


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CUDA: tests/kernels/test_no_sync.py mode")
def test_no_host_reads(monkeypatch):
    """No .item()/.tolist() in any MoE op's launch path."""
    args = _layer_args()
    gemm = _gemm_args()
    logits = randn((4, 5), F32, generator(43))

    def boom(*a, **k):
        raise AssertionError("host read of device data inside a MoE op")

    with monkeypatch.context() as m:
        for attr in ("item", "tolist"):
            m.setattr(torch.Tensor, attr, boom)
        deepinfer_kernels.moe_route(logits, 2, True)
        deepinfer_kernels.moe_align(args["topk_ids"], 5, 16)
        deepinfer_kernels.fused_moe_gemm(**gemm)
        deepinfer_kernels.fused_moe(**args)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
def test_no_sync_cuda():
    args = _layer_args()
    logits = randn((4, 5), F32, generator(43))
    calls = [lambda: deepinfer_kernels.moe_route(logits, 2, True),
             lambda: deepinfer_kernels.moe_align(args["topk_ids"], 5, 16),
             lambda: deepinfer_kernels.fused_moe(**args)]
    for call in calls:  # compile first
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
