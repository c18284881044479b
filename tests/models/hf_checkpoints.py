"""Tiny random checkpoints for the transformers-parity tests of ``tests/models`` and the
tensor-parallel loading checks: the engine tests' tiny transformers configs (switches
changed) saved with ``save_pretrained``, the ``config.json`` optionally edited afterwards,
and transformers' own load of the edited folder as the reference."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tests.checkpoints import tiny_configs
from tests.models.moe_checkpoints import moe_configs

#: An ``edit_config`` value that removes the key.
REMOVE = object()


def tiny_config(name: str, **switches: Any) -> Any:
    """The engine tests' tiny transformers config ``name`` (dense: llama3, llama_tied,
    qwen2, qwen3, mistral; MoE: qwen3_moe, mixtral, olmoe, qwen2_moe), ``switches`` set
    on it."""
    cfg = {**tiny_configs(), **moe_configs()}[name]
    for key, value in switches.items():
        setattr(cfg, key, value)
    return cfg


def edit_config(path: str, changes: dict[str, Any]) -> None:
    """Set keys of the ``config.json`` in folder ``path`` (:data:`REMOVE`: drop it)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is REMOVE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)


def save_hf_checkpoint(hf_config: Any, path: str, seed: int,
                       changes: dict[str, Any] | None = None, reference: bool = True) -> Any:
    """Save a seeded random model of ``hf_config`` under ``path`` (biases random:
    transformers zero-inits them, which would hide a missing one), apply ``changes`` to
    its ``config.json`` (see :func:`edit_config`), and return transformers' load of the
    folder (fp32, eval): what it builds from the edited file is the reference (None
    without ``reference``: a config that disagrees with the tensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    if changes:
        edit_config(path, changes)
    if not reference:
        return None
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_random_model(hf_config: Any, path: str, seed: int,
                      norms: tuple[float, float] | None = None, **load: Any) -> Any:
    """A seeded random transformers model of ``hf_config`` (fp32, eval; ``load``: more
    ``from_config`` arguments), its norm weights drawn from N(mean, std) ``norms`` where
    given (transformers starts them at a constant, which would hide a norm applied to
    the wrong tensor or an unfolded offset), saved under ``path`` with the tiny BPE
    tokenizer. Returns the model."""
    from transformers import AutoModelForCausalLM

    from deepinfer.testing.random_model import build_bpe_tokenizer

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **load).eval()
    if norms is not None:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(*norms)
    hf.save_pretrained(path, safe_serialization=True)
    build_bpe_tokenizer().save_pretrained(path)
    return hf


def folder_with(path: str, out: str, **changes: Any) -> str:
    """A folder ``out`` holding ``path``'s weights and tokenizer (links) and its
    ``config.json`` with ``changes`` (see :func:`edit_config`)."""
    os.makedirs(out, exist_ok=True)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "config.json"):
        if f == "config.json":
            with open(os.path.join(path, f)) as src, open(os.path.join(out, f), "w") as dst:
                dst.write(src.read())
        else:
            os.symlink(os.path.join(path, f), os.path.join(out, f))
    edit_config(out, changes)
    return out


def assert_engine_greedy_matches(path: str, hf: Any, new_tokens: int) -> None:
    """The engine on the CPU kernels (float32) over the checkpoint at ``path``: prompts
    of 5, 17 and 30 random tokens, a prefill chunked at 16 tokens, ``new_tokens`` greedy
    tokens each equal to transformers' on ``hf``."""
    from deepinfer import LLM
    from tests.checkpoints import assert_greedy_matches_hf

    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=8,
              max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(5)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 30)]
    assert_greedy_matches_hf(llm, hf, prompts, new_tokens)


def assert_prompt_logits_match(model: Any, cfg: Any, hf: Any, tokens: list[int],
                               quantized: bool = False, clear_argmax: bool = False) -> None:
    """``model``'s prompt logits over ``tokens`` (the torch reference, a paged cache)
    against transformers' on ``hf``: within 1e-4 in fp32; with ``quantized`` weights
    within 5% of the largest logit, and with ``clear_argmax`` the same argmax wherever
    the top two are 0.1 apart."""
    from tests.models.paged_sim import PagedSim
    from tests.models.test_models import hf_logits

    got = PagedSim(cfg).step(model, {0: tokens}, is_prompt=True)
    want = hf_logits(hf, tokens)
    if not quantized:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        return
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    if clear_argmax:
        top2 = want.topk(2, -1).values
        clear = top2[:, 0] - top2[:, 1] > 0.1
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
