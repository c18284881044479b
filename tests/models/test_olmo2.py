"""OLMo 2 (``Olmo2ForCausalLM``) against transformers on tiny random checkpoints: no norm
before the attention and the MLP, one after each, q/k norms over the whole projection,
through the torch reference, the CPU kernels and a llama.cpp ``olmo2`` file."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from deepinfer.models.decoder_stack import decoder_stack_spec
from tests.models.hf_checkpoints import (
    assert_engine_greedy_matches,
    assert_prompt_logits_match,
    save_random_model,
)
from tests.models.paged_sim import prefill_then_decode
from tests.models.test_models import hf_logits

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """(path, HF model): an Olmo2ForCausalLM saved by transformers, its norm weights
    random (transformers starts them at 1, which would hide a norm applied to the wrong
    tensor)."""
    from transformers import Olmo2Config

    cfg = Olmo2Config(**SHAPE, max_position_embeddings=256, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = str(tmp_path_factory.mktemp("olmo2"))
    return path, save_random_model(cfg, path, 71, norms=(1.0, 0.3))


def test_config_and_model(olmo2):
    """Full-width q/k norms, norms after only: no ``input_layernorm`` to load, and the
    CPU's fused decode step (pre-norm blocks only) declines the model."""
    path, _ = olmo2
    cfg = ModelConfig.from_hf_folder(path)
    assert (cfg.architecture, cfg.qk_norm_full_width, cfg.post_norms, cfg.qk_norm,
            cfg.sliding_window) == ("Olmo2ForCausalLM", True, True, False, None)
    model, _ = load_model(path, dtype="float32", device="cpu")
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (64,)
    assert decoder_stack_spec(model) is None


def test_prefill_then_decode_matches_transformers(olmo2):
    path, hf = olmo2
    model, cfg = load_model(path, dtype="float32", device="cpu")
    tokens = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    got = prefill_then_decode(model, cfg, {0: tokens}, {0: 20}, steps=10)[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_engine_greedy_tokens_match_transformers(olmo2):
    assert_engine_greedy_matches(*olmo2, 16)


@pytest.mark.parametrize("linear_type", [None, "Q8_0"], ids=["f32", "q8_0-kept"])
def test_gguf_file_matches_transformers(olmo2, tmp_path, linear_type):
    """An ``olmo2`` GGUF as llama.cpp's converter writes it (``post_attention_norm``,
    ``post_ffw_norm``, full-width ``attn_q_norm``/``attn_k_norm``, q/k unpermuted)."""
    from tests.models.tiny_gguf import write_tiny_gguf

    _, hf = olmo2
    path = str(tmp_path / "olmo2.gguf")
    write_tiny_gguf(hf, "olmo2", path, linear_type=linear_type)
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert (cfg.architecture, cfg.qk_norm_full_width, cfg.post_norms) == (
        "Olmo2ForCausalLM", True, True)
    tokens = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    # int8 weights: near
    assert_prompt_logits_match(model, cfg, hf, tokens, quantized=linear_type is not None)
