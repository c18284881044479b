"""Weights kept as GGUF blocks (``quantization="auto"``) against the same file
dequantized at load (``"none"``): the default model and tiny files of every block type,
logits at every position, greedy tokens, resident bytes, the Triton attention backend
through the interpreter, and what bad input gets.

Tolerances, float32 activations. The kept scales are the file's fp16 values, exact in
fp32, so ``auto`` and ``none`` multiply the same weights; only the order of the fp32 sums
differs (the C kernel's 16 lanes vs the BLAS). Measured: 1e-6 relative to the largest
logit on the tiny files, 2e-5 absolute on the default model's logits (up to ~20). The
bounds leave 10x or more above that; a wrong scale, nibble or row moves logits by O(1).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import deepinfer_kernels
from deepinfer import LLM, EngineArgs, SamplingParams
from deepinfer.loading.loader import load_model
from deepinfer.models.parallel_layers import Linear
from deepinfer.models.quantized import bind_quantized_kernels, quantized_layers, weight_bytes
from deepinfer.models.tensor_parallel import TPGroup
from deepinfer_kernels import cpu_gguf
from deepinfer_kernels.cpu_gguf_rows16 import rows16_types
from tests.models.paged_sim import PagedSim
from tests.models.quantized_gguf import write_quantized_gguf

pytestmark = pytest.mark.skipif(not cpu_gguf.available(),
                                reason="native CPU kernels not built (no C compiler)")

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
TINY_RTOL = 1e-5  # of the largest |logit|
DEFAULT_ATOL = 1e-3  # the bound where the scales are kept exact
MARGIN = 1e-2  # top-2 gap above which greedy tokens must agree


def _script_logits(model, cfg, prompt: list[int], follow: list[int],
                   backend=deepinfer_kernels.reference) -> torch.Tensor:
    """Logits ``[len(prompt) + len(follow), vocab]``: the prompt prefilled, then each
    ``follow`` token decoded in turn (teacher-forced)."""
    sim = PagedSim(cfg, num_blocks=32, block_size=8)
    out = [sim.step(model, {0: prompt}, True, backend)]
    out += [sim.step(model, {0: [t]}, False, backend) for t in follow]
    return torch.cat(out)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def default_pair(smollm2_path):
    auto, cfg = load_model(smollm2_path, dtype="float32", quantization="auto")
    none, _ = load_model(smollm2_path, dtype="float32", quantization="none")
    return auto, none, cfg


def test_default_model_logits_match_dequantized_at_every_position(default_pair,
                                                                  smollm2_tokenizer):
    from deepinfer.tokenizer import apply_chat_template

    auto, none, cfg = default_pair
    prompts = [apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": c}])
               for c in ("What is the capital of France?", "Write a haiku about rain.")]
    prompts.append(_tokens(23, cfg.vocab_size, seed=3))
    for prompt in prompts:
        follow = _tokens(4, cfg.vocab_size, seed=len(prompt))
        got = _script_logits(auto, cfg, prompt, follow)
        want = _script_logits(none, cfg, prompt, follow)
        diff = (got - want).abs().max().item()
        assert diff <= DEFAULT_ATOL, f"max abs logit diff {diff}"
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > MARGIN
        assert clear.any()
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_default_model_greedy_generation_is_token_equal(smollm2_path):
    """End to end through the engine (CPU backend, C decode attention): the greedy
    continuations of ``auto`` and ``none`` agree (fp32; their logits differ by ~1e-5)."""
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = {}
    for mode in ("auto", "none"):
        llm = LLM(smollm2_path, dtype="float32", device="cpu", quantization=mode,
                  kv_cache_memory=16 << 20)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["auto"] == outs["none"]


def test_default_model_holds_the_file_bytes_once(default_pair, smollm2_path):
    """Resident weights at most 1.1x the file's tensor bytes; the tied embedding is the
    output head too (stored once, as Q8_0 blocks); every matrix is kept as blocks."""
    from deepinfer.loading.gguf_reader import open_gguf

    auto, none, cfg = default_pair
    file_bytes = sum(t.data.nbytes for t in open_gguf(smollm2_path).tensors)
    assert weight_bytes(auto) <= 1.1 * file_bytes
    assert weight_bytes(none) > 2.5 * file_bytes  # fp32: what auto saves
    layers = quantized_layers(auto)
    assert layers["model.embed_tokens"] == 8 and auto.lm_head is None  # Q8_0, tied
    assert len(layers) == 1 + 4 * cfg.num_layers  # qkv, o, gate_up, down per layer
    assert {q for n, q in layers.items() if n != "model.embed_tokens"} == {3}  # Q4_1
    assert auto.activation_dtype == torch.float32


def test_llm_reports_resident_weight_bytes(smollm2_path):
    llm = LLM(smollm2_path, device="cpu", kv_cache_memory=8 << 20)
    assert llm.weight_bytes == weight_bytes(llm.engine.model)
    assert llm.weight_bytes < 110e6  # 92 MB of blocks + F32 norms, not 270 MB of bf16


# --------------------------------------------------------------- every block type
@pytest.mark.parametrize("qtype", TYPES)
def test_tiny_file_of_each_type_matches_dequantized(qtype, tmp_path):
    """Q8_0 is written with an untied output head (quantized too), the others tied."""
    path = write_quantized_gguf(str(tmp_path / f"{qtype}.gguf"), qtype, tied=qtype != "Q8_0")
    auto, cfg = load_model(path, dtype="float32", quantization="auto")
    none, _ = load_model(path, dtype="float32", quantization="none")
    layers = quantized_layers(auto)
    want_layers = 1 + 4 * cfg.num_layers + (qtype == "Q8_0")
    assert len(layers) == want_layers and set(layers.values()) == {int(GQ_ID[qtype])}
    assert not quantized_layers(none)
    prompt, follow = _tokens(11, cfg.vocab_size, 1), _tokens(3, cfg.vocab_size, 2)
    got = _script_logits(auto, cfg, prompt, follow)
    want = _script_logits(none, cfg, prompt, follow)
    torch.testing.assert_close(got, want, rtol=0, atol=TINY_RTOL * want.abs().max().item())


GQ_ID = {name: i for name, i in zip(TYPES, (8, 2, 3, 6, 7, 12, 13, 14), strict=True)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layer_with_parts_of_mixed_types_keeps_each_part(tmp_path, dtype):
    """A file whose attn_v is Q8_0, attn_q/k Q4_0, ffn_up Q6_K and ffn_gate Q4_0 (as
    llama.cpp's mixed presets write): each part of the fused q/k/v and gate/up layers
    stays its own blocks in one flat weight, the resident bytes are the file's, and the
    logits match the dequantized model. fp32: to fp32 rounding. bf16: against the fp32
    dequantized model, the blocks' error is of the size of bf16's own (the bf16
    dequantized model's error, measured alongside), never more than twice it."""
    path = write_quantized_gguf(str(tmp_path / "mixed.gguf"), "Q4_0",
                                types={"attn_v": "Q8_0", "ffn_up": "Q6_K"})
    auto, cfg = load_model(path, dtype=dtype, quantization="auto")
    none, _ = load_model(path, dtype=dtype, quantization="none")
    layers = quantized_layers(auto)
    qkv = auto.model.layers[0].self_attn.qkv_proj
    a = auto.model.layers[0].self_attn
    assert [(p.row_offset, p.qtype) for p in qkv.block_parts] == [
        (0, GQ_ID["Q4_0"]), (a.q_size, GQ_ID["Q4_0"]), (a.q_size + a.kv_size, GQ_ID["Q8_0"])]
    assert layers["model.layers.1.mlp.gate_up_proj#0"] == GQ_ID["Q4_0"]
    assert layers[f"model.layers.1.mlp.gate_up_proj#{cfg.intermediate_size}"] == GQ_ID["Q6_K"]
    assert qkv.weight.dtype == torch.uint8 and qkv.weight.dim() == 1
    assert weight_bytes(auto) < weight_bytes(none) / 3
    prompt = _tokens(9, cfg.vocab_size, 4)
    got, want = (_script_logits(m, cfg, prompt, [5, 6]).float() for m in (auto, none))
    if dtype == "float32":
        torch.testing.assert_close(got, want, rtol=0, atol=TINY_RTOL * want.abs().max().item())
        return
    exact, _ = load_model(path, dtype="float32", quantization="none")
    ref = _script_logits(exact, cfg, prompt, [5, 6])
    bf16_err, blocks_err = (want - ref).abs().max(), (got - ref).abs().max()
    assert 0 < blocks_err <= 2 * bf16_err, (float(blocks_err), float(bf16_err))


@pytest.mark.skipif(not rows16_types(), reason="no AVX2: no row-group kernel")
# Q4_K, Q5_K and Q6_K also take the kernel, but their tiny files are random bytes
# (logits in the hundreds), where the int8 activations' error says nothing about real
# weights; their kernel is held to the exact product in
# tests/kernels/test_cpu_gguf_rows16.py and their layers to the per-layer bits in
# tests/models/test_decoder_stack.py.
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_bf16_layers_take_the_row_group_kernel(tmp_path, qtype):
    """bf16 activations on a CPU with AVX2: the Linear layers of these types and the
    embedding are repacked in place (same shape and bytes; fp32 models keep the
    row-major blocks) and multiply by the int8 row-group kernel. Their logits' error
    against the fp32 dequantized model stays within 3x the bf16 dequantized model's own
    (int8 activations add about bf16's rounding again); binding again neither repacks
    nor changes a logit."""
    path = write_quantized_gguf(str(tmp_path / f"{qtype}.gguf"), qtype, tied=qtype != "Q8_0")
    auto, cfg = load_model(path, dtype="bfloat16", quantization="auto")
    plain, _ = load_model(path, dtype="float32", quantization="auto")
    linears = [m for m in auto.modules() if isinstance(m, Linear) and m.qtype is not None]
    assert len(linears) == 4 * cfg.num_layers + (qtype == "Q8_0")
    assert all(m.rows16 for m in linears)
    # The embedding too (the tied head's weight): lookups gather rows out of the groups.
    assert auto.model.embed_tokens.rows16
    assert not any(isinstance(m, Linear) and m.rows16 for m in plain.modules())
    by_name = dict(plain.named_modules())
    for name, m in auto.named_modules():
        if isinstance(m, Linear) and m.qtype is not None:
            assert m.weight.shape == by_name[name].weight.shape
    prompt = _tokens(9, cfg.vocab_size, 6)
    got = _script_logits(auto, cfg, prompt, [5, 6]).float()
    none, _ = load_model(path, dtype="bfloat16", quantization="none")
    exact, _ = load_model(path, dtype="float32", quantization="none")
    want, ref = _script_logits(none, cfg, prompt, [5, 6]).float(), _script_logits(
        exact, cfg, prompt, [5, 6])
    bf16_err, rows16_err = (want - ref).abs().max(), (got - ref).abs().max()
    assert 0 < rows16_err <= 3 * bf16_err, (float(rows16_err), float(bf16_err))
    packed = linears[0].weight.clone()
    bind_quantized_kernels(auto, torch.bfloat16)
    assert torch.equal(linears[0].weight, packed)
    assert torch.equal(_script_logits(auto, cfg, prompt, [5, 6]).float(), got)
    # Bound again for fp32 activations (whose fresh weights would stay row-major), the
    # packed bytes keep the kernel that reads them: fp32 embedding rows now, no garbage.
    bind_quantized_kernels(auto, torch.float32)
    assert torch.equal(linears[0].weight, packed)
    again = _script_logits(auto, cfg, prompt, [5, 6]).float()
    assert (again - got).abs().max() <= 4 * bf16_err  # misread bytes: ~100x


def test_triton_attention_backend_through_the_interpreter(tmp_path):
    """The Triton kernels (interpreted on the CPU) around layers holding blocks."""
    path = write_quantized_gguf(str(tmp_path / "q41.gguf"), "Q4_1")
    auto, cfg = load_model(path, dtype="float32", quantization="auto")
    none, _ = load_model(path, dtype="float32", quantization="none")
    prompt = _tokens(10, cfg.vocab_size, 5)
    got = _script_logits(auto, cfg, prompt, [7, 8], backend=deepinfer_kernels)
    want = _script_logits(none, cfg, prompt, [7, 8])
    # The Triton attention/norm kernels differ from the reference by fp32 rounding too.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# --------------------------------------------------------------- bad input
def test_unknown_quantization_is_a_value_error_naming_the_choices(smollm2_path):
    with pytest.raises(ValueError, match=r"quantization='int4': expected one of auto, none"):
        load_model(smollm2_path, quantization="int4")
    with pytest.raises(ValueError, match=r"quantization='gguf': expected one of auto, none"):
        EngineArgs(quantization="gguf").validate()


def test_tensor_parallel_split_through_a_block_is_refused_naming_the_tensor(tmp_path):
    """tp=2 gives each rank 128 of o_proj's 256 input columns: half a Q4_K block of 256.
    Q8_0 blocks (32 weights) split there fine."""
    path = write_quantized_gguf(str(tmp_path / "q4k.gguf"), "Q4_K")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'.*"
                                         r"cut through a Q4_K block of 256"):
        load_model(path, dtype="float32", tp=TPGroup(0, 2, None))
    ok = write_quantized_gguf(str(tmp_path / "q8.gguf"), "Q8_0")
    model, _ = load_model(ok, dtype="float32", tp=TPGroup(1, 2, None))
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.weight.shape == (256, 128 // 32 * 34) and o_proj.qtype == 8


def test_block_count_that_disagrees_with_the_shape_names_the_tensor(tmp_path):
    """A Q8_0 tensor whose header says rows of 40 weights, which are not whole blocks of
    32 (the writer refuses such a file, so its header is patched after writing)."""
    import struct

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "bad.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(0)
    w.add_tensor("token_embd.weight", np.ones((4, 34), np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight")
    assert struct.unpack_from("<IQ", data, at) == (2, 32)  # n_dims, then ne0
    struct.pack_into("<Q", data, at + 4, 40)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"'token_embd\.weight'.*40 weights.*Q8_0 blocks"):
        load_model(str(path))


def test_a_type_without_a_kernel_is_dequantized_with_one_warning(tmp_path):
    """Without the native library (DEEPINFER_NATIVE_CPU=0) the CPU has no GGUF kernel:
    the file loads dequantized, with one warning naming the type. A fresh process: the
    library is built and cached once per process."""
    path = write_quantized_gguf(str(tmp_path / "q50.gguf"), "Q5_0")
    code = (
        "import warnings, torch\n"
        "from deepinfer.loading.loader import load_model\n"
        "from deepinfer.models.quantized import quantized_layers\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    model, _ = load_model({path!r}, dtype='float32')\n"
        "msgs = [str(w.message) for w in caught if 'GGUF' in str(w.message)]\n"
        "print(len(msgs), msgs[0] if msgs else '', len(quantized_layers(model)))\n")
    env = {**os.environ, "DEEPINFER_NATIVE_CPU": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, *rest = proc.stdout.split()
    assert count == "1" and "Q5_0" in proc.stdout and "dequantized" in proc.stdout
    assert rest[-1] == "0"  # nothing kept as blocks
