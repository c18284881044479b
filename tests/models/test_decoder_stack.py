"""The CPU backend's fused decode step (``bind_decoder_stack``: all decoder layers in one
C call) against the same model run layer by layer through the same backend's per-op
kernels: the same bits, in the logits and in the KV cache it writes, for fp32 and bf16
activations and 1-3 sequences (2: the int8 kernel's most rows), and with bf16 on the
GEMM's row counts (5: the dot form, 13: the outer form and a remainder tile); and the
steps and models it must leave to the per-layer path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as GQ

import deepinfer_kernels
from deepinfer.loading.loader import load_model
from deepinfer.models.attention import AttentionMetadata
from deepinfer.models.decoder_stack import decoder_stack_spec
from deepinfer_kernels import cpu_backend, cpu_gguf
from deepinfer_kernels.cpu_dense import PACKED_MIN_M
from deepinfer_kernels.cpu_gguf_rows16 import rows16_bf16_min_rows, rows16_types
from deepinfer_kernels.decoder_spec import BF16_TYPE, ROWS16_FLAG, projection_parts
from deepinfer_kernels.kv_quant import kv_row_width
from tests.models.paged_sim import PagedSim
from tests.models.quantized_gguf import write_quantized_gguf

pytestmark = pytest.mark.skipif(not cpu_gguf.available(),
                                reason="native CPU kernels not built (no C compiler)")

# The CPU backend with the fused step withheld: the model runs layer by layer.
LAYER_BY_LAYER = SimpleNamespace(**{**{name: getattr(cpu_backend, name)
                                       for name in cpu_backend.__all__},
                                    "bind_decoder_stack": lambda spec: None})


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def auto_model(request, smollm2_path):
    model, cfg = load_model(smollm2_path, dtype=request.param, quantization="auto")
    return model, cfg, getattr(torch, request.param)


def _counting(taken: list[int]) -> SimpleNamespace:
    """The CPU backend, its fused step wrapped to record the rows of each step it took."""
    def bind(spec):
        fn = cpu_backend.bind_decoder_stack(spec)

        def run(x, *args):
            out = fn(x, *args)
            if out is not None:
                taken.append(x.shape[0])
            return out
        return None if fn is None else run
    return SimpleNamespace(**{**vars(LAYER_BY_LAYER), "bind_decoder_stack": bind})


def _sim(cfg, dtype: torch.dtype) -> PagedSim:
    sim = PagedSim(cfg, num_blocks=40, block_size=8, seed=1)
    # Unwritten slots hold garbage (the same in every sim).
    sim.cache = torch.randn(sim.cache.shape, generator=torch.Generator().manual_seed(3)).to(
        dtype)
    return sim


def _run(model, cfg, dtype, backend, prompts: dict[int, list[int]], steps: int):
    sim = _sim(cfg, dtype)
    g = torch.Generator().manual_seed(7)
    logits = [sim.step(model, prompts, True, backend)]
    for _ in range(steps):
        chunk = {sid: torch.randint(3, cfg.vocab_size, (1,), generator=g).tolist()
                 for sid in prompts}
        logits.append(sim.step(model, chunk, False, backend))
    return torch.cat(logits), sim.cache


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 6])
def test_fused_decode_step_gives_the_per_layer_bits(auto_model, num_seqs):
    model, cfg, dtype = auto_model
    assert model.decoder_stack.get(model, cpu_backend) is not None
    g = torch.Generator().manual_seed(num_seqs)
    prompts = {s: torch.randint(3, cfg.vocab_size, (5 + 4 * s,), generator=g).tolist()
               for s in range(num_seqs)}
    fused, fused_cache = _run(model, cfg, dtype, cpu_backend, prompts, steps=6)
    assert model.decoder_stack.get(model, LAYER_BY_LAYER) is None
    plain, plain_cache = _run(model, cfg, dtype, LAYER_BY_LAYER, prompts, steps=6)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_fused_step_over_an_int8_kv_cache_gives_the_per_layer_bits(auto_model, num_seqs):
    """``kv_cache_dtype="int8"``: the fused step quantizes K/V into the cache's rows and
    reads them back as the per-layer store and decode attention do (same bits in the
    logits and the cache's codes and scales); and the int8 cache's logits stay near the
    float cache's."""
    model, cfg, dtype = auto_model
    g = torch.Generator().manual_seed(10 + num_seqs)
    prompts = {s: torch.randint(3, cfg.vocab_size, (4 + 5 * s,), generator=g).tolist()
               for s in range(num_seqs)}

    def run(backend, cache_dtype):
        sim = PagedSim(cfg, num_blocks=40, block_size=8, seed=1)
        width = kv_row_width(cfg.head_dim, "int8" if cache_dtype == torch.int8 else "auto")
        # Unwritten slots hold random bytes (the same in every sim).
        sim.cache = torch.randint(-128, 128, (*sim.cache.shape[:-1], width), dtype=torch.int8,
                                  generator=torch.Generator().manual_seed(3))
        if cache_dtype != torch.int8:
            sim.cache = sim.cache.to(cache_dtype)
        taken: list[int] = []
        counted = _counting(taken) if backend is cpu_backend else backend
        step = torch.Generator().manual_seed(7)
        logits = [sim.step(model, prompts, True, counted)]
        for _ in range(4):
            chunk = {sid: torch.randint(3, cfg.vocab_size, (1,), generator=step).tolist()
                     for sid in prompts}
            logits.append(sim.step(model, chunk, False, counted))
        return torch.cat(logits), sim.cache, taken

    fused, fused_cache, taken = run(cpu_backend, torch.int8)
    assert taken == [num_seqs] * 4  # every decode step ran fused
    plain, plain_cache, _ = run(LAYER_BY_LAYER, torch.int8)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)
    exact, _, _ = run(cpu_backend, dtype)
    # Against the float cache: each value is off by at most max|group| / 254, so the logits
    # move a little (random-token prompts, measured 0.014-0.062 of the logits' spread on
    # average, at most 0.78); a wrong scale or code moved them by whole spreads.
    err, spread = (fused.float() - exact.float()).abs(), exact.float().std()
    assert err.mean() < 0.1 * spread and err.max() < 1.5 * spread


@pytest.mark.skipif(not cpu_gguf.bf16_gemm(), reason="no AVX512-BF16: no bf16 GEMM")
@pytest.mark.parametrize("num_seqs", [5, 13])
def test_fused_step_takes_every_batch_the_bf16_gemm_serves(smollm2_path, num_seqs):
    """bf16 activations from ``INT8_MAX_M + 1`` sequences: every product is the bf16 GEMM
    in both paths (the dot form at 5 rows; the outer form at 13, a 12-row tile and a
    1-row one), so the fused step takes each decode step, with the per-layer bits."""
    model, cfg = load_model(smollm2_path, dtype="bfloat16", quantization="auto")
    g = torch.Generator().manual_seed(num_seqs)
    prompts = {s: torch.randint(3, cfg.vocab_size, (2 + s % 5,), generator=g).tolist()
               for s in range(num_seqs)}
    taken: list[int] = []
    fused, fused_cache = _run(model, cfg, torch.bfloat16, _counting(taken), prompts, steps=3)
    assert taken == [num_seqs] * 3
    plain, plain_cache = _run(model, cfg, torch.bfloat16, LAYER_BY_LAYER, prompts, steps=3)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


@pytest.mark.skipif(not cpu_gguf.bf16_gemm(), reason="no AVX512-BF16: dense weights unbound")
@pytest.mark.parametrize("num_seqs", [1, 3, PACKED_MIN_M])
def test_fused_step_over_dense_bf16_weights_gives_the_per_layer_bits(smollm2_path, num_seqs):
    """Dequantized (``quantization="none"``) bf16 weights, read in place by the dense bf16
    GEMM in both paths (``cpu_dense``): the same bits. From ``PACKED_MIN_M`` sequences
    the per-layer path takes oneDNN's packed copy, so the fused step declines."""
    model, cfg = load_model(smollm2_path, dtype="bfloat16", quantization="none")
    spec = decoder_stack_spec(model)
    assert spec is not None
    layer = spec.layers[0]
    assert {w.qtype for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {BF16_TYPE}
    assert model.decoder_stack.get(model, cpu_backend) is not None
    prompts = {s: list(range(4 + s, 11 + s % 3)) for s in range(num_seqs)}
    taken: list[int] = []
    fused, fused_cache = _run(model, cfg, torch.bfloat16, _counting(taken), prompts, steps=4)
    assert taken == ([num_seqs] * 4 if num_seqs < PACKED_MIN_M else [])
    plain, plain_cache = _run(model, cfg, torch.bfloat16, LAYER_BY_LAYER, prompts, steps=4)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_fused_step_over_k_quants_gives_the_per_layer_bits(tmp_path, qtype):
    """A tiny model of K-quant (or 5-bit) blocks, bf16, 3 sequences: repacked for the
    row-group kernel where the CPU has it for the type (AVX2; Q6_K with AVX512-BF16);
    else through the int8 kernel (AVX2) up to ``INT8_MAX_M`` rows where the bf16 GEMM
    exists, and that GEMM from ``INT8_MAX_M + 1`` rows. The fused step and the per-layer
    path pick the same kernel per product, so the same bits."""
    path = write_quantized_gguf(str(tmp_path / f"{qtype}.gguf"), qtype)
    model, cfg = load_model(path, dtype="bfloat16", quantization="auto")
    # Repacked for the row-group kernel where the CPU has it for the type.
    rows16 = GQ[qtype].value in rows16_types()
    assert model.model.layers[0].mlp.down_proj.rows16 == rows16
    assert model.decoder_stack.get(model, cpu_backend) is not None
    prompts = {s: list(range(3 + s, 9 + 3 * s)) for s in range(3)}
    fused, fused_cache = _run(model, cfg, torch.bfloat16, cpu_backend, prompts, steps=4)
    plain, plain_cache = _run(model, cfg, torch.bfloat16, LAYER_BY_LAYER, prompts, steps=4)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


def test_fused_step_over_q6k_many_rows_gives_the_per_layer_bits(tmp_path):
    """13 sequences of a bf16 Q6_K model: from ``rows16_bf16_min_rows`` rows its row
    groups take the bf16 path (each group decoded once a call), in the fused step as
    layer by layer; the step is taken, with the same bits."""
    rows = rows16_bf16_min_rows(GQ.Q6_K.value)
    if rows is None:
        pytest.skip("no AVX512-BF16: Q6_K is not packed")
    num = 13
    assert num >= rows
    path = write_quantized_gguf(str(tmp_path / "Q6_K.gguf"), "Q6_K")
    model, cfg = load_model(path, dtype="bfloat16", quantization="auto")
    assert model.model.layers[0].mlp.down_proj.rows16
    prompts = {s: list(range(3 + s, 7 + s)) for s in range(num)}
    taken: list[int] = []
    fused, fused_cache = _run(model, cfg, torch.bfloat16, _counting(taken), prompts, steps=3)
    plain, plain_cache = _run(model, cfg, torch.bfloat16, LAYER_BY_LAYER, prompts, steps=3)
    assert taken == [num] * 3
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_over_mixed_type_parts_gives_the_per_layer_bits(tmp_path, dtype):
    """llama.cpp's mixed presets: attn_v in Q8_0 beside Q4_0 q/k, ffn_up in Q6_K beside a
    Q4_0 gate. The fused q/k/v and gate/up projections reach the C step as parts (each
    part's product into its columns, the kernel the per-layer path picks for its type):
    the fused step runs, with the per-layer bits."""
    path = write_quantized_gguf(str(tmp_path / "mixed.gguf"), "Q4_0",
                                types={"attn_v": "Q8_0", "ffn_up": "Q6_K"})
    model, cfg = load_model(path, dtype=str(dtype).removeprefix("torch."),
                            quantization="auto")
    layer = decoder_stack_spec(model).layers[0]
    assert [w.qtype for w in layer.qkv] == [2, 2, 8]  # Q4_0, Q4_0, Q8_0
    assert [w.qtype for w in layer.gate_up] == [2, 14]  # Q4_0, Q6_K
    assert model.decoder_stack.get(model, cpu_backend) is not None
    prompts = {s: list(range(3 + s, 9 + 3 * s)) for s in range(3)}
    fused, fused_cache = _run(model, cfg, dtype, cpu_backend, prompts, steps=4)
    plain, plain_cache = _run(model, cfg, dtype, LAYER_BY_LAYER, prompts, steps=4)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


def test_fused_step_declines_what_it_does_not_take(auto_model):
    model, cfg, dtype = auto_model
    fn = model.decoder_stack.get(model, cpu_backend)
    sim = _sim(cfg, dtype)
    sim.step(model, {0: [5, 6, 7]}, True, cpu_backend)
    x = torch.randn(1, cfg.hidden_size).to(dtype)
    table = torch.tensor([sim.tables[0]], dtype=torch.int32)
    good = dict(positions=torch.tensor([3]), slot_mapping=torch.tensor(
        [sim.tables[0][0] * 8 + 3]), block_tables=table,
        seq_lens=torch.tensor([4], dtype=torch.int32))

    def call(**change):
        args = {**good, **change}
        return fn(x if "x" not in args else args.pop("x"), args["positions"], sim.cache,
                  args["slot_mapping"], args["block_tables"], args["seq_lens"])

    assert call() is not None
    # A position outside the RoPE cache: declined, so the per-layer rerun names it.
    assert call(positions=torch.tensor([cfg.max_positions + 5])) is None
    assert call(slot_mapping=torch.tensor([10**9])) is None  # past the cache
    assert call(seq_lens=torch.tensor([10**4], dtype=torch.int32)) is None  # table too short
    # From tile_min_rows rows: left to the per-layer path (its tiles for torch's BLAS),
    # unless every product there is the bf16 GEMM or the row-group kernel (any rows).
    m = cpu_gguf.tile_min_rows(dtype)
    wide = call(x=torch.randn(m, cfg.hidden_size).to(dtype), positions=torch.arange(m),
                slot_mapping=torch.arange(m), block_tables=table.expand(m, -1),
                seq_lens=torch.full((m,), 4, dtype=torch.int32))
    spec = decoder_stack_spec(model)
    packed = all(part.qtype & ROWS16_FLAG for layer in spec.layers
                 for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
                 for part in projection_parts(w))
    assert (wide is not None) == (dtype == torch.bfloat16
                                  and (cpu_gguf.bf16_gemm() or packed))
    assert call(seq_lens=torch.tensor([4], dtype=torch.int64)) is None
    # Through the model: the declined step reruns layer by layer, which names the token.
    meta = AttentionMetadata(False, good["slot_mapping"], table, good["seq_lens"],
                             torch.tensor([0, 1], dtype=torch.int32), 1, 4)
    with pytest.raises(IndexError, match="token 0 has position"), torch.inference_mode():
        model(torch.tensor([9]), torch.tensor([cfg.max_positions + 5]), sim.cache, meta,
              cpu_backend)


def test_models_without_a_fused_step(smollm2_path):
    none, _ = load_model(smollm2_path, dtype="float32", quantization="none")
    assert decoder_stack_spec(none) is None  # fp32 weights: no dense kernel for them
    auto, _ = load_model(smollm2_path, dtype="float32", quantization="auto")
    assert decoder_stack_spec(auto) is not None
    # The reference and the Triton kernels have none: their models run layer by layer.
    assert auto.decoder_stack.get(auto, deepinfer_kernels.reference) is None
    assert deepinfer_kernels.bind_decoder_stack(decoder_stack_spec(auto)) is None
    auto.model.layers[3].self_attn.clip_qkv = 8.0  # OLMoE-style clipping: not the plain block
    assert decoder_stack_spec(auto) is None


@pytest.mark.parametrize("window", [1, 8, 13])
def test_fused_step_with_a_sliding_window_gives_the_per_layer_bits(auto_model, window):
    """Every layer given a sliding window (prompts of 11-19 tokens, then 6 decode steps:
    past the window): the fused step reads each layer's window as the per-layer decode
    does (same bits), and both stay near the torch reference; without the window the
    logits differ (the window is felt)."""
    from deepinfer_kernels import reference

    model, cfg, dtype = auto_model
    attns = [layer.self_attn.attn for layer in model.model.layers]
    g = torch.Generator().manual_seed(20 + window)
    prompts = {s: torch.randint(3, cfg.vocab_size, (11 + 4 * s,), generator=g).tolist()
               for s in range(3)}
    full, _ = _run(model, cfg, dtype, cpu_backend, prompts, steps=6)
    try:
        for a in attns:
            a.window = window
        model.decoder_stack.reset()  # the bound step holds each layer's window
        taken: list[int] = []
        fused, fused_cache = _run(model, cfg, dtype, _counting(taken), prompts, steps=6)
        assert taken == [3] * 6  # every decode step ran fused
        plain, plain_cache = _run(model, cfg, dtype, LAYER_BY_LAYER, prompts, steps=6)
        oracle, _ = _run(model, cfg, dtype, reference, prompts, steps=6)
    finally:
        for a in attns:
            a.window = None
        model.decoder_stack.reset()
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)
    near = (fused.float() - oracle.float()).abs().mean()
    assert near < (1e-4 if dtype == torch.float32 else 0.05) * oracle.float().std()
    assert (full.float() - fused.float()).abs().mean() > 5 * near


def test_fused_step_with_nope_layers_gives_the_per_layer_bits(auto_model):
    """Every fourth layer without RoPE (SmolLM3's NoPE layers), 2 sequences, 6 decode
    steps: the fused step copies those layers' q and k unrotated as the per-layer path
    does (same bits), both near the torch reference, and the NoPE layers are felt."""
    from deepinfer_kernels import reference

    model, cfg, dtype = auto_model
    nope = [layer.self_attn for i, layer in enumerate(model.model.layers) if i % 4 == 3]
    g = torch.Generator().manual_seed(41)
    prompts = {s: torch.randint(3, cfg.vocab_size, (9 + 5 * s,), generator=g).tolist()
               for s in range(2)}
    rotated, _ = _run(model, cfg, dtype, cpu_backend, prompts, steps=6)
    try:
        for a in nope:
            a.rope = False
        model.decoder_stack.reset()
        taken: list[int] = []
        fused, fused_cache = _run(model, cfg, dtype, _counting(taken), prompts, steps=6)
        assert taken == [2] * 6
        plain, plain_cache = _run(model, cfg, dtype, LAYER_BY_LAYER, prompts, steps=6)
        oracle, _ = _run(model, cfg, dtype, reference, prompts, steps=6)
    finally:
        for a in nope:
            a.rope = True
        model.decoder_stack.reset()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)
    near = (fused.float() - oracle.float()).abs().mean()
    assert near < (1e-4 if dtype == torch.float32 else 0.05) * oracle.float().std()
    assert (rotated.float() - fused.float()).abs().mean() > 5 * near


def test_fused_step_declines_a_nope_layer_with_qk_norms(auto_model):
    """A NoPE layer with per-head q/k norms (EXAONE 4's global layers): the C step would
    copy q and k without their norms, so the model runs layer by layer."""
    from deepinfer.models.layers import RMSNorm

    model, _, _ = auto_model
    attn = model.model.layers[2].self_attn
    d, eps = attn.head_dim, model.model.norm.eps
    try:
        attn.rope = False
        assert decoder_stack_spec(model) is not None
        attn.q_norm, attn.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        assert decoder_stack_spec(model) is None
    finally:
        attn.rope, attn.q_norm, attn.k_norm = True, None, None
        model.decoder_stack.reset()
