"""Incremental detokenization with stop strings.

Decoding the whole output at every step is quadratic, and decoding one token at a time
is wrong: byte-level BPE (GPT-2, SmolLM2) splits a multi-byte character over several
tokens, and sentencepiece decoders drop the leading space of a window's first token.
So, like vLLM, decode a small sliding window twice: ``ids[prefix:read]`` (text already
emitted) and ``ids[prefix:]``; the new text is the difference. The window starts a few
tokens back in the prompt so the first output token sees its left context. While the
decoded text ends in U+FFFD (an incomplete UTF-8 sequence), nothing is emitted and the
window does not move, so a character is emitted whole once its last byte arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Prompt tokens of left context in the first window (enough for any merge/space rule).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"
# Candidate prefixes decoded per batch while decode_once drops an incomplete tail.
_TAIL_BATCH = 32


def _backend_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` that ``tokenizer.decode`` would end up calling, or None
    when its decode is not transformers' stock fast one (slow tokenizers, subclasses that
    override decoding, test doubles): only then is skipping the wrapper the same text."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

        cls = type(tokenizer)
        if (cls._decode is not PreTrainedTokenizerFast._decode
                or cls.decode is not PreTrainedTokenizerBase.decode):
            return None
        backend = tokenizer.backend_tokenizer
    except (ImportError, AttributeError):
        return None
    return backend if isinstance(backend, Tokenizer) else None


def _decoder(tokenizer: Any, skip_special_tokens: bool,
             backend: Any | None) -> Callable[[list[int]], str]:
    """``decode(ids) -> str``, the text of ``tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)``; ``backend``: ``_backend_tokenizer(tokenizer)``.

    transformers' ``decode`` runs ``to_py_obj`` over the ids first (a Python-level pass,
    most of the cost of a 600-token decode); with a stock fast tokenizer and no clean-up
    it then only calls the Rust tokenizer's ``decode``, so call that directly."""
    if backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens) if ids else ""
    else:
        def decode(ids: list[int]) -> str:
            if not ids:
                return ""
            return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)
    return decode


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, one token at a time.

    ``tokenizer``: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
    ``stop``: strings that end the output; the text is cut right before the first one
    (right after it with ``include_stop``).
    ``min_tokens``: stop strings are looked for only once the output has that many
    tokens (as EOS and stop tokens are banned before it; vLLM's rule).

    After each ``add``: ``text`` is the full output text so far (trimmed at a stop
    string once ``stopped``); ``add`` returns the newly *final* text, which holds back a
    tail that may still grow into a stop string (for streaming).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] | None = None,
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or ()) if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # Built once: this runs twice per token.
        self._decode = _decoder(tokenizer, skip_special_tokens,
                                _backend_tokenizer(tokenizer))
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]
        # Window over `_ids` (the prompt's tail, then the output): [prefix, read) is
        # already in `text`, [read, end) is pending.
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = self._decode(self._ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched
        self._emitted = 0  # len of the text returned by add() so far

    def add(self, token_id: int) -> str:
        """Append one output token; returns the text that became final with it."""
        if self.stopped:
            return ""
        self.token_ids.append(int(token_id))
        self._ids.append(int(token_id))
        full = self._decode(self._ids[self._prefix:])
        if full.endswith(_REPLACEMENT) or len(full) <= len(self._prefix_text):
            # Incomplete character (or a token that adds no text, e.g. a skipped
            # special token): wait for more tokens, keep the window.
            return ""
        old_len = len(self.text)
        self.text += full[len(self._prefix_text):]
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        if self.stop and len(self.token_ids) >= self.min_tokens:
            self._check_stop(old_len)
        return self._flush()

    def _check_stop(self, old_len: int) -> None:
        # A stop string can end in the new text and start in older text.
        start = max(0, old_len - self._max_stop + 1)
        best = -1
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, self.stop_reason = i, s
        if best != -1:
            self.text = self.text[:best + (len(self.stop_reason) if self.include_stop else 0)]
            self.stopped = True

    def _flush(self) -> str:
        end = len(self.text)
        if not self.stopped:
            end -= self._partial_stop_len()
        if end <= self._emitted:
            return ""
        new = self.text[self._emitted:end]
        self._emitted = end
        return new

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


def decode_once(tokenizer: Any, prompt_token_ids: Sequence[int], token_ids: Sequence[int],
                skip_special_tokens: bool = True) -> str:
    """The text ``IncrementalDetokenizer`` builds from ``token_ids``, usually in two decode
    calls: the output decoded after the same prompt context, minus the context's own text.

    The incremental path emits text only when its window does not end in an incomplete
    character, so tokens after its last emission are never in its text (a token can hold
    a whole character and the first byte of the next). The same tail is dropped here: the
    text is that of the longest prefix whose decode does not end in U+FFFD. Whether a
    prefix's text ends in U+FFFD is not monotone in its length, so prefixes are tried
    longest first; with a Rust tokenizer they are decoded in batches (a model that keeps
    repeating a lone continuation-byte token would otherwise cost one full decode per
    dropped token), else one decode each (only outputs cut inside a character pay it)."""
    context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]
    ids = [int(t) for t in token_ids]
    if not ids:
        return ""
    backend = _backend_tokenizer(tokenizer)
    decode = _decoder(tokenizer, skip_special_tokens, backend)
    prefix = decode(context)
    full = decode(context + ids)
    if not full.endswith(_REPLACEMENT):
        return full[len(prefix):]

    if backend is None:
        while len(ids) > 1:
            ids.pop()
            full = decode(context + ids)
            if not full.endswith(_REPLACEMENT):
                return full[len(prefix):]
        return ""

    seq = context + ids
    # Output lengths still to try, longest first (the full length is known to fail).
    end = len(ids) - 1
    while end > 0:
        lengths = range(end, max(end - _TAIL_BATCH, 0), -1)
        texts = backend.decode_batch([seq[:len(context) + n] for n in lengths],
                                     skip_special_tokens=skip_special_tokens)
        for text in texts:
            if not text.endswith(_REPLACEMENT):
                return text[len(prefix):]
        end -= _TAIL_BATCH
    return ""
