"""Packed copies of dense bf16 weights at load (``load_model(prepack_weights=...)``,
``deepinfer.models.dense_kernels``): which layers get one, when the default declines,
what the resident weight bytes count, and that a model with the copies computes what one
without them does (the real SmolLM2 weights, dequantized to bf16, batched steps)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.loading.loader import load_model
from deepinfer.models import dense_kernels
from deepinfer.models.parallel_layers import Embedding, Linear
from deepinfer.models.quantized import weight_bytes
from deepinfer_kernels import cpu_backend, cpu_gguf
from deepinfer_kernels.cpu_prepacked import prepack_available
from tests.models.paged_sim import PagedSim

pytestmark = pytest.mark.skipif(
    not (prepack_available() and cpu_gguf.bf16_gemm()),
    reason="no oneDNN bf16 packed linear, or no AVX512-BF16 build of the native kernels")


def _dense_layers(model) -> list:
    return [m for m in model.modules()
            if isinstance(m, (Linear, Embedding)) and m.bound_matmul is not None]


def _steps(model, cfg) -> torch.Tensor:
    """A prompt step of 4 sequences (40 tokens), then 3 decode steps of 12 sequences'
    worth of rows: products above and below ``PACKED_MIN_M`` rows."""
    sim = PagedSim(cfg, num_blocks=64, block_size=8, seed=2)
    sim.cache = sim.cache.to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = {s: torch.randint(3, cfg.vocab_size, (7 + 2 * s,), generator=g).tolist()
               for s in range(12)}
    logits = [sim.step(model, prompts, True, cpu_backend)]
    for _ in range(3):
        chunk = {s: torch.randint(3, cfg.vocab_size, (1,), generator=g).tolist()
                 for s in prompts}
        logits.append(sim.step(model, chunk, False, cpu_backend))
    few = {0: [5], 1: [9]}  # two rows: the in-place kernel (or the fused step)
    logits.append(sim.step(model, few, False, cpu_backend))
    return torch.cat(logits).float()


def test_packed_and_plain_models_compute_the_same(smollm2_path):
    plain, cfg = load_model(smollm2_path, dtype="bfloat16", quantization="none",
                            prepack_weights=False)
    packed, _ = load_model(smollm2_path, dtype="bfloat16", quantization="none",
                           prepack_weights=True)
    assert all(m.packed_weight is None for m in _dense_layers(plain))
    layers = _dense_layers(packed)
    assert layers and all(m.packed_weight is not None for m in layers)
    held = weight_bytes(packed)
    assert held == weight_bytes(plain)  # copies are made on first use
    want, got = _steps(plain, cfg), _steps(packed, cfg)
    assert torch.isfinite(got).all()
    # bf16 products summed in other orders: logits agree to bf16 rounding over 30 layers.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    copies = sum(m.packed_weight.nbytes for m in layers)
    assert copies >= sum(m.weight.numel() * 2 for m in layers)
    assert weight_bytes(packed) == held + copies


def test_the_default_packs_only_where_the_copies_fit(smollm2_path, monkeypatch):
    model, _ = load_model(smollm2_path, dtype="bfloat16", quantization="none")
    assert all(m.packed_weight is not None for m in _dense_layers(model))
    # A machine with 100 MB available: 270 MB of copies would take more than a quarter.
    monkeypatch.setattr(dense_kernels, "available_memory", lambda: 100_000_000)
    model, _ = load_model(smollm2_path, dtype="bfloat16", quantization="none")
    assert all(m.packed_weight is None for m in _dense_layers(model))
    assert _dense_layers(model)  # still bound to the in-place kernel
    forced, _ = load_model(smollm2_path, dtype="bfloat16", quantization="none",
                           prepack_weights=True)
    assert all(m.packed_weight is not None for m in _dense_layers(forced))


def test_quantized_and_fp32_weights_get_no_copy(smollm2_path):
    for kwargs in ({"dtype": "bfloat16", "quantization": "auto"},
                   {"dtype": "float32", "quantization": "none"}):
        model, _ = load_model(smollm2_path, prepack_weights=True, **kwargs)
        assert all(getattr(m, "packed_weight", None) is None for m in model.modules())
