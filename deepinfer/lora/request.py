"""``LoRARequest``: which adapter a request runs with (vLLM's fields and order)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request.

    ``lora_name``: a label for errors and outputs; ``lora_int_id``: a positive integer
    that identifies the adapter in this engine (requests with the same id share its
    loaded weights and their prefix-cache blocks); ``lora_path``: the adapter folder
    (``adapter_config.json`` and ``adapter_model.safetensors``, as PEFT's
    ``save_pretrained`` writes them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def validate(self) -> None:
        """``ValueError`` naming the field that is malformed."""
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        i = self.lora_int_id
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a "
                             f"positive integer, got {i!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a "
                             f"non-empty string, got {self.lora_path!r}")
