"""Experts kept as GGUF blocks (``deepinfer.models.quantized_experts``) against the
reference ``fused_moe`` on the same experts dequantized: random blocks with negative and
subnormal fp16 scales, fresh data per case, every block type, fp32 and bf16 activations,
the CPU kernels bound per expert as a loaded model binds them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize

from deepinfer.models.quantized_experts import experts_from_blocks
from deepinfer_kernels import cpu_gguf, cpu_layer_ops, gguf_kernels, reference
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
from tests.kernels.gguf_helpers import make_blocks, rng_for

pytestmark = pytest.mark.skipif(not cpu_gguf.available(),
                                reason="native CPU kernels not built (no C compiler)")

E, TOP_K = 5, 2


def _experts(name: str, rng: np.random.Generator, h: int, inter: int):
    fmt = BLOCK_FORMATS[GQ[name].value]
    raw13 = [make_blocks(fmt, 2 * inter, h, rng) for _ in range(E)]
    raw2 = [make_blocks(fmt, h, inter, rng) for _ in range(E)]
    w13 = torch.stack([torch.from_numpy(r) for r in raw13])  # uint8 [E, 2I, row_bytes]
    w2 = torch.stack([torch.from_numpy(r) for r in raw2])
    f13 = torch.stack([torch.from_numpy(gguf_dequantize(r, GQ(fmt.type_id))) for r in raw13])
    f2 = torch.stack([torch.from_numpy(gguf_dequantize(r, GQ(fmt.type_id))) for r in raw2])
    matmuls = [(gguf_kernels.bind_gguf_matmul(w13[e], fmt.type_id),
                gguf_kernels.bind_gguf_matmul(w2[e], fmt.type_id)) for e in range(E)]
    return matmuls, f13, f2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize("name", [f.name for f in BLOCK_FORMATS.values()])
def test_experts_from_blocks_match_the_reference(name: str, tokens: int,
                                                 dtype: torch.dtype):
    """1 token (one row an expert), 3 and 9 (several rows for some experts, none for
    others). Bound: relative to the scale of the output, |weights| @ |down| @ |h| in the
    reference's fp32 terms: 1e-4 for fp32; 2e-2 for bf16, whose x, gate/up output and
    SiLU product each round to bf16 on the way."""
    k_quant = BLOCK_FORMATS[GQ[name].value].block_weights == 256
    h, inter = (256, 256) if k_quant else (96, 64)
    rng = rng_for("experts", name, tokens, str(dtype))
    matmuls, f13, f2 = _experts(name, rng, h, inter)
    # Outputs of the blocks are O(1) per weight times the scales: keep x small enough
    # that products of fp16 scales stay normal in fp32 and the SiLU is not saturated.
    x = torch.from_numpy(rng.standard_normal((tokens, h)).astype(np.float32)).to(dtype)
    logits = torch.from_numpy(rng.standard_normal((tokens, E)).astype(np.float32))
    weights, ids = reference.moe_route(logits, TOP_K, renormalize=True)
    got = experts_from_blocks(x, matmuls, weights, ids, cpu_layer_ops.silu_and_mul)
    assert got.dtype == dtype and got.shape == (tokens, h)
    want = reference.fused_moe(x.float(), f13, f2, weights, ids)
    # The size of the terms: every contribution taken in absolute value.
    hid = x.float() @ f13.transpose(1, 2)  # [E, T, 2I]
    act = (torch.nn.functional.silu(hid[..., :inter]) * hid[..., inter:]).abs()
    terms = act @ f2.abs().transpose(1, 2)  # [E, T, H]
    scale = torch.zeros(tokens, h)
    for j in range(TOP_K):
        scale += weights[:, j, None] * terms[ids[:, j].long(), torch.arange(tokens)]
    if dtype == torch.bfloat16:
        # One bf16 row of 1-3 tokens may take the int8 path (Q4_0/Q4_1/Q8_0), whose error
        # per element is set by the largest |value| of its block, not by the element:
        # held to the row's largest scale.
        scale = scale.amax(dim=1, keepdim=True).expand_as(scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (got.float() - want).abs()
    assert torch.isfinite(got).all()
    assert bool((err <= tol * scale + 1e-30).all()), float((err / scale).max())
