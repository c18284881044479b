"""Reasoning separation for thinking models: the ``<think>...</think>`` part of a finished
output split from its answer, by the rules of vLLM's non-streaming parsers.

- ``qwen3``: Qwen3 writes ``<think>`` itself. Text before ``</think>`` (an opening tag
  dropped) is reasoning, the rest content.
- ``deepseek_r1``: DeepSeek-R1's template opens the block in the prompt, so the output
  usually starts inside it. Text before ``</think>`` is reasoning, the rest content.

Structured output constrains what follows the reasoning: the grammar starts after the
first ``</think>`` token (``reasoning_end_token``; a vocabulary without it as one token
has the grammar constrain the whole output).

Both: a request with thinking turned off (``chat_template_kwargs`` ``enable_thinking:
false``) has content only; while thinking, an output without ``</think>`` is reasoning
only (it was cut before the answer).
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine_args import REASONING_PARSERS

__all__ = ["REASONING_PARSERS", "reasoning_end_token", "split_reasoning"]

_OPEN, _CLOSE = "<think>", "</think>"


def split_reasoning(text: str, parser: str, thinking: bool = True) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a finished output ``text`` under ``parser`` (one of
    ``REASONING_PARSERS``); reasoning is None when there is none. ``thinking``: False
    when the request turned thinking off (all text is content)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={parser!r}: expected one of "
                         f"{', '.join(REASONING_PARSERS)}")
    if not thinking:
        return None, text
    body = text
    start = body.find(_OPEN)
    if start >= 0 and not body[:start].strip():
        body = body[start + len(_OPEN):]
    end = body.find(_CLOSE)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(_CLOSE):].lstrip("\n")


def reasoning_end_token(tokenizer: Any, parser: str | None) -> int | None:
    """The id of ``</think>`` when ``parser`` is set and the vocabulary holds it as one
    token (Qwen3's and DeepSeek-R1's do), else None."""
    if parser is None:
        return None
    ids = tokenizer.encode(_CLOSE, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
