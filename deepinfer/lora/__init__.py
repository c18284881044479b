"""LoRA adapters served beside the base model: each request may name one
(:class:`LoRARequest`); its tokens get that adapter's low-rank deltas on the attention
and MLP projections, the others none, in the same batch."""

from deepinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
