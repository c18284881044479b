"""Model registry: HF architecture name -> decoder class; the kernel ops the models call
are declared in ``deepinfer.models.backend``."""

from __future__ import annotations

from torch import nn

from deepinfer.hf_config import SUPPORTED_ARCHITECTURES, check_architecture
from deepinfer.models.backend import KernelBackend, ModelBackend
from deepinfer.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM
                                         for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; ``ValueError`` naming it if unknown."""
    check_architecture(architecture)
    return _REGISTRY[architecture]


__all__ = ["KernelBackend", "LlamaForCausalLM", "ModelBackend", "get_model_class"]
