"""Reading an input file line by line, so that one bad line fails alone.

Each line is decoded on its own (UTF-8, a BOM on line 1 dropped, CRLF or LF ends): a
line that is not UTF-8 becomes that line's error instead of refusing the whole file. A
JSON line is parsed by :func:`load_json_line`, which also refuses text that holds a lone
UTF-16 surrogate (``"\\ud800"`` is valid JSON, but no tokenizer or UTF-8 writer takes it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

# A JSON escape of a UTF-16 surrogate: only then can a parsed line hold a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def check_input_file(path: str) -> None:
    """``FileNotFoundError`` / ``ValueError`` naming ``--input`` unless ``path`` is a
    readable file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input {path!r}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"--input {path!r}: not a file")


def read_lines(path: str) -> Iterator[tuple[int, str | None, str | None]]:
    """``(lineno, text, error)`` of each non-blank line of ``path`` (1-based line numbers;
    ``text`` without its line end; ``text`` None and ``error`` naming the line when it
    is not UTF-8)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a BOM (Windows editors) is not part of line 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, (f"line {lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} "
                                     f"at column {e.start + 1})")
                continue
            text = text.rstrip("\r\n")
            if text.strip():
                yield lineno, text, None


def load_json_line(text: str, lineno: int) -> tuple[Any, str | None]:
    """``(value, None)`` of a JSON line, or ``(None, error)`` naming the line when it is
    malformed or holds a lone surrogate."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"line {lineno}: malformed JSON ({e.msg})"
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return None, f"line {lineno}: a string holds a lone UTF-16 surrogate escape"
    return value, None
