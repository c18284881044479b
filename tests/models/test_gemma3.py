"""Gemma 3 (``Gemma3ForCausalLM``: Gemma-3-270M / 1B and the text part of the larger ones)
against transformers on tiny random checkpoints: norms stored as offsets from 1 and
folded at load, the norms after attention and MLP, GeGLU, q/k norms, the embedding scale
rounded to the dtype, ``query_pre_attn_scalar``, sliding layers with their own RoPE base
past their window; both config layouts; what a bad config gets."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from deepinfer.models.decoder_stack import decoder_stack_spec
from tests.checkpoints import assert_greedy_matches_hf
from tests.models.hf_checkpoints import (
    REMOVE,
    assert_engine_greedy_matches,
    assert_prompt_logits_match,
    folder_with,
    save_random_model,
)
from tests.models.paged_sim import prefill_then_decode
from tests.models.test_models import hf_logits

SHAPE = dict(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention"]


def _config(**kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **SHAPE, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8,
        layer_types=LAYER_TYPES, query_pre_attn_scalar=24, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.1,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        **kw)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(path, HF model): a Gemma3ForCausalLM saved by transformers, its norm weights
    random (transformers starts them at 0, which would hide an unfolded offset)."""
    path = str(tmp_path_factory.mktemp("gemma3"))
    return path, save_random_model(_config(), path, 33, norms=(0.0, 0.3))


def test_config_reads_as_gemma3textconfig(gemma3):
    path, hf = gemma3
    cfg = ModelConfig.from_hf_folder(path)
    assert (cfg.architecture, cfg.hidden_act, cfg.norm_weight_offset, cfg.sandwich_norms,
            cfg.qk_norm, cfg.tie_word_embeddings) == ("Gemma3ForCausalLM", "gelu_tanh", True,
                                                     True, True, True)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.sliding_window) == (1e4, 100.0, 8)
    assert [cfg.layer_window(i) for i in range(4)] == [8, 8, None, 8]
    assert cfg.attention_multiplier == pytest.approx(24 ** -0.5)
    assert cfg.embedding_multiplier == pytest.approx(96 ** 0.5)


def test_prefill_then_decode_matches_transformers(gemma3):
    """40 tokens (a prefill of 25, 15 decode steps): past the window of 8, so the sliding
    layers' window and RoPE base, and the global layer's, all show in the logits."""
    path, hf = gemma3
    model, cfg = load_model(path, dtype="float32", device="cpu")
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    got = prefill_then_decode(model, cfg, {0: tokens}, {0: 25}, steps=15)[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_engine_greedy_tokens_match_transformers(gemma3):
    """The engine on the CPU kernels (float32), a prefill chunked at 16 tokens."""
    assert_engine_greedy_matches(*gemma3, 24)


def test_bfloat16_stays_near_transformers(gemma3):
    """bfloat16 on both sides: the embedding scale rounded as transformers rounds it, the
    folded norm factors one rounding apart; logits within bf16 noise."""
    from transformers import AutoModelForCausalLM

    path, _ = gemma3
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model, cfg = load_model(path, dtype="bfloat16", device="cpu", prepack_weights=True)
    # sqrt(96) = 9.798 is 9.8125 in bfloat16: transformers scales by that.
    assert model._embedding_scale(torch.bfloat16) == 9.8125
    # The CPU's fused decode step runs Llama blocks only: Gemma's go layer by layer.
    assert decoder_stack_spec(model) is None
    tokens = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    got = prefill_then_decode(model, cfg, {0: tokens}, {0: 14}, steps=6)[0].float()
    want = hf_logits(hf, tokens).float()
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()


def _folder_with(gemma3, tmp_path, **changes) -> str:
    return folder_with(gemma3[0], str(tmp_path / "edited"), **changes)


def test_the_older_config_layout_reads_the_same(gemma3, tmp_path):
    """transformers 4.x's keys: rope_theta, rope_local_base_freq, sliding_window_pattern
    (every third layer global here), no layer_types."""
    path, _ = gemma3
    old = _folder_with(gemma3, tmp_path, rope_parameters=REMOVE, layer_types=REMOVE,
                       rope_theta=10000.0, rope_local_base_freq=100.0,
                       sliding_window_pattern=3, rope_scaling=None)
    a, b = ModelConfig.from_hf_folder(path), ModelConfig.from_hf_folder(old)
    assert (b.rope_theta, b.local_rope_theta, b.rope_scaling) == (1e4, 100.0, None)
    assert [b.layer_window(i) for i in range(4)] == [a.layer_window(i) for i in range(4)]


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar=-1 must be a positive"),
])
def test_what_the_kernels_lack_is_named(gemma3, tmp_path, change, message):
    folder = _folder_with(gemma3, tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_folder(folder)



@pytest.fixture(scope="module")
def gemma3_as_llama_cpp(tmp_path_factory):
    """A Gemma3ForCausalLM laid out as llama.cpp assumes for a ``gemma3`` file (five
    sliding layers then a global one, the sliding layers' RoPE base 10000, attention
    scaled by head_dim): 6 layers, norms random."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 6}, max_position_embeddings=256, rms_norm_eps=1e-6,
        sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.1,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": 10000.0}})
    path = str(tmp_path_factory.mktemp("gemma3-llama-cpp"))
    return save_random_model(cfg, path, 34, norms=(0.0, 0.3))


@pytest.mark.parametrize("linear_type", [None, "Q8_0"], ids=["f32", "q8_0-kept"])
def test_gguf_file_matches_transformers(gemma3_as_llama_cpp, tmp_path, linear_type):
    """A ``gemma3`` GGUF as llama.cpp's converter writes it (norms stored plus 1,
    ``post_attention_norm`` / ``ffn_norm`` / ``post_ffw_norm``, only the window and the
    global RoPE base in the metadata): its config, and its logits over 40 tokens (past
    the window of 8) against transformers. Q8_0 projections stay blocks and land near."""
    from deepinfer.models.parallel_layers import Linear
    from tests.models.tiny_gguf import write_tiny_gguf

    hf = gemma3_as_llama_cpp
    path = str(tmp_path / "gemma3.gguf")
    write_tiny_gguf(hf, "gemma3", path, linear_type=linear_type)
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert (cfg.architecture, cfg.hidden_act, cfg.norm_weight_offset, cfg.sandwich_norms,
            cfg.qk_norm, cfg.tie_word_embeddings) == ("Gemma3ForCausalLM", "gelu_tanh",
                                                     False, True, True, True)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert [cfg.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert cfg.attention_multiplier == pytest.approx(32 ** -0.5)
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    q = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(q, Linear) and (q.qtype is not None) == (linear_type is not None)
    # int8 weights: near, and the same argmax where it is clear
    assert_prompt_logits_match(model, cfg, hf, tokens, quantized=linear_type is not None,
                               clear_argmax=True)


def test_gguf_file_through_the_engine(gemma3_as_llama_cpp, tmp_path):
    """``LLM`` on a ``gemma3`` GGUF with a sentencepiece vocabulary (as Gemma's files
    have): text prompts take the BOS the file asks for, and 20 greedy tokens (past the
    window of 8, a prefill chunked at 16) equal transformers' on the same ids."""
    from tests.models.tiny_gguf import write_tiny_gguf

    pieces = ["\u2581", "a", "b", "c", "d", "e", "\u2581a", "\u2581b", "ab", "\u2581ab", "cd"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += pieces + [f"w{i}" for i in range(300 - len(tokens) - len(pieces))]
    path = str(tmp_path / "gemma3.gguf")
    write_tiny_gguf(gemma3_as_llama_cpp, "gemma3", path, spm_tokens=tokens)
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=8,
              max_num_batched_tokens=16)
    prompts = ["abcd ab", "a b c d e ab cd ab abcd e d c b a"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    assert all(i[0] == 2 for i in ids) and len(ids[1]) > 16
    assert_greedy_matches_hf(llm, gemma3_as_llama_cpp, ids, 20)


def _gguf_meta(**keys) -> dict:
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 96,
            "gemma3.feed_forward_length": 128, "gemma3.block_count": 12,
            "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2,
            "gemma3.attention.key_length": 32, "gemma3.attention.sliding_window": 16,
            "gemma3.rope.freq_base": 1e6, "gemma3.vocab_size": 300}
    meta.update({f"gemma3.{k.replace('__', '.')}": v for k, v in keys.items()})
    return meta


def test_gguf_keys_as_llama_cpp_reads_them():
    """The newer keys where a file has them (a per-layer pattern of flags or a period,
    ``rope.freq_base_swa``, ``attention.scale``); without them llama.cpp's constants,
    the 62-layer 27B's attention scaled by hidden / heads; no window: no sliding layer."""
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta())
    assert cfg.sliding_layers == tuple(i for i in range(12) if i not in (5, 11))
    flags = [i % 2 == 0 for i in range(12)]
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta(
        attention__sliding_window_pattern=flags, rope__freq_base_swa=500.0,
        attention__scale=0.125))
    assert (cfg.sliding_layers, cfg.local_rope_theta, cfg.attention_multiplier) == (
        tuple(range(0, 12, 2)), 500.0, 0.125)
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta(attention__sliding_window_pattern=4))
    assert cfg.sliding_layers == (0, 1, 2, 4, 5, 6, 8, 9, 10)
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta(block_count=62))
    assert cfg.attention_multiplier == pytest.approx((96 / 4) ** -0.5)
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta(attention__sliding_window=0))
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.local_rope_theta) == (None, None,
                                                                              None)


@pytest.mark.parametrize("keys, message", [
    ({"attention__sliding_window_pattern": [True] * 3}, "has 3 flags for 12 layers"),
    ({"final_logit_softcapping": 30.0}, "gemma3.final_logit_softcapping=30.0 is not"),
])
def test_bad_gguf_keys_are_named(keys, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_gguf_metadata(_gguf_meta(**keys))
