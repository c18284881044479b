"""The bytes each token id adds to decoded text, and the text OpenAI's logprobs show for it.

OpenAI's logprob entries name a token by its text and its UTF-8 ``bytes``. Decoding one id
on its own is not enough: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) splits a
multi-byte character over tokens, and each piece alone decodes to U+FFFD; sentencepiece
decoders drop the leading space of the text's first token. So the bytes are read from the
token's vocabulary piece, the way the tokenizer's decoder maps it:

- byte-level decoders: each character of the piece stands for one byte (GPT-2's
  printable-byte alphabet);
- byte fallback (Llama 2, Mistral, Gemma): ``<0xNN>`` pieces are one byte; other pieces
  are text with ``▁`` for a space;
- any other tokenizer: the id decoded alone, as UTF-8.

The text of a token is its bytes decoded with replacement: a piece of a character shows as
U+FFFD, and its ``bytes`` still say which piece.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


def _printable_byte_alphabet() -> dict[str, int]:
    """Character -> byte of GPT-2's byte-level alphabet: bytes that print as Latin-1
    characters stand for themselves, the others for characters from U+0100 on, in
    order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The ``type`` names in the fast tokenizer's decoder (nested sequences included);
    empty when there is no fast backend."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    except (AttributeError, ValueError, TypeError):
        return set()
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "type" in node:
                kinds.add(str(node["type"]))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return kinds


class TokenBytes:
    """``token_bytes(id) -> bytes`` and ``token_bytes.text(id) -> str`` for one tokenizer
    (a transformers tokenizer), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        kinds = _decoder_kinds(tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._fallback = "ByteFallback" in kinds or "Metaspace" in kinds
        self._alphabet = _printable_byte_alphabet() if self._byte_level else {}
        special = getattr(tokenizer, "all_special_ids", None) or []
        self._special = set(special)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(int(token_id))
        return b

    def text(self, token_id: int) -> str:
        """The token's bytes as text, U+FFFD for a partial character."""
        return self(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        piece = None
        if token_id not in self._special:
            piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
            if self._fallback:
                m = _BYTE_PIECE.fullmatch(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")
        # Special and added tokens, other decoders: the id's own decoded text.
        return self._tok.decode([token_id], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False).encode("utf-8")
