"""``LoRAManager``: the adapters an engine holds, which state slot runs which, and each
step's plan.

An adapter is read when the first request naming its ``lora_int_id`` arrives and
stays loaded while requests use it; unused ones stay cached, least recently used
dropped first, up to ``max_loras`` (a request that needs more makes room only where
none of the others is in use: adapters in use are never dropped). The prefix cache
keys each adapter's blocks apart (the scheduler's ``cache_salt``: the adapter id)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer.lora.layer import LoRALinearHook, LoRAStep
from deepinfer.lora.peft_adapter import read_peft_adapter
from deepinfer.lora.request import LoRARequest

__all__ = ["LoRAManager"]


@dataclass
class _Loaded:
    request: LoRARequest
    layers: list[str]
    users: int = 0
    weight_bytes: int = 0


class LoRAManager:
    """Adapters of one model (``model``: a loaded ``LlamaForCausalLM``), with
    ``max_slots`` state slots (the scheduler's ``max_num_seqs``)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.step = LoRAStep()
        self._hooks: dict[str, LoRALinearHook] = {}
        self._loaded: OrderedDict[int, _Loaded] = OrderedDict()
        self._slot_adapter = np.zeros(max_slots, dtype=np.int64)  # 0: no adapter

    @property
    def loaded(self) -> list[str]:
        """Names of the adapters held now, least recently used first."""
        return [a.request.lora_name for a in self._loaded.values()]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the adapters' weights held now."""
        return sum(a.weight_bytes for a in self._loaded.values())

    def acquire(self, req: LoRARequest) -> int:
        """Load ``req``'s adapter unless held, count one more user of it; returns its id
        (the prefix cache's salt and the slot table's value). ``ValueError`` naming the
        adapter when it cannot be served; nothing is held then."""
        req.validate()
        held = self._loaded.get(req.lora_int_id)
        if held is not None:
            if held.request.lora_path != req.lora_path:
                raise ValueError(
                    f"LoRARequest {req.lora_name!r}: lora_int_id {req.lora_int_id} is "
                    f"already adapter {held.request.lora_name!r} from "
                    f"{held.request.lora_path!r}; give each adapter its own id")
            self._loaded.move_to_end(req.lora_int_id)
        else:
            try:
                weights = read_peft_adapter(req.lora_path, self.model, self.max_rank,
                                            self.dtype, self.device)
            except ValueError as e:
                raise ValueError(f"LoRARequest {req.lora_name!r}: {e}") from e
            modules = dict(self.model.named_modules())
            for name, w in weights.items():
                hook = self._hooks.get(name)
                if hook is None:
                    hook = self._hooks[name] = LoRALinearHook(self.step)
                    modules[name].lora = hook
                hook.weights[req.lora_int_id] = (w.a, w.b)
            nbytes = sum(t.numel() * t.element_size()
                         for w in weights.values() for t in (w.a, w.b))
            held = self._loaded[req.lora_int_id] = _Loaded(req, list(weights),
                                                            weight_bytes=nbytes)
        held.users += 1
        self._drop_unused()
        return req.lora_int_id

    def release(self, adapter: int) -> None:
        """One user of adapter ``adapter`` finished (or was aborted)."""
        held = self._loaded.get(adapter)
        if held is not None and held.users > 0:
            held.users -= 1
            self._drop_unused()

    def _drop_unused(self) -> None:
        """Drop least recently used adapters no request uses while over ``max_loras``."""
        while len(self._loaded) > self.max_loras:
            unused = next((i for i, a in self._loaded.items() if a.users == 0), None)
            if unused is None:
                return
            for name in self._loaded.pop(unused).layers:
                self._hooks[name].weights.pop(unused, None)

    def bind_slot(self, slot: int, adapter: int) -> None:
        """State slot ``slot`` now runs a sample of adapter ``adapter`` (0: none)."""
        self._slot_adapter[slot] = adapter

    def plan(self, state_slots: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
        """Group the step's tokens by adapter for the hooks; returns whether any token has
        one. ``state_slots`` int64 ``[B]`` and ``query_start_loc`` int32 ``[B + 1]``: the
        launch batch's host tensors."""
        per_seq = self._slot_adapter[state_slots.numpy()]
        if not per_seq.any():
            self.step.groups = ()
            self.model.lora_active = False
            return False
        per_token = np.repeat(per_seq, np.diff(query_start_loc.numpy()))
        groups = []
        for adapter in np.unique(per_token[per_token > 0]):
            rows = np.flatnonzero(per_token == adapter)
            groups.append((int(adapter), None if rows.size == per_token.size else
                           torch.from_numpy(rows).to(self.device, non_blocking=True)))
        self.step.groups = tuple(groups)
        self.model.lora_active = True
        return True
