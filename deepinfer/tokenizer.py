"""Tokenizers (transformers) for HF folders and GGUF files, and chat-template encoding."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer for a local HF folder or a ``.gguf`` file.

    GGUF tokenizers are rebuilt from the file's vocabulary (seconds for a 49k vocab), so
    they are cached per path: callers share one instance and must not mutate it.
    """
    full = os.path.abspath(os.path.expanduser(path))
    if full.endswith(".gguf"):
        if not os.path.isfile(full):
            raise FileNotFoundError(f"GGUF file {path!r} does not exist")
        return _load_gguf_tokenizer(full)
    if not os.path.isdir(full):
        raise FileNotFoundError(f"tokenizer path {path!r} is neither a folder nor a .gguf file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(full, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot load a tokenizer from this folder: {e}") from e


@functools.lru_cache(maxsize=4)
def _load_gguf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                         gguf_file=os.path.basename(path),
                                         local_files_only=True)


def apply_chat_template(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template, ending with the
    assistant generation prompt.

    The template is rendered to text and encoded without extra special tokens: templates
    that write the BOS themselves would otherwise get it twice.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template: pass plain prompts "
                         f"instead of chat messages")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
