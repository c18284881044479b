"""Our decoder vs transformers on tiny random checkpoints, through the paged KV cache.

Each checkpoint is saved by transformers, loaded back by ``load_model``, and run on the
reference backend with a shuffled block table: packed prefill of two prompts, then
single-token decode steps (teacher-forced), every position's logits compared with HF's
forward over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.loading.loader import load_model
from deepinfer.models.layers import rope_inv_freq
from tests.models.paged_sim import PagedSim, prefill_then_decode

ATOL = 1e-4


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return {name: load_model(ck.path, dtype="auto", device="cpu")
            for name, ck in tiny_checkpoints.items()}


VARIANTS = ["llama3", "llama_tied", "qwen2", "qwen3", "mistral", "granite"]


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_then_decode_matches_hf(name, tiny_checkpoints, loaded):
    model, cfg = loaded[name]
    hf = tiny_checkpoints[name].hf_model
    assert next(model.parameters()).dtype == torch.float32
    g = torch.Generator().manual_seed(7)
    seqs = {0: torch.randint(3, cfg.vocab_size, (13,), generator=g).tolist(),
            1: torch.randint(3, cfg.vocab_size, (9,), generator=g).tolist()}
    ours = prefill_then_decode(model, cfg, seqs, {0: 7, 1: 5})  # decode: 4 steps

    for s in seqs:
        got = ours[s]
        want = hf_logits(hf, seqs[s][: got.shape[0]])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert want.abs().max() > 0.05  # random weights still give non-trivial logits


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_chunked_prefill_equals_full(name, loaded):
    model, cfg = loaded[name]
    tokens = torch.randint(3, cfg.vocab_size, (11,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    full = PagedSim(cfg, seed=1).step(model, {0: tokens}, is_prompt=True)
    sim = PagedSim(cfg, seed=2)
    first = sim.step(model, {0: tokens[:6]}, is_prompt=True)
    second = sim.step(model, {0: tokens[6:]}, is_prompt=True)  # 6-token cached prefix
    torch.testing.assert_close(torch.cat([first, second]), full, atol=1e-5, rtol=0)


def test_config_switches(loaded):
    assert loaded["qwen2"][1].attention_bias and loaded["qwen2"][1].tie_word_embeddings
    assert loaded["qwen3"][1].qk_norm and loaded["qwen3"][1].head_dim == 32
    assert loaded["llama3"][1].rope_scaling["rope_type"] == "llama3"
    assert not loaded["llama3"][1].tie_word_embeddings
    assert loaded["mistral"][1].architecture == "MistralForCausalLM"
    assert loaded["llama_tied"][0].lm_head is None


def test_llama3_inv_freq_matches_transformers(tiny_checkpoints, loaded):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = loaded["llama3"][1]
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](tiny_checkpoints["llama3"].hf_model.config, "cpu")
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    # the scaling really changes something
    assert not torch.allclose(got, rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))
