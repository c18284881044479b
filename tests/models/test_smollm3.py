"""SmolLM3 (``SmolLM3ForCausalLM``) against transformers on tiny random checkpoints: every
fourth layer without RoPE (NoPE), from ``no_rope_layers`` or its interval, through the
torch reference, the CPU kernels (and the CPU's fused decode step over GGUF blocks) and
a llama.cpp ``smollm3`` file; the sliding window it takes only when asked; what a bad
config gets."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from deepinfer.models.decoder_stack import decoder_stack_spec
from tests.models.hf_checkpoints import (
    assert_engine_greedy_matches,
    assert_prompt_logits_match,
    folder_with,
    save_random_model,
)
from tests.models.paged_sim import PagedSim, prefill_then_decode
from tests.models.test_models import hf_logits

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """(path, HF model): a SmolLM3ForCausalLM saved by transformers, NoPE layers 3 and 7
    (its default interval of 4), RoPE base 10000 so that rotation shows in 40 tokens."""
    from transformers import SmolLM3Config

    cfg = SmolLM3Config(**SHAPE, max_position_embeddings=256, initializer_range=0.1,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    path = str(tmp_path_factory.mktemp("smollm3"))
    return path, save_random_model(cfg, path, 51)


def _folder_with(smollm3, out, **changes) -> str:
    return folder_with(smollm3[0], str(out), **changes)


def test_config_reads_as_smollm3config(smollm3):
    path, hf = smollm3
    cfg = ModelConfig.from_hf_folder(path)
    assert (cfg.architecture, cfg.nope_layers, cfg.tie_word_embeddings) == (
        "SmolLM3ForCausalLM", (3, 7), True)
    assert [i for i, f in enumerate(hf.config.no_rope_layers) if not f] == [3, 7]
    assert cfg.sliding_window is None


def test_prefill_then_decode_matches_transformers(smollm3):
    """40 tokens (a prefill of 25, 15 decode steps) on the torch reference."""
    path, hf = smollm3
    model, cfg = load_model(path, dtype="float32", device="cpu")
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    got = prefill_then_decode(model, cfg, {0: tokens}, {0: 25}, steps=15)[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_engine_greedy_tokens_match_transformers(smollm3):
    assert_engine_greedy_matches(*smollm3, 24)


def test_the_nope_layers_are_felt(smollm3):
    """Rotating every layer instead gives other logits: the NoPE layers are not a no-op
    of the test."""
    path, hf = smollm3
    model, cfg = load_model(path, dtype="float32", device="cpu")
    tokens = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    want = hf_logits(hf, tokens)
    for layer in model.model.layers:
        layer.self_attn.rope = True
    got = PagedSim(cfg).step(model, {0: tokens}, is_prompt=True)
    assert (got - want).abs().max() > 0.05 * want.abs().max()


@pytest.mark.parametrize("linear_type", [None, "Q8_0"], ids=["f32", "q8_0-kept"])
def test_gguf_file_matches_transformers(smollm3, tmp_path, linear_type):
    """A ``smollm3`` GGUF as llama.cpp's converter writes it (q/k rows permuted as a
    llama file's, no key for the NoPE layers: every fourth, as llama.cpp hard-codes):
    its logits; Q8_0 projections stay blocks, land near, and the CPU's fused decode step
    takes the model (its NoPE layers included)."""
    from tests.models.tiny_gguf import write_tiny_gguf

    _, hf = smollm3
    path = str(tmp_path / "smollm3.gguf")
    write_tiny_gguf(hf, "smollm3", path, linear_type=linear_type)
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert (cfg.architecture, cfg.nope_layers) == ("SmolLM3ForCausalLM", (3, 7))
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    assert_prompt_logits_match(model, cfg, hf, tokens, quantized=linear_type is not None)
    if linear_type is None:
        return
    spec = decoder_stack_spec(model)
    assert spec is not None and [w.rope for w in spec.layers] == [
        i % 4 != 3 for i in range(8)]


def test_sliding_window_only_when_asked(smollm3, tmp_path):
    """``sliding_window`` alone slides nothing; with ``use_sliding_window`` the layers
    ``layer_types`` marks slide, by default the NoPE ones (as SmolLM3Config fills it)."""
    a = ModelConfig.from_hf_folder(_folder_with(smollm3, tmp_path / "a", sliding_window=16))
    assert a.sliding_window is None
    b = ModelConfig.from_hf_folder(_folder_with(smollm3, tmp_path / "b", sliding_window=16,
                                                use_sliding_window=True, layer_types=None))
    assert (b.sliding_window, b.sliding_layers) == (16, (3, 7))
    types = ["sliding_attention" if i < 2 else "full_attention" for i in range(8)]
    c = ModelConfig.from_hf_folder(_folder_with(smollm3, tmp_path / "c", sliding_window=16,
                                                use_sliding_window=True, layer_types=types))
    assert c.sliding_layers == (0, 1)


@pytest.mark.parametrize("change, message", [
    ({"no_rope_layers": [1, 0]}, "no_rope_layers must list a 0 or 1 for each of the 8"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0},
     "no_rope_layer_interval=0 must be a positive integer"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
])
def test_bad_config_is_named(smollm3, tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_folder(_folder_with(smollm3, tmp_path, **change))
