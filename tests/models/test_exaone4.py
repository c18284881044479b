"""EXAONE 4.0 (``Exaone4ForCausalLM``) against transformers on tiny random checkpoints:
OLMo 2's block (norms after only) with per-head q/k norms, and hybrid attention: sliding
layers with RoPE, global layers without (NoPE, their q/k still normed); without a window
every layer global with RoPE; what a bad config gets."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from tests.models.hf_checkpoints import (
    assert_engine_greedy_matches,
    folder_with,
    save_random_model,
)
from tests.models.paged_sim import prefill_then_decode
from tests.models.test_models import hf_logits

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)


def _config(**kw):
    from transformers import Exaone4Config

    return Exaone4Config(**SHAPE, max_position_embeddings=256, initializer_range=0.1,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def exaone4(tmp_path_factory):
    """variant -> (path, HF model): "hybrid" (window 8, layers 0-2 sliding, 3 global and
    NoPE) and "global" (no window: RoPE everywhere); norm weights random."""
    out = {}
    for i, (variant, window) in enumerate((("hybrid", 8), ("global", None))):
        path = str(tmp_path_factory.mktemp(f"exaone4-{variant}"))
        # Exaone4Config needs layer_types without a window (its pattern is then 0)
        types = None if window else ["full_attention"] * SHAPE["num_hidden_layers"]
        out[variant] = (path, save_random_model(
            _config(sliding_window=window, layer_types=types), path, 81 + i,
            norms=(1.0, 0.3)))
    return out


def test_config_reads_as_exaone4config(exaone4):
    hybrid = ModelConfig.from_hf_folder(exaone4["hybrid"][0])
    assert (hybrid.architecture, hybrid.qk_norm, hybrid.post_norms, hybrid.attention_bias,
            hybrid.nope_layers) == ("Exaone4ForCausalLM", True, True, False, (3,))
    assert [hybrid.layer_window(i) for i in range(4)] == [8, 8, 8, None]
    glob = ModelConfig.from_hf_folder(exaone4["global"][0])
    assert (glob.nope_layers, glob.sliding_window) == ((), None)


@pytest.mark.parametrize("variant", ["hybrid", "global"])
def test_prefill_then_decode_matches_transformers(exaone4, variant):
    """30 tokens (a prefill of 20, 10 decode steps): past the window of 8."""
    path, hf = exaone4[variant]
    model, cfg = load_model(path, dtype="float32", device="cpu")
    tokens = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    got = prefill_then_decode(model, cfg, {0: tokens}, {0: 20}, steps=10)[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_engine_greedy_tokens_match_transformers(exaone4):
    assert_engine_greedy_matches(*exaone4["hybrid"], 16)


def test_the_released_pattern_spelling(exaone4, tmp_path):
    """EXAONE-4.0-32B's config spells the pattern "LLLG" (no ``layer_types``)."""
    cfg = ModelConfig.from_hf_folder(folder_with(
        exaone4["hybrid"][0], str(tmp_path / "a"), layer_types=None,
        sliding_window_pattern="LG"))
    assert (cfg.sliding_layers, cfg.nope_layers) == ((0, 2), (1, 3))


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers"),
    ({"layer_types": None, "sliding_window_pattern": "LX"}, "sliding_window_pattern='LX'"),
])
def test_bad_config_is_named(exaone4, tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_folder(folder_with(exaone4["hybrid"][0], str(tmp_path / "b"),
                                               **change))
