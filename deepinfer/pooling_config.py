"""How a checkpoint says its embeddings are pooled: sentence-transformers' ``modules.json``
(and its ``Pooling`` module's ``config.json``) in a Hugging Face folder, or llama.cpp's
``{arch}.pooling_type`` key in a GGUF file.

``LLM.embed`` reads the last token (``deepinfer.pooling``). A model whose files say it
pools otherwise (mean, CLS, a ``Dense`` projection after the pooling) would get vectors
it was never trained to give, silently: such a model's embedding requests are refused,
naming what its files say. A checkpoint that says nothing is taken as last-token.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["GGUF_POOLING_TYPES", "LAST_TOKEN", "gguf_pooling", "hf_folder_pooling"]

#: The pooling ``LLM.embed`` implements.
LAST_TOKEN = "last token"
#: llama.cpp's ``enum llama_pooling_type`` values as stored in ``{arch}.pooling_type``.
GGUF_POOLING_TYPES = {0: None, 1: "mean", 2: "CLS token", 3: LAST_TOKEN, 4: "rank"}
# sentence-transformers' Pooling config keys -> what they mean.
_ST_MODES = {"pooling_mode_lasttoken": LAST_TOKEN, "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "CLS token", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean / sqrt(length)",
             "pooling_mode_weightedmean_tokens": "weighted mean"}


def gguf_pooling(value: Any) -> str | None:
    """The pooling a GGUF ``pooling_type`` value names (None: absent or ``none``)."""
    if value is None:
        return None
    return GGUF_POOLING_TYPES.get(int(value), f"pooling_type {value}")


def hf_folder_pooling(folder: str) -> str | None:
    """What a folder's sentence-transformers files say of its pooling: None without a
    ``modules.json`` (or without a ``Pooling`` module in it), else the modes the Pooling
    config turns on, joined by ``" + "``, with ``", then Dense"`` when a ``Dense`` module
    follows. ``ValueError`` naming the file when one is not valid JSON of the expected
    shape."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: expected a list of module objects")
    kinds = [str(m.get("type", "")) for m in modules]
    pool = next((m for m, k in zip(modules, kinds) if k.endswith("Pooling")), None)
    if pool is None:
        return None
    cfg_path = os.path.join(folder, str(pool.get("path", "")), "config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    modes = [name for key, name in _ST_MODES.items() if cfg.get(key)]
    if not modes and cfg.get("pooling_mode"):  # newer files name the mode directly
        modes = [{"lasttoken": LAST_TOKEN, "cls": "CLS token"}.get(cfg["pooling_mode"],
                                                                 str(cfg["pooling_mode"]))]
    found = " + ".join(modes) or "none"
    if any(k.endswith("Dense") for k in kinds):
        found += ", then Dense"
    return found


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
