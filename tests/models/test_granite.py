"""Granite (``GraniteForCausalLM``): a Llama with four scalars (embedding, residual,
attention and logits multipliers). How ``config.json`` maps onto them, and the engine's
greedy tokens against transformers', and the CPU's fused decode step (every scalar
through it) against the layers one by one."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.models.decoder_stack import decoder_stack_spec
from deepinfer_kernels import cpu_gguf

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
ARCH = {"architectures": ["GraniteForCausalLM"]}


def test_multipliers_are_read_and_default_to_the_class_defaults():
    cfg = ModelConfig.from_hf_config({**ARCH, **SHAPE, "embedding_multiplier": 12.0,
                                      "residual_multiplier": 0.22,
                                      "attention_multiplier": 0.015625,
                                      "logits_scaling": 8})
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
            cfg.logits_scaling) == (12.0, 0.22, 0.015625, 8.0)
    bare = ModelConfig.from_hf_config({**ARCH, **SHAPE, "logits_scaling": None})
    # transformers' GraniteConfig: every scalar 1.0, so scores are not scaled by 1/sqrt(d).
    assert (bare.embedding_multiplier, bare.residual_multiplier, bare.attention_multiplier,
            bare.logits_scaling) == (1.0, 1.0, 1.0, 1.0)
    llama = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **SHAPE,
                                        "embedding_multiplier": 12.0})
    assert llama.embedding_multiplier == 1.0 and llama.attention_multiplier is None


@pytest.mark.parametrize("value", [0, -1.0, "2", True, float("inf"), [1.0]])
@pytest.mark.parametrize("key", ["embedding_multiplier", "residual_multiplier",
                                 "attention_multiplier", "logits_scaling"])
def test_bad_multiplier_is_named(key, value):
    with pytest.raises(ValueError, match=f"GraniteForCausalLM: {key}=.* must be a positive"):
        ModelConfig.from_hf_config({**ARCH, **SHAPE, key: value})


def _save_granite(path, **scalars):
    from transformers import AutoModelForCausalLM, GraniteConfig

    from deepinfer.testing.random_model import build_bpe_tokenizer

    torch.manual_seed(11)
    cfg = GraniteConfig(**SHAPE, max_position_embeddings=256, rms_norm_eps=1e-5,
                        initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False, **scalars)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(str(path), safe_serialization=True)
    build_bpe_tokenizer().save_pretrained(str(path))
    return hf


PROMPTS = [[5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 41, 55],
           [9, 8, 7], [5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 44]]


def _greedy(llm: LLM, n: int = 10):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n,
                                                ignore_eos=True, logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [float(getattr(lp[t], "logprob", lp[t]))
              for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("residual", [1.0, 0.4])
def test_greedy_tokens_match_transformers(tmp_path, residual):
    """float32, layer by layer: tokens and their log-probabilities as transformers'."""
    hf = _save_granite(tmp_path, embedding_multiplier=4.0, residual_multiplier=residual,
                       attention_multiplier=0.08, logits_scaling=3.0)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=3,
              kv_cache_memory=8 << 20, block_size=8)
    n = 10
    for p, (tokens, logprobs) in zip(PROMPTS, _greedy(llm, n)):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)
        assert tokens == want.sequences[0, len(p):].tolist()
        # the logits scaling shows in the log-probabilities, not in the argmax
        want_lp = [torch.log_softmax(step[0].float(), -1)[t].item()
                   for step, t in zip(want.logits, tokens)]
        assert logprobs == pytest.approx(want_lp, abs=1e-4)


@pytest.mark.skipif(not cpu_gguf.bf16_gemm(), reason="no AVX512-BF16: dense weights unbound")
@pytest.mark.parametrize("residual", [1.0, 0.4])
def test_fused_decode_step_equals_layer_by_layer(tmp_path, residual, monkeypatch):
    """bfloat16 (the CPU's fused decode step takes bf16 or GGUF weights): the embedding
    scale applied before the step, the attention scale and the residual multiplier inside
    it (each product rounded to bf16, as the layer's multiply rounds it): the
    layer-by-layer bits."""
    _save_granite(tmp_path, embedding_multiplier=4.0, residual_multiplier=residual,
                  attention_multiplier=0.08, logits_scaling=3.0)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cpu", max_num_seqs=3,
              kv_cache_memory=8 << 20, block_size=8)
    model = llm.engine.runner.model
    spec = decoder_stack_spec(model)
    assert spec is not None and spec.residual_multiplier == residual
    fused = _greedy(llm)
    monkeypatch.setattr(type(model.decoder_stack), "get", lambda self, m, b: None)
    assert _greedy(llm) == fused


def test_gguf_file_matches_transformers(tmp_path):
    """A granite GGUF as llama.cpp's converter writes it (q/k permuted, the four scalars
    as ``granite.embedding_scale`` etc.): its config and its logits."""
    from deepinfer.loading.loader import load_model
    from tests.models.paged_sim import PagedSim
    from tests.models.test_models import hf_logits
    from tests.models.tiny_gguf import write_tiny_gguf

    hf = _save_granite(tmp_path / "hf", embedding_multiplier=4.0, residual_multiplier=0.4,
                       attention_multiplier=0.08, logits_scaling=3.0)
    path = str(tmp_path / "granite.gguf")
    write_tiny_gguf(hf, "granite", path)
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert cfg.architecture == "GraniteForCausalLM"
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
            cfg.logits_scaling) == pytest.approx((4.0, 0.4, 0.08, 3.0))
    tokens = torch.randint(3, cfg.vocab_size, (10,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    got = PagedSim(cfg).step(model, {0: tokens}, is_prompt=True)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_gguf_attention_scale_zero_or_absent_is_one_over_sqrt_head_dim():
    """llama.cpp's reading: a granite file's attention.scale of 0 (or none) scales scores
    by 1 / sqrt(head_dim); absent multipliers are 1; a negative one is named."""
    meta = {"general.architecture": "granite", "granite.embedding_length": 64,
            "granite.attention.head_count": 4, "granite.feed_forward_length": 128,
            "granite.block_count": 2, "granite.vocab_size": 300}
    for extra in ({}, {"granite.attention.scale": 0.0}):
        cfg = ModelConfig.from_gguf_metadata({**meta, **extra})
        assert cfg.attention_multiplier is None and cfg.logits_scaling == 1.0
    with pytest.raises(ValueError, match=r"granite.residual_scale=-0.5 must be a positive"):
        ModelConfig.from_gguf_metadata({**meta, "granite.residual_scale": -0.5})
