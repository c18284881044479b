"""``StructuredOutputsParams``: what a request's output must match (vLLM-like names).

Exactly one constraint per request: ``json`` (a JSON schema, as a dict or a JSON string),
``regex``, ``choice`` (one of a list of strings), ``grammar`` (xgrammar EBNF) or
``json_object=True`` (any JSON object). ``any_whitespace`` (default False) lets JSON
outputs put any whitespace between tokens; by default the whitespace is fixed, one line
with ``json.dumps``'s separators (``", "`` and ``": "``), so that a small model cannot
run away emitting blank lines before ``max_tokens``.

Validation is about shape only and needs no xgrammar: every error is a ``ValueError``
naming the field (``structured_outputs.regex: ...``). Whether a schema or a regex is
supported is checked when the engine accepts the request (``deepinfer.structured.grammar``).

``from_dict`` / ``from_response_format`` read the per-line JSON fields of the jobs layer:
``{"regex": ...}``-style objects and OpenAI's ``response_format``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (exactly one of the first five fields set).

    - ``json``: a JSON schema (a dict, or a string holding one).
    - ``regex``: the whole output matches this regular expression.
    - ``choice``: the output is exactly one of these (non-empty list of strings).
    - ``grammar``: an EBNF grammar in xgrammar's dialect (``root ::= ...``).
    - ``json_object``: True: any JSON object.
    - ``any_whitespace``: JSON kinds only: allow any whitespace between JSON tokens
      (default False: one line, ``json.dumps``'s ``", "`` / ``": "`` separators).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def _given(self) -> list[str]:
        # ``is`` tests: 0 or "" set as a constraint is a bad value to name, not "unset"
        # (``0 in (None, False)`` holds). json_object=False means not asked for.
        return [k for k in KINDS if getattr(self, k) is not None
                and not (k == "json_object" and getattr(self, k) is False)]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field that breaks its rule."""
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: exactly one of {list(KINDS)} must be set, got "
                f"{given or 'none'}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r}: "
                             "must be true")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(f"structured_outputs.any_whitespace={self.any_whitespace!r}: "
                             "must be true or false")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            schema_of(value)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind}: must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of "
                                 "non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return self._given()[0]

    def cache_key(self) -> tuple[str, str, bool]:
        """``(kind, canonical text, any_whitespace)``: equal keys compile to the same
        grammar (a schema dict and the same schema as a string share one). Key order is
        kept: a schema's property order is its output's order."""
        kind = self.kind
        if kind == "json":
            text = json.dumps(schema_of(self.json))
        elif kind == "choice":
            text = json.dumps(list(self.choice))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.any_whitespace

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, JSON-ready."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and not (k == "any_whitespace" and not v)}

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        """From a JSON object such as ``{"regex": "[0-9]+"}``; ``ValueError`` naming an
        unknown key or a bad value."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise ValueError("structured_outputs: expected an object such as "
                             f"{{\"regex\": ...}}, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown key(s) {unknown}: expected some "
                             f"of {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_response_format(cls, rf: Any) -> StructuredOutputsParams | None:
        """From OpenAI's ``response_format``: ``{"type": "json_object"}``, ``{"type":
        "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or ``{"type":
        "text"}`` (None: no constraint). ``ValueError`` naming the bad part."""
        if not isinstance(rf, dict) or "type" not in rf:
            raise ValueError("response_format: expected an object with a 'type'")
        kind = rf["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise ValueError("response_format.json_schema: expected an object with a "
                                 "'schema' (and a 'name')")
            try:
                return cls(json=js["schema"])
            except ValueError as e:
                raise ValueError(f"response_format.json_schema.schema: {e}") from e
        raise ValueError(f"response_format.type={kind!r}: expected 'text', 'json_object' "
                         "or 'json_schema'")


def schema_of(value: Any) -> dict[str, Any]:
    """The schema dict of a ``json`` field (parsed when given as a string); ``ValueError``
    naming ``structured_outputs.json`` when it is neither an object nor a JSON string of
    one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json: not valid JSON ({e.msg})") from e
    if not isinstance(value, dict):
        raise ValueError("structured_outputs.json: must be a JSON schema object (a dict or "
                         f"a JSON string of one), got {type(value).__name__}")
    try:  # numpy scalars as the numbers they hold; anything else JSON cannot hold: named
        return json.loads(json.dumps(value, default=_json_scalar))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json: not a JSON value ({e})") from e


def _json_scalar(o: Any) -> Any:
    item = getattr(o, "item", None)  # numpy scalars
    if callable(item) and getattr(o, "shape", None) == ():
        return item()
    raise TypeError(f"{type(o).__name__} {o!r} is not JSON")
