"""Random PEFT LoRA adapters for the tests and benchmarks (``tests/lora``,
``benchmarks/bench_lora.py``): PEFT's own ``get_peft_model`` and ``save_pretrained`` on a
transformers model, A and B drawn at random (PEFT starts B at zero, which would hide a
delta never added)."""

from __future__ import annotations

from typing import Any

import torch

#: The seven projections of a Llama-style block, PEFT's module names.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj")


def save_random_peft_adapter(model: Any, path: str, seed: int, r: int, alpha: float,
                             targets: tuple[str, ...] = ALL_PROJECTIONS, std: float = 0.1,
                             **config: Any) -> Any:
    """Wrap ``model`` (a transformers model, changed in place) in a PEFT LoRA adapter of
    rank ``r`` on ``targets`` (``config``: more ``LoraConfig`` fields), its A and B drawn
    from N(0, ``std``) after seeding with ``seed``; save it under ``path`` and return the
    PEFT model (eval)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **config)
    peft_model = get_peft_model(model, cfg).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(path)
    return peft_model
