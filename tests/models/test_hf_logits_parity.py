"""Checkpoints whose ``config.json`` exercises per-architecture rules of transformers,
loaded by ``load_model`` and run on the reference backend: every position's fp32 logits
equal those of transformers' own load of the same folder.

Covered: attention biases (q/k/v and o_proj with ``attention_bias`` on Llama, Qwen3,
Qwen3-MoE and OLMoE; q/k/v only on Qwen2 and Qwen2-MoE; none on Mistral and Mixtral
whatever the config says), defaults of omitted keys (Mixtral's rope_theta 1e6),
``rope_parameters`` without a theta, YaRN RoPE, a zero-width Qwen2-MoE shared expert, Mixtral and
OLMoE ignoring ``decoder_sparse_step``/``mlp_only_layers``, omitted ``num_key_value_heads``
and ``head_dim``, ``mlp_bias`` ignored outside Llama, and which ``sliding_window`` settings
make transformers slide some layer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer.loading.loader import load_model
from tests.models.hf_checkpoints import REMOVE, save_hf_checkpoint, tiny_config
from tests.models.paged_sim import PagedSim, prefill_then_decode
from tests.models.test_models import ATOL, hf_logits

PROMPT = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(12)).tolist()
NO_ROPE = {"rope_parameters": REMOVE, "rope_theta": REMOVE, "rope_scaling": REMOVE}

#: id -> (tiny config name, switches on the transformers config, config.json changes,
#: what must hold of our model: o_proj bias present, q/k/v bias present).
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], tuple[bool, bool]]] = {
    "llama_bias": ("llama3", {"attention_bias": True}, {}, (True, True)),
    "qwen3_bias": ("qwen3", {"attention_bias": True}, {}, (True, True)),
    "qwen3_moe_bias": ("qwen3_moe", {"attention_bias": True}, {}, (True, True)),
    "olmoe_bias": ("olmoe", {"attention_bias": True}, {}, (True, True)),
    # Qwen2: q/k/v bias always, o_proj never (attention_bias is not its switch).
    "qwen2_attention_bias_key": ("qwen2", {}, {"attention_bias": True}, (False, True)),
    "qwen2_moe_qkv_bias": ("qwen2_moe", {}, {"attention_bias": True}, (False, True)),
    "qwen2_moe_no_qkv_bias": ("qwen2_moe", {"qkv_bias": False}, {}, (False, False)),
    # Mistral/Mixtral: transformers builds no bias whatever config.json says.
    "mistral_attention_bias_key": ("mistral", {}, {"attention_bias": True}, (False, False)),
    "mixtral_attention_bias_key": ("mixtral", {}, {"attention_bias": True}, (False, False)),
    # Omitted keys take transformers' per-architecture defaults (Mixtral: theta 1e6).
    "mixtral_no_rope_keys": ("mixtral", {}, {**NO_ROPE, "rms_norm_eps": REMOVE},
                             (False, False)),
    # rope_parameters without a theta: top-level rope_theta, else the default; the
    # scaling is kept either way.
    "qwen3_rope_parameters_top_theta": (
        "qwen3", {}, {**NO_ROPE, "rope_parameters": {"rope_type": "linear", "factor": 4.0},
                      "rope_theta": 50000.0}, (False, False)),
    "mixtral_rope_parameters_default_theta": (
        "mixtral", {}, {**NO_ROPE, "rope_parameters": {"rope_type": "linear", "factor": 4.0}},
        (False, False)),
    # YaRN: NTK-by-parts frequencies and the attention factor on cos/sin; the prompt runs
    # past the original length. Its options: DeepSeek's mscale ratio, no truncation,
    # custom betas; a null factor (max_position_embeddings over the original length);
    # an explicit attention factor.
    "qwen3_yarn": ("qwen3", {}, {**NO_ROPE, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 1e4}}, (False, False)),
    "llama_yarn_mscale_untruncated": ("llama3", {}, {**NO_ROPE, "rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 8, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
        "truncate": False, "rope_theta": 500.0}}, (False, False)),
    "qwen2_yarn_null_factor": ("qwen2", {}, {**NO_ROPE, "rope_scaling": {
        "type": "yarn", "factor": None, "original_max_position_embeddings": 64},
        "rope_theta": 1e4}, (False, True)),
    # (head_dim explicit: transformers' YaRN needs it on Mixtral, where it may be null.)
    "mixtral_yarn_attention_factor": ("mixtral", {"head_dim": 16}, {**NO_ROPE, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 24,
        "attention_factor": 1.3}}, (False, False)),
    # transformers builds a zero-width shared expert (output 0): nothing to load.
    "qwen2_moe_shared_expert_0": ("qwen2_moe", {"shared_expert_intermediate_size": 0}, {},
                                  (False, True)),
    # Qwen-MoE settings that Mixtral and OLMoE do not have: every layer stays sparse.
    "mixtral_sparse_step_key": ("mixtral", {}, {"decoder_sparse_step": 2,
                                                "mlp_only_layers": [0]}, (False, False)),
    "olmoe_sparse_step_key": ("olmoe", {}, {"decoder_sparse_step": 0,
                                            "mlp_only_layers": [1, 2]}, (False, False)),
    # Omitted num_key_value_heads / head_dim: the class defaults (Mistral 8 heads, Qwen2-MoE
    # 16, Qwen3-MoE 4, Qwen3 head_dim 128; fewer than num_attention_heads, so the fallback
    # would differ), else num_attention_heads / hidden // heads.
    "llama_no_kv_heads": ("llama3", {"num_key_value_heads": 4},
                          {"num_key_value_heads": REMOVE, "head_dim": REMOVE}, (False, False)),
    "mistral_no_kv_heads": ("mistral", {"num_attention_heads": 16, "num_key_value_heads": 8,
                                        "head_dim": 4},
                            {"num_key_value_heads": REMOVE, "head_dim": REMOVE}, (False, False)),
    "qwen3_no_head_dim": ("qwen3", {"head_dim": 128}, {"head_dim": REMOVE}, (False, False)),
    "qwen3_moe_no_kv_heads": ("qwen3_moe", {"num_attention_heads": 8,
                                            "num_key_value_heads": 4, "head_dim": 8},
                              {"num_key_value_heads": REMOVE, "head_dim": REMOVE},
                              (False, False)),
    "olmoe_no_kv_heads": ("olmoe", {"num_key_value_heads": 4}, {"num_key_value_heads": REMOVE},
                          (False, False)),
    "qwen2_moe_no_kv_heads": ("qwen2_moe", {"num_attention_heads": 32,
                                            "num_key_value_heads": 16},
                              {"num_key_value_heads": REMOVE}, (False, True)),
    # mlp_bias is Llama's switch only: the others build bias-free MLPs whatever it says.
    "qwen2_mlp_bias_key": ("qwen2", {}, {"mlp_bias": True}, (False, True)),
    "mixtral_mlp_bias_key": ("mixtral", {}, {"mlp_bias": True}, (False, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    name, switches, changes, (o_bias, qkv_bias) = CASES[case]
    seed = 3000 + list(CASES).index(case)
    hf = save_hf_checkpoint(tiny_config(name, **switches), str(tmp_path), seed, changes)
    model, cfg = load_model(str(tmp_path), dtype="float32", device="cpu")
    attn = model.model.layers[0].self_attn
    assert (attn.o_proj.bias is not None, attn.qkv_proj.bias is not None) == (o_bias, qkv_bias)
    hf_attn = hf.model.layers[0].self_attn
    assert (hf_attn.o_proj.bias is not None, hf_attn.q_proj.bias is not None) == (
        o_bias, qkv_bias)  # the case really is what it says for transformers
    if cfg.num_experts:  # the same layers are sparse
        assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [
            hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    got = PagedSim(cfg, num_blocks=16, block_size=4).step(model, {0: PROMPT}, True)
    want = hf_logits(hf, PROMPT)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert want.abs().max() > 0.05


#: Which layers slide: id -> (tiny config name, config.json changes, whether transformers
#: slides some layer). Ours slides the same layers (``ModelConfig.layer_window``), so the
#: logits agree at every position, within and past the window.
WINDOW = {"sliding_window": 8, "layer_types": REMOVE}
SLIDING: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama_window_key": ("llama3", {"sliding_window": 8}, False),
    "olmoe_window_key": ("olmoe", {"sliding_window": 8}, False),
    "mistral_window": ("mistral", {"sliding_window": 8}, True),
    "mixtral_window": ("mixtral", {"sliding_window": 8}, True),
    # Qwen2/Qwen3: layers >= max_window_layers (saved as 28 > 2 layers), if
    # use_sliding_window; explicit layer_types win.
    "qwen2_window_below_max_window_layers": ("qwen2", {**WINDOW, "use_sliding_window": True},
                                             False),
    "qwen2_window": ("qwen2", {**WINDOW, "use_sliding_window": True, "max_window_layers": 1},
                     True),
    "qwen3_window_off": ("qwen3", {**WINDOW, "max_window_layers": 0}, False),
    "qwen3_layer_types": ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"]},
                          True),
    # Qwen3-MoE: every layer; Qwen2-MoE: even layers below max_window_layers.
    "qwen3_moe_window": ("qwen3_moe", {**WINDOW, "use_sliding_window": True}, True),
    "qwen2_moe_window": ("qwen2_moe", {**WINDOW, "use_sliding_window": True}, True),
    "qwen2_moe_window_max_window_layers_0": (
        "qwen2_moe", {**WINDOW, "use_sliding_window": True, "max_window_layers": 0}, False),
}


@pytest.mark.parametrize("case", list(SLIDING))
def test_sliding_window_where_transformers_slides(case, tmp_path):
    """Ours against transformers on a 40-token prompt, window 8: a prefill of 28 tokens,
    then 12 decode steps, equal at every position (a window that slid nothing, or full
    attention where transformers slides, would part after position 8)."""
    name, changes, slides = SLIDING[case]
    seed = 4000 + list(SLIDING).index(case)
    hf = save_hf_checkpoint(tiny_config(name), str(tmp_path), seed, changes)
    model, cfg = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert cfg.sliding_window == (8 if slides else None)
    got = prefill_then_decode(model, cfg, {0: PROMPT}, {0: 28}, steps=12)[0]
    want = hf_logits(hf, PROMPT)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("same", [True, False])
def test_tied_config_with_a_stored_head_as_transformers(same, tmp_path):
    """``tie_word_embeddings`` set and an ``lm_head.weight`` stored too: a copy of the
    embedding is skipped; a different one is used untied (with a warning), as
    transformers does."""
    import warnings

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    save_hf_checkpoint(tiny_config("llama_tied"), str(tmp_path), 5100, reference=False)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    emb = tensors["model.embed_tokens.weight"]
    head = emb.clone() if same else torch.randn(emb.shape, generator=torch.Generator()
                                                .manual_seed(5101))
    save_file({**tensors, "lm_head.weight": head}, str(weights), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, cfg = load_model(str(tmp_path), dtype="float32", device="cpu")
    untied = [w for w in caught if "differs from the embedding" in str(w.message)]
    assert (model.lm_head is None, len(untied)) == ((True, 0) if same else (False, 1))
    got = PagedSim(cfg, num_blocks=16, block_size=4).step(model, {0: PROMPT}, True)
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), atol=ATOL, rtol=0)
