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
        st = os.stat(full)  # a file rewritten in place is a new tokenizer
        return _load_gguf_tokenizer(full, st.st_mtime_ns, st.st_size)
    if not os.path.isdir(full):
        raise FileNotFoundError(f"tokenizer path {path!r} is neither a folder nor a .gguf file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(full, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot load a tokenizer from this folder: {e}") from e


@functools.lru_cache(maxsize=4)
def _load_gguf_tokenizer(path: str, mtime_ns: int, size: int) -> Any:
    from deepinfer.loading.gguf_reader import open_gguf

    tok = byte_level_tokenizer_from_gguf(open_gguf(path).metadata)
    if tok is not None:
        return tok
    # Other vocabularies (sentencepiece, custom split rules): transformers' converter.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                         gguf_file=os.path.basename(path),
                                         local_files_only=True)


def byte_level_tokenizer_from_gguf(meta: dict[str, Any]) -> Any | None:
    """A GPT-2 style byte-level BPE tokenizer built from GGUF metadata already read (no
    second parse of the file); None when the file describes another kind (sentencepiece,
    a pre-tokenizer with its own split rule, a BOS added to every prompt), which
    transformers' converter then builds.

    The result is what transformers builds for such a file: BPE over the file's tokens
    and merges, GPT-2's byte-level pre-tokenizer and decoder, the control tokens as
    special tokens (those spelled in the byte alphabet: another spelling is a mislabel),
    the user-defined ones (``<think>``) as plain added tokens, both matched whole as
    llama.cpp does, and the chat template and BOS/EOS/UNK/PAD tokens it names."""
    if (meta.get("tokenizer.ggml.model") != "gpt2"
            or meta.get("tokenizer.ggml.pre", "default") not in _GPT2_DEFAULT_SPLIT
            or meta.get("tokenizer.ggml.add_bos_token", False)
            or "tokenizer.ggml.merges" not in meta):
        return None
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    if len(vocab) != len(tokens) or any(len(m) != 2 for m in merges):
        return None  # spelled outside the byte alphabet: leave it to transformers
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                              continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    types = meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types)
                           if ty == _CONTROL and set(t) <= alphabet])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"))


# llama.cpp token types: control (<|im_start|>, ...), special; user-defined (<think>),
# not special; both matched whole.
_CONTROL = 3
_USER_DEFINED = 4
# Pre-tokenizer names for which a byte-level vocabulary uses GPT-2's own split rule.
_GPT2_DEFAULT_SPLIT = frozenset({"default", "gpt2", "smollm"})


#: Arguments of ``apply_chat_template`` itself, not of the template: never passed through.
_TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tokenize", "return_dict",
                                "return_tensors", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` as a dict of variables for the chat template (``enable_thinking``, ...);
    ``ValueError`` naming ``name`` when it is not an object with string keys, or sets one
    of ``apply_chat_template``'s own arguments."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"{name}: must be an object of template variables, got "
                         f"{kwargs!r}")
    bad = sorted(_TEMPLATE_RESERVED & set(kwargs))
    if bad:
        raise ValueError(f"{name}.{bad[0]}: not a template variable")
    return dict(kwargs)


def apply_chat_template(tokenizer: Any, messages: Sequence[dict[str, str]],
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template, ending with the
    assistant generation prompt. ``template_kwargs``: variables the template reads
    (``enable_thinking`` for Qwen3's, ...; :func:`check_template_kwargs`).

    The template is rendered to text and encoded without extra special tokens: templates
    that write the BOS themselves would otherwise get it twice. A template that raises
    (``raise_exception`` on messages it does not take) is a ``ValueError``.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template: pass plain prompts "
                         f"instead of chat messages")
    from jinja2.exceptions import TemplateError

    try:
        kwargs = {"add_generation_prompt": True, **check_template_kwargs(template_kwargs)}
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
    except TemplateError as e:  # e.g. "roles must alternate": that request's error
        raise ValueError(f"the chat template refuses these messages: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)
