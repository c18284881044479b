"""The default SmolLM2-135M-Instruct Q4_1 GGUF: our dequantization + un-permuted q/k rows
vs transformers' own GGUF loader (which dequantizes the same blocks), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged_sim import PagedSim
from tests.models.tiny_gguf import write_tiny_gguf


def test_config_from_gguf_metadata(smollm2_model):
    _, cfg = smollm2_model
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM", 30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (576, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_logits_match_transformers(smollm2_model, smollm2_tokenizer, hf_smollm2):
    from deepinfer.tokenizer import apply_chat_template

    model, cfg = smollm2_model
    tokens = apply_chat_template(smollm2_tokenizer,
                                 [{"role": "user", "content": "What is the capital of France?"}])
    prompt, follow = tokens, [504, 3575, 282]  # a few teacher-forced decode tokens
    sim = PagedSim(cfg, num_blocks=16, block_size=8)
    ours = [sim.step(model, {0: prompt}, is_prompt=True)]
    for tok in follow:
        ours.append(sim.step(model, {0: [tok]}, is_prompt=False))
    got = torch.cat(ours)
    with torch.inference_mode():
        want = hf_smollm2(torch.tensor([prompt + follow])).logits[0, : got.shape[0]].float()
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= 1e-3 * scale, f"max abs diff {diff} at logit scale {scale}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name,arch", [("llama3", "llama"), ("qwen2", "qwen2"),
                                       ("qwen3", "qwen3")])
def test_tiny_gguf_matches_hf(name, arch, tiny_checkpoints, tmp_path):
    from deepinfer.loading.loader import load_model
    from tests.models.test_models import hf_logits

    ck = tiny_checkpoints[name]
    path = str(tmp_path / f"{name}.gguf")
    write_tiny_gguf(ck.hf_model, arch, path)
    # float32: dtype "auto" gives a GGUF bf16 on a CPU with native bf16.
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert cfg.tie_word_embeddings == ck.hf_model.config.tie_word_embeddings
    tokens = torch.randint(3, cfg.vocab_size, (10,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    got = PagedSim(cfg).step(model, {0: tokens}, is_prompt=True)
    want = hf_logits(ck.hf_model, tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if name == "llama3":
        assert cfg.rope_freq_factors is not None and max(cfg.rope_freq_factors) == 8.0


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from tests.models.moe_checkpoints import make_moe_checkpoints

    return make_moe_checkpoints(tmp_path_factory.mktemp("tiny_moe_gguf"))


@pytest.mark.parametrize("name,arch,per_expert", [
    ("qwen3_moe", "qwen3moe", False), ("qwen2_moe", "qwen2moe", False),
    ("olmoe", "olmoe", False), ("mixtral", "llama", False), ("mixtral", "llama", True)])
def test_tiny_moe_gguf_matches_hf(name, arch, per_expert, moe_checkpoints, tmp_path):
    """MoE GGUFs as llama.cpp writes them (stacked ``ffn_*_exps``, the router as
    ``ffn_gate_inp``, Qwen2-MoE's shared expert, OLMoE's clamp; Mixtral as a llama file
    with experts, also with the older one-tensor-per-expert layout): the same logits as
    transformers on the checkpoint they were written from, the dense layers of
    ``mlp_only_layers`` / ``decoder_sparse_step`` included."""
    from deepinfer.loading.loader import load_model
    from tests.models.test_models import hf_logits

    ck = moe_checkpoints[name]
    path = str(tmp_path / f"{name}.gguf")
    write_tiny_gguf(ck.hf_model, arch, path, per_expert=per_expert)
    model, cfg = load_model(path, dtype="float32", device="cpu")
    hf = ck.hf_model.config
    want_arch = "MixtralForCausalLM" if arch == "llama" else type(ck.hf_model).__name__
    assert cfg.architecture == want_arch
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ck.hf_model.model.layers]
    assert cfg.norm_topk_prob == (True if name == "mixtral" else hf.norm_topk_prob)
    tokens = torch.randint(3, cfg.vocab_size, (12,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    got = PagedSim(cfg).step(model, {0: tokens}, is_prompt=True)
    torch.testing.assert_close(got, hf_logits(ck.hf_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name,arch,per_expert,qtype", [
    ("qwen3_moe", "qwen3moe", False, "Q8_0"), ("qwen2_moe", "qwen2moe", False, "Q4_1"),
    ("mixtral", "llama", True, "Q4_0")])
def test_quantized_experts_stay_blocks(name, arch, per_expert, qtype, moe_checkpoints,
                                       tmp_path):
    """Experts stored as blocks (stacked, or one tensor each) stay blocks under
    ``quantization="auto"`` on the CPU: uint8 stacks, fewer resident bytes, and the
    logits of the dequantized model. fp32: the same weights, fp32 sums in another order
    (1e-4). bf16 (2+ rows through the bf16 GEMM): both models round activations to bf16
    between ops, so they drift apart by a few bf16 steps of the logits' size; 2e-2 of
    the largest logit bounds that, far below a wrong expert or block."""
    from deepinfer.loading.loader import load_model
    from deepinfer.models.moe import SparseMoeBlock
    from deepinfer.models.quantized import quantized_layers, weight_bytes

    path = str(tmp_path / f"{name}.gguf")
    write_tiny_gguf(moe_checkpoints[name].hf_model, arch, path, per_expert=per_expert,
                     expert_type=qtype)
    tokens = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(9)).tolist()
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 2e-2)):
        auto, cfg = load_model(path, dtype=dtype, quantization="auto")
        none, _ = load_model(path, dtype=dtype, quantization="none")
        blocks = [m for m in auto.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks and all(b.w13.dtype == b.w2.dtype == torch.uint8 for b in blocks)
        assert sum(k.endswith((".w13", ".w2")) for k in quantized_layers(auto)) == 2 * len(
            blocks)
        assert weight_bytes(auto) < weight_bytes(none)
        got = PagedSim(cfg).step(auto, {0: tokens, 1: tokens[:5]}, is_prompt=True).float()
        want = PagedSim(cfg).step(none, {0: tokens, 1: tokens[:5]}, is_prompt=True).float()
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() <= tol * want.abs().max(), dtype


@pytest.mark.parametrize("backend_name", ["triton", "reference"])
def test_quantized_experts_through_fused_moe_gguf(backend_name, moe_checkpoints, tmp_path):
    """What a CUDA model runs: the expert stacks read whole by the backend's
    ``fused_moe_gguf`` (no per-expert binding, no host sync), here the Triton kernels
    through the interpreter and the reference, with the bindings the CPU keeps dropped.
    Logits of the dequantized model (fp32: 1e-4 of the largest logit); Q8_0 experts (the
    tiny model's widths are not whole K-quant blocks; tests/kernels/test_moe_gguf.py
    covers every type)."""
    import deepinfer_kernels
    from deepinfer.loading.loader import load_model
    from deepinfer.models.moe import SparseMoeBlock
    from deepinfer_kernels import reference

    backend = deepinfer_kernels if backend_name == "triton" else reference
    path = str(tmp_path / "qwen3_moe.gguf")
    write_tiny_gguf(moe_checkpoints["qwen3_moe"].hf_model, "qwen3moe", path,
                     expert_type="Q8_0")
    auto, cfg = load_model(path, dtype="float32", quantization="auto")
    none, _ = load_model(path, dtype="float32", quantization="none")
    blocks = [m for m in auto.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.experts_qtypes and b.expert_matmuls for b in blocks)
    for b in blocks:
        b.expert_matmuls = []  # as bind_expert_kernels leaves them off the CPU
    tokens = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    got = PagedSim(cfg).step(auto, {0: tokens, 1: tokens[:4]}, is_prompt=True,
                             backend=backend).float()
    want = PagedSim(cfg).step(none, {0: tokens, 1: tokens[:4]}, is_prompt=True).float()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_experts_without_expert_kernels_are_planned_dequantized(moe_checkpoints, tmp_path):
    """Where the device has GGUF kernels but none for experts, the experts are left out
    of the plan and named for the loader's warning; with them, every expert of every
    layer is planned. ``gguf_kernels.expert_kernel_types`` gives every type on CUDA
    (Triton's ``fused_moe_gguf``) as on the CPU."""
    from deepinfer.loading.gguf_file import quantized_plan
    from deepinfer.loading.gguf_reader import open_gguf
    from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
    from deepinfer_kernels.gguf_kernels import expert_kernel_types, kernel_types

    path = str(tmp_path / "mixtral.gguf")
    write_tiny_gguf(moe_checkpoints["mixtral"].hf_model, "llama", path, expert_type="Q8_0")
    everything = frozenset(BLOCK_FORMATS)
    plan, missing = quantized_plan(open_gguf(path), everything)
    assert not any(".experts." in n for n in plan) and missing == {"Q8_0 experts"}
    plan, missing = quantized_plan(open_gguf(path), everything, everything)
    cfg = moe_checkpoints["mixtral"].hf_model.config
    assert expert_kernel_types("cuda") == kernel_types("cuda") == everything
    assert expert_kernel_types("cpu") == kernel_types("cpu")
    assert sum(".experts." in n for n in plan) == 3 * 4 * cfg.num_hidden_layers
    assert not missing


def test_moe_gguf_without_expert_counts_is_named(moe_checkpoints, tmp_path):
    """A MoE file lacking ``expert_used_count``: a ValueError naming the key."""
    import gguf

    from deepinfer.loading.loader import load_model

    path = str(tmp_path / "q.gguf")
    write_tiny_gguf(moe_checkpoints["qwen3_moe"].hf_model, "qwen3moe", path)
    reader = gguf.GGUFReader(path)
    assert "qwen3moe.expert_used_count" in reader.fields
    # Rename the key in place (same length), as a file written without it would read.
    raw = open(path, "rb").read().replace(b"qwen3moe.expert_used_count",
                                          b"qwen3moe.expert_usedXcount")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw)
    with pytest.raises(ValueError, match="qwen3moe.expert_used_count"):
        load_model(str(bad), dtype="float32", device="cpu")


def _moe_meta(arch: str, **keys) -> dict:
    """GGUF key/values of a small MoE file of llama.cpp architecture ``arch``."""
    meta = {"general.architecture": arch, f"{arch}.block_count": 2,
            f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.feed_forward_length": 96, f"{arch}.expert_count": 6,
            f"{arch}.expert_used_count": 2, f"{arch}.vocab_size": 300}
    meta.update({f"{arch}.{k}": v for k, v in keys.items()})
    return meta


def test_moe_gguf_keys_as_llama_cpp_reads_them():
    """Keys older converters leave out: a Qwen MoE file without
    ``expert_feed_forward_length`` has experts of ``feed_forward_length / top-k`` (Mixtral's
    and OLMoE's are ``feed_forward_length``); without ``expert_weights_norm`` the top-k is
    renormalised as llama.cpp's graph for the architecture does; with it, as it says.
    q/k/v biases follow the file's tensors."""
    from deepinfer.config import ModelConfig

    def cfg(arch, **keys):
        return ModelConfig.from_gguf_metadata(_moe_meta(arch, **keys), qkv_bias=False)

    assert cfg("qwen2moe").moe_intermediate_size == 48
    assert cfg("qwen3moe").moe_intermediate_size == 48
    assert cfg("olmoe").moe_intermediate_size == 96
    assert cfg("llama").moe_intermediate_size == 96
    assert cfg("qwen3moe", expert_feed_forward_length=32).moe_intermediate_size == 32
    assert cfg("qwen2moe").shared_expert_intermediate_size == 96
    assert [cfg(a).norm_topk_prob for a in ("qwen3moe", "llama", "qwen2moe", "olmoe")] == [
        True, True, False, False]
    assert cfg("qwen2moe", expert_weights_norm=True).norm_topk_prob is True
    assert cfg("qwen3moe", expert_weights_norm=False).norm_topk_prob is False
    assert cfg("llama").architecture == "MixtralForCausalLM"
    assert not cfg("qwen2moe").attention_bias  # a file without q/k/v biases
    assert ModelConfig.from_gguf_metadata(_moe_meta("qwen2moe")).attention_bias
    with pytest.raises(ValueError, match="olmoe.expert_count"):
        ModelConfig.from_gguf_metadata({**_moe_meta("olmoe"), "olmoe.expert_count": None})
