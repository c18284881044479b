"""Gemma 3 (``Gemma3ForCausalLM``: Gemma-3-270M / 1B and the text part of the larger ones)
against transformers on tiny random checkpoints: norms stored as offsets from 1 and
folded at load, the norms after attention and MLP, GeGLU, q/k norms, the embedding scale
rounded to the dtype, ``query_pre_attn_scalar``, sliding layers with their own RoPE base
past their window; both config layouts; what a bad config gets."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from deepinfer.models.decoder_stack import decoder_stack_spec
from tests.checkpoints import assert_greedy_matches_hf
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
    from transformers import AutoModelForCausalLM

    from deepinfer.testing.random_model import build_bpe_tokenizer

    torch.manual_seed(33)
    hf = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(str(path), safe_serialization=True)
    build_bpe_tokenizer().save_pretrained(str(path))
    return str(path), hf


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
    """The engine on the CPU kernels (float32), prompts of 5-30 tokens, 24 generated, a
    prefill chunked at 16 tokens."""
    path, hf = gemma3
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=8,
              max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 30)]
    assert_greedy_matches_hf(llm, hf, prompts, 24)


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
    path, _ = gemma3
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).symlink_to(f"{path}/{f}")
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg.update(changes)
    for key, value in list(cfg.items()):
        if value is _DROP:
            del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


_DROP = object()


def test_the_older_config_layout_reads_the_same(gemma3, tmp_path):
    """transformers 4.x's keys: rope_theta, rope_local_base_freq, sliding_window_pattern
    (every third layer global here), no layer_types."""
    path, _ = gemma3
    old = _folder_with(gemma3, tmp_path, rope_parameters=_DROP, layer_types=_DROP,
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
