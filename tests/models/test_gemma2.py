"""Gemma 2 (``Gemma2ForCausalLM``) against transformers on tiny random checkpoints: Gemma
3's block without q/k norms, every other layer sliding, and the two soft caps (the
attention scores' in every attention backend, the final logits'), set small here so that
they bite; a llama.cpp ``gemma2`` file; what a bad config gets."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from tests.checkpoints import assert_greedy_matches_hf
from tests.models.hf_checkpoints import (
    REMOVE,
    assert_engine_greedy_matches,
    assert_prompt_logits_match,
    folder_with,
    save_random_model,
)
from tests.models.paged_sim import PagedSim, prefill_then_decode
from tests.models.test_models import hf_logits

SHAPE = dict(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)
#: Small caps: random weights give scores of a few units and logits of ~10, so both
#: caps change the result (test_the_caps_are_felt).
CAPS = dict(attn_logit_softcapping=1.5, final_logit_softcapping=4.0)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """(path, HF model): a Gemma2ForCausalLM saved by transformers (eager attention: the
    one that caps), its norm weights random (transformers starts them at 0, which would
    hide an unfolded offset), layers 0 and 2 sliding with a window of 8."""
    from transformers import Gemma2Config

    cfg = Gemma2Config(**SHAPE, **CAPS, max_position_embeddings=256, rms_norm_eps=1e-6,
                       sliding_window=8, query_pre_attn_scalar=24, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, initializer_range=0.2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    path = str(tmp_path_factory.mktemp("gemma2"))
    return path, save_random_model(cfg, path, 61, norms=(0.0, 0.3),
                                   attn_implementation="eager")


def test_config_reads_as_gemma2config(gemma2):
    path, _ = gemma2
    cfg = ModelConfig.from_hf_folder(path)
    assert (cfg.architecture, cfg.hidden_act, cfg.norm_weight_offset, cfg.sandwich_norms,
            cfg.qk_norm, cfg.tie_word_embeddings, cfg.local_rope_theta) == (
        "Gemma2ForCausalLM", "gelu_tanh", True, True, False, True, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 4.0)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert cfg.attention_multiplier == pytest.approx(24 ** -0.5)


def test_prefill_then_decode_matches_transformers(gemma2):
    """40 tokens (a prefill of 25, 15 decode steps) on the torch reference: past the
    window, both caps biting."""
    path, hf = gemma2
    model, cfg = load_model(path, dtype="float32", device="cpu")
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    got = prefill_then_decode(model, cfg, {0: tokens}, {0: 25}, steps=15)[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_the_caps_are_felt(gemma2):
    """Without either cap the logits move: neither is a no-op of this checkpoint."""
    path, hf = gemma2
    tokens = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    want = hf_logits(hf, tokens)
    for field in CAPS:
        model, cfg = load_model(path, dtype="float32", device="cpu")
        setattr(cfg, field, None)
        for layer in model.model.layers:
            layer.self_attn.attn.softcap = cfg.attn_logit_softcapping
        got = PagedSim(cfg).step(model, {0: tokens}, is_prompt=True)
        assert (got - want).abs().max() > 0.05 * want.abs().max(), field


def test_engine_greedy_tokens_match_transformers(gemma2):
    assert_engine_greedy_matches(*gemma2, 24)


def test_triton_backend_interpreter(gemma2):
    """The Triton attention kernels (interpreted on a CPU) with both caps: a prompt past
    the window, 4 greedy tokens equal transformers'."""
    import deepinfer_kernels

    path, hf = gemma2
    llm = LLM(path, dtype="float32", device="cpu", attention_backend="triton",
              max_num_batched_tokens=8, max_num_seqs=2, kv_cache_memory=4 << 20,
              block_size=8)
    assert llm.engine.backend is deepinfer_kernels
    g = torch.Generator().manual_seed(9)
    assert_greedy_matches_hf(llm, hf, [torch.randint(3, 300, (n,), generator=g).tolist()
                                       for n in (11, 3)], 4)


@pytest.mark.parametrize("linear_type", [None, "Q8_0"], ids=["f32", "q8_0-kept"])
def test_gguf_file_matches_transformers(gemma2, tmp_path, linear_type):
    """A ``gemma2`` GGUF as llama.cpp's converter writes it (norms stored plus 1, the caps
    and the window as keys, the even layers sliding as llama.cpp assumes): its config and
    its logits over 40 tokens. The checkpoint's query_pre_attn_scalar (24) is not
    head_dim, so the file states its scale as llama.cpp's ``attention.scale``."""
    from tests.models.tiny_gguf import write_tiny_gguf

    _, hf = gemma2
    path = str(tmp_path / "gemma2.gguf")
    write_tiny_gguf(hf, "gemma2", path, linear_type=linear_type,
                    float_keys={"attention.scale": 24 ** -0.5})
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert (cfg.architecture, cfg.norm_weight_offset, cfg.qk_norm, cfg.local_rope_theta) == (
        "Gemma2ForCausalLM", False, False, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 4.0)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    # int8 weights: near
    assert_prompt_logits_match(model, cfg, hf, tokens, quantized=linear_type is not None)


def test_gguf_27b_scale_as_llama_cpp_reads_it():
    """Without ``attention.scale``: head_dim ** -0.5, and the 46-layer 27B's hidden /
    heads."""
    meta = {"general.architecture": "gemma2", "gemma2.embedding_length": 96,
            "gemma2.feed_forward_length": 128, "gemma2.attention.head_count": 4,
            "gemma2.attention.key_length": 32, "gemma2.vocab_size": 300,
            "gemma2.attention.sliding_window": 16, "gemma2.attn_logit_softcapping": 50.0}
    cfg = ModelConfig.from_gguf_metadata({**meta, "gemma2.block_count": 4})
    assert cfg.attention_multiplier == pytest.approx(32 ** -0.5)
    assert (cfg.sliding_layers, cfg.final_logit_softcapping) == ((0, 2), None)
    cfg = ModelConfig.from_gguf_metadata({**meta, "gemma2.block_count": 46})
    assert cfg.attention_multiplier == pytest.approx(24 ** -0.5)


def test_null_caps_are_none_and_absent_ones_the_defaults(gemma2, tmp_path):
    a = ModelConfig.from_hf_folder(folder_with(gemma2[0], str(tmp_path / "a"),
                                               attn_logit_softcapping=None,
                                               final_logit_softcapping=None))
    assert (a.attn_logit_softcapping, a.final_logit_softcapping) == (None, None)
    b = ModelConfig.from_hf_folder(folder_with(gemma2[0], str(tmp_path / "b"),
                                               **dict.fromkeys(CAPS, REMOVE)))
    assert (b.attn_logit_softcapping, b.final_logit_softcapping) == (50.0, 30.0)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping=-1.0 must be a positive"),
    ({"final_logit_softcapping": "x"}, "final_logit_softcapping='x' must be a positive"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
])
def test_bad_config_is_named(gemma2, tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_folder(folder_with(gemma2[0], str(tmp_path / "c"), **change))
