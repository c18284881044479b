"""PEFT adapters for the LoRA tests: random A and B (PEFT starts B at zero, which would
hide a delta never added), saved with PEFT's own ``save_pretrained``; the PEFT model is
the reference."""

from __future__ import annotations

import copy
from typing import Any

import torch

from deepinfer.testing.lora_adapters import ALL_PROJECTIONS, save_random_peft_adapter


def save_peft_adapter(hf_model: Any, path: str, seed: int, r: int = 4, alpha: float = 8,
                      targets: tuple[str, ...] = ALL_PROJECTIONS, std: float = 0.1,
                      **config: Any) -> Any:
    """A PEFT LoRA adapter on a copy of ``hf_model`` (its A and B drawn from N(0, std)),
    saved under ``path``; returns the PEFT model (fp32, eval)."""
    return save_random_peft_adapter(copy.deepcopy(hf_model), path, seed, r, alpha, targets,
                                    std, **config)


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of a transformers (or PEFT) model after ``prompt``, EOS taken
    like any token (``generate`` with ``min_new_tokens`` would mask it instead)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """A transformers (or PEFT) model's logits ``[len(tokens), vocab]`` fp32."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()
