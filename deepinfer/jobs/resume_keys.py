"""Resume keys: which lines of an output file are whole records, and the key each one is
resumed and merged by (its record id; for an OpenAI batch line that succeeded, the id of
its custom_id's input record).

The one rule for a valid output line is ``valid_lines``; ``resume`` and ``parts`` read
output files through it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# OpenAI batch lines: the record id of a line that runs is this prefix + its custom_id;
# lines that fail by themselves get ids under another prefix, so no custom_id can take one.
OPENAI_ID_PREFIX = "batch_req_"


def openai_success(line: dict[str, Any]) -> bool:
    """Whether an output line is an OpenAI batch line with status 200 (the only kind
    resume keeps)."""
    resp = line.get("response")
    return isinstance(resp, dict) and resp.get("status_code") == 200


def line_key(line: dict[str, Any]) -> str:
    """The resume and merge key of an output line: its ``id``, except for an OpenAI batch
    line that succeeded: ``OPENAI_ID_PREFIX + custom_id``, the id of its input record
    (resume is by custom_id, and OpenAI's service or an older deepinfer wrote other
    ids)."""
    cid = line.get("custom_id")
    if isinstance(cid, str) and openai_success(line):
        return OPENAI_ID_PREFIX + cid
    return str(line["id"])


def valid_lines(path: str, skipped: list[int] | None = None
                ) -> Iterator[tuple[int, bytes, str, dict[str, Any]]]:
    """``(offset, raw_line, key, record)`` of each whole output record of ``path``, in file
    order (``key``: ``line_key``).

    The one rule for a valid output line: a whole line (it ends with a newline) holding a
    JSON object with an ``id``. A killed writer leaves at most its last line torn (no
    newline): that ends the file. A whole line that is not valid (edited by hand, or a
    torn line a later run appended to) is passed over, its 1-based number appended to
    ``skipped``: the records after it stay."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and "id" in rec:
                yield offset, raw, line_key(rec), rec
            elif skipped is not None:
                skipped.append(lineno)
            offset += len(raw)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes) -> bool:
    """Whether an output line (already known to parse) holds no NaN / Infinity."""
    if b"NaN" not in raw and b"Infinity" not in raw:
        return True  # the common case, without a second parse
    try:
        json.loads(raw, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return True
