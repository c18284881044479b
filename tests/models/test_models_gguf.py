"""The default SmolLM2-135M-Instruct Q4_1 GGUF: our dequantization + un-permuted q/k rows
vs transformers' own GGUF loader (which dequantizes the same blocks), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged_sim import PagedSim


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


# --------------------------------------------------------------- tiny GGUFs from HF models
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _expert_tensors(c, i: str, rest: str, t: torch.Tensor,
                    per_expert: bool) -> list[tuple[str, torch.Tensor]]:
    """GGUF tensors of a transformers 5 stacked expert tensor (``gate_up_proj [E, 2I, H]``
    or ``down_proj [E, H, I]``): llama.cpp's ``ffn_*_exps`` stacks, or with ``per_expert``
    the older Mixtral files' ``ffn_*.{e}`` tensors."""
    if rest == "mlp.experts.gate_up_proj":
        inter = t.shape[1] // 2
        parts = [("gate", t[:, :inter]), ("up", t[:, inter:])]
    else:
        parts = [("down", t)]
    if per_expert:
        return [(f"blk.{i}.ffn_{p}.{e}.weight", x[e]) for p, x in parts
                for e in range(x.shape[0])]
    return [(f"blk.{i}.ffn_{p}_exps.weight", x) for p, x in parts]


def _write_tiny_gguf(hf_model, arch: str, path: str, per_expert: bool = False) -> None:
    """What llama.cpp's converter does, in miniature: F32 tensors, llama q/k permuted,
    experts stacked (or one tensor each, ``per_expert``), MoE keys."""
    import numpy as np
    from gguf import GGUFWriter

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        if getattr(c, "norm_topk_prob", None) is not None:
            w.add_expert_weights_norm(c.norm_topk_prob)
        if getattr(c, "clip_qkv", None):
            w.add_clamp_kqv(c.clip_qkv)
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":
        # llama.cpp stores Llama 3.1 scaling as per-frequency divisors, rope_freqs.weight.
        import math

        base, f = rope["rope_theta"], rope["factor"]
        lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        factors = []
        for k in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (k / head_dim)
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(f)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - s) / f + s))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for name, t in hf_model.state_dict().items():
        t = t.float()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest.startswith("mlp.experts."):
                for gname, x in _expert_tensors(c, i, rest, t, per_expert):
                    w.add_tensor(gname, np.ascontiguousarray(x.numpy()))
                continue
            mod, kind = rest.rsplit(".", 1)
            if mod == "mlp.shared_expert_gate":
                t = t.reshape(-1)  # llama.cpp stores it as a vector
            if arch == "llama" and mod in ("self_attn.q_proj", "self_attn.k_proj"):
                h = c.num_attention_heads if "q_proj" in mod else c.num_key_value_heads
                t = t.reshape(h, 2, t.shape[0] // h // 2, *t.shape[1:]).transpose(1, 2)
                t = t.reshape(-1, *hf_model.state_dict()[name].shape[1:])
            gname = f"blk.{i}.{_GGUF_LAYER[mod]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
            if gname == "output.weight" and c.tie_word_embeddings:
                continue
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name,arch", [("llama3", "llama"), ("qwen2", "qwen2"),
                                       ("qwen3", "qwen3")])
def test_tiny_gguf_matches_hf(name, arch, tiny_checkpoints, tmp_path):
    from deepinfer.loading.loader import load_model
    from tests.models.test_models import hf_logits

    ck = tiny_checkpoints[name]
    path = str(tmp_path / f"{name}.gguf")
    _write_tiny_gguf(ck.hf_model, arch, path)
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
    _write_tiny_gguf(ck.hf_model, arch, path, per_expert=per_expert)
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


def test_moe_gguf_without_expert_counts_is_named(moe_checkpoints, tmp_path):
    """A MoE file lacking ``expert_used_count``: a ValueError naming the key."""
    import gguf

    from deepinfer.loading.loader import load_model

    path = str(tmp_path / "q.gguf")
    _write_tiny_gguf(moe_checkpoints["qwen3_moe"].hf_model, "qwen3moe", path)
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
