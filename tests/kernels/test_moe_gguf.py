"""The Triton ``fused_moe_gguf`` (experts kept as GGUF blocks, decoded inside the grouped
GEMMs; interpreted on CPU) against the reference (the blocks dequantized, then the
per-expert ``fused_moe`` in fp32): every block type, 1 / 16 / 17 / 64 tokens, fp32, bf16
and fp16 activations, random blocks with negative and subnormal fp16 scales, a 32-weight
type's hidden size that leaves a ragged last step of groups, experts that get no token,
mixed types (gate/up one type, down another, as llama.cpp's presets do), ``out``
poisoned with NaN before the call; bad input.

Tolerance: relative to the scale the error grows with (``_error_scale``: each product's
sum of absolute terms, carried through SiLU-and-mul and the down projection; a plain
relative error means nothing where a sum cancels), 1e-4 for fp32 activations (fp32
accumulation in another order), 2e-2 for 16-bit ones (the GEMMs round the weights and the
SiLU-and-mul activations to x's dtype).
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS, BlockFormat
from tests.kernels.gguf_helpers import make_blocks, rng_for
from tests.kernels.helpers import DEVICE, generator, seed_for
from tests.kernels.moe_helpers import routing

FORMATS = {f.name: f for f in BLOCK_FORMATS.values()}
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
RTOL = {F32: 1e-4, BF16: 2e-2, F16: 2e-2}
NUM_EXPERTS, TOP_K = 4, 2


def _sizes(fmt13: BlockFormat, fmt2: BlockFormat) -> tuple[int, int]:
    """(H, I): whole blocks of each weight's type. A 32-weight type's H of 3 blocks (96)
    gives the interpreter's 4-group steps a ragged last one; K-quants need 256."""
    hidden = 256 if fmt13.block_weights == 256 or fmt2.block_weights == 256 else 96
    inter = 256 if fmt2.block_weights == 256 or fmt13.block_weights == 256 else 64
    return hidden, inter


def _stack(fmt: BlockFormat, experts: int, rows: int, k: int, case: tuple) -> torch.Tensor:
    """uint8 ``[E, rows, row_bytes(k)]`` of random ``fmt`` blocks (``make_blocks``)."""
    raw = make_blocks(fmt, experts * rows, k, rng_for(*case))
    return torch.from_numpy(raw).reshape(experts, rows, -1).to(DEVICE)


def _error_scale(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float64: per output, ``sum_j w_j * (a_j @ |W2_e|.T)`` with ``a`` the
    bound on how much SiLU-and-mul's output moves when gate and up move by their sums of
    absolute terms (``|x| @ |W|.T``): ``|silu(g)| * up_abs + 1.1 * |u| * gate_abs +
    |silu(g) * u|`` (silu' <= 1.1). ``w13``/``w2`` dequantized."""
    inter = w2.shape[2]
    xd = x.double().cpu()
    out = torch.zeros(xd.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        tok, slot = (ids.cpu().long() == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w1, w1a = w13[e].double().cpu(), w13[e].double().cpu().abs()
        h, ha = xd[tok] @ w1.T, xd[tok].abs() @ w1a.T
        gate, up, gate_a, up_a = h[:, :inter], h[:, inter:], ha[:, :inter], ha[:, inter:]
        silu = torch.nn.functional.silu(gate)
        act = silu.abs() * up_a + 1.1 * up.abs() * gate_a + (silu * up).abs()
        contrib = act @ w2[e].double().cpu().abs().T
        out.index_add_(0, tok, contrib * weights.cpu().double()[tok, slot, None])
    return out


def _check(name13: str, name2: str, tokens: int, dtype: torch.dtype,
           only: list[int] | None = None) -> None:
    fmt13, fmt2 = FORMATS[name13], FORMATS[name2]
    hidden, inter = _sizes(fmt13, fmt2)
    case = (name13, name2, tokens, str(dtype), only)
    w13 = _stack(fmt13, NUM_EXPERTS, 2 * inter, hidden, case + ("w13",))
    w2 = _stack(fmt2, NUM_EXPERTS, hidden, inter, case + ("w2",))
    g = generator(seed_for("moe-gguf", *case))
    weights, ids = routing(tokens, NUM_EXPERTS, TOP_K, g, only=only)
    # Small activations: random K-quant weights reach ~100 and the output grows with the
    # square of x (two products): fp16 must not overflow.
    x = (torch.randn((tokens, hidden), generator=g) * 0.005).to(dtype=dtype, device=DEVICE)
    out = torch.full_like(x, float("nan"))
    got = deepinfer_kernels.fused_moe_gguf(x, w13, w2, fmt13.type_id, fmt2.type_id,
                                           weights, ids, out=out)
    assert got is out and out.dtype == dtype
    want = reference.fused_moe_gguf(x, w13, w2, fmt13.type_id, fmt2.type_id, weights, ids)
    w13_f = reference.dequantize_gguf(w13.reshape(-1, w13.shape[2]), fmt13.type_id)
    w2_f = reference.dequantize_gguf(w2.reshape(-1, w2.shape[2]), fmt2.type_id)
    scale = _error_scale(x, w13_f.view(NUM_EXPERTS, 2 * inter, hidden),
                         w2_f.view(NUM_EXPERTS, hidden, inter), weights, ids)
    err = (out.double().cpu() - want.double().cpu()).abs()
    assert not bool(out.isnan().any()), "NaN in the output"
    assert bool((scale > 0).all())
    assert bool((err <= RTOL[dtype] * scale).all()), \
        f"max error / scale {float((err / scale).max()):.3g} > {RTOL[dtype]}"


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("tokens, dtype", [(1, BF16), (16, F32), (17, F16), (64, BF16)])
def test_every_type_matches_the_reference(name, tokens, dtype):
    _check(name, name, tokens, dtype)


@pytest.mark.parametrize("name13, name2, tokens, dtype", [
    ("Q4_K", "Q6_K", 9, F32),  # llama.cpp's Q4_K_M: down projections in Q6_K
    ("Q4_0", "Q8_0", 5, BF16),
])
def test_mixed_types(name13, name2, tokens, dtype):
    _check(name13, name2, tokens, dtype)


def test_experts_without_tokens_are_skipped():
    """Two of the four experts get no token: their blocks of the alignment are empty."""
    _check("Q5_1", "Q5_1", 12, F32, only=[1, 3])


def test_no_tokens():
    fmt = FORMATS["Q8_0"]
    w13 = _stack(fmt, NUM_EXPERTS, 128, 96, ("empty", "w13"))
    w2 = _stack(fmt, NUM_EXPERTS, 96, 64, ("empty", "w2"))
    x = torch.empty((0, 96), device=DEVICE)
    out = deepinfer_kernels.fused_moe_gguf(
        x, w13, w2, fmt.type_id, fmt.type_id, torch.empty((0, 2), device=DEVICE),
        torch.empty((0, 2), dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 96)


def _bad_args(**change):
    fmt = FORMATS["Q8_0"]
    args = dict(
        x=torch.randn(3, 96, device=DEVICE),
        w13=_stack(fmt, NUM_EXPERTS, 128, 96, ("bad", "w13")),
        w2=_stack(fmt, NUM_EXPERTS, 96, 64, ("bad", "w2")),
        qtype13=fmt.type_id, qtype2=fmt.type_id,
        topk_weights=torch.ones(3, 2, device=DEVICE),
        topk_ids=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE))
    args.update(change)
    return args


@pytest.mark.parametrize("change, name, what", [
    (dict(qtype13=99), "qtype13", "GGUF block type id"),
    (dict(qtype2="Q8_0"), "qtype2", "GGUF block type id"),
    # A row of 100 bytes is not whole Q8_0 blocks (34 bytes each).
    (dict(w13=torch.zeros(NUM_EXPERTS, 128, 100, dtype=torch.uint8)), "w13", "whole Q8_0"),
    (dict(w13=torch.zeros(NUM_EXPERTS, 128, 3 * 34 + 34, dtype=torch.uint8)), "w13",
     "rows of H = 96"),
    (dict(w2=torch.zeros(NUM_EXPERTS, 96, 3 * 34, dtype=torch.uint8)), "w2", "shape"),
    (dict(w2=torch.zeros(NUM_EXPERTS, 96, 68, dtype=torch.float32)), "w2", "uint8"),
    (dict(x=torch.randn(3, 96, dtype=torch.float64)), "x", "float"),
    (dict(topk_ids=torch.zeros(2, 2, dtype=torch.int32)), "topk_ids", "one row per token"),
])
def test_bad_input_is_named(change, name, what):
    change = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in change.items()}
    with pytest.raises(ValueError, match=name) as info:
        deepinfer_kernels.fused_moe_gguf(**_bad_args(**change))
    assert what in str(info.value)
