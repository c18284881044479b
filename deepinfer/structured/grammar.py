"""Grammars with xgrammar: the tokenizer's vocabulary as xgrammar sees it, a request's
constraint as an ``xgrammar.Grammar``, and compiled grammars cached by key and compiled
in a thread pool.

Two stages, on purpose:

- ``build_grammar`` turns a ``StructuredOutputsParams`` into a grammar (schema -> EBNF,
  regex -> EBNF, EBNF parsing). It takes well under a millisecond and is where an
  unsupported schema or a regex that does not compile fails, so the engine runs it in
  ``add_request`` and a bad request fails alone, with a ``ValueError``.
- ``GrammarCache.compile`` builds the token-mask tables of a grammar against the whole
  vocabulary (milliseconds to seconds for big schemas): a ``Future`` from a thread pool
  (xgrammar releases the GIL), one per distinct key, so the step loop never waits for it
  while it has other work.

xgrammar is imported on first use: engines that never see a constrained request do not
pay its import.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from typing import Any

from deepinfer.structured.params import StructuredOutputsParams, schema_of

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:NNN: ": noise for a user.
_LOCATION = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
# xgrammar (0.2.9) writes the characters of a length-bounded JSON string (minLength /
# maxLength) as [^"\\\r\n] (EBNF text): raw control characters pass, which JSON
# forbids (json.loads rejects them; seen with sampled outputs). Replaced by what its
# unbounded strings use, with the C0 range excluded.
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


# JSON-schema keywords xgrammar (0.2.9) accepts and then ignores, so outputs could break
# them (checked with its own matcher on strings that break each): refused, as the spec
# asks of an unsupported schema. allOf is enforced with one subschema only. (min/
# maxContains mean nothing without contains, then/else nothing without if: both refused.)
UNSUPPORTED_SCHEMA_KEYWORDS = ("uniqueItems", "contains", "dependentRequired",
                               "dependentSchemas", "not", "if")
# Where a schema holds subschemas: keyword -> how (one, a list, or a name -> schema map).
_SUBSCHEMAS = {**dict.fromkeys(("items", "additionalItems", "additionalProperties",
                                "unevaluatedItems", "unevaluatedProperties",
                                "propertyNames"), "one"),
               **dict.fromkeys(("prefixItems", "anyOf", "oneOf", "allOf"), "list"),
               **dict.fromkeys(("properties", "patternProperties", "$defs",
                                "definitions"), "map")}


def unsupported_schema_part(schema: Any, path: str = "") -> str | None:
    """The first place in ``schema`` that the grammar would not enforce, as
    ``"'<keyword>' at <json pointer>"``, or None. Keywords are looked for only where the
    schema has keywords (property names such as ``"not"`` are names)."""
    if not isinstance(schema, dict):
        return None
    for kw in UNSUPPORTED_SCHEMA_KEYWORDS:
        if kw in schema:
            return f"'{kw}' at {path or '/'}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with {len(schema['allOf'])} subschemas at {path or '/'}"
    found = _unenforced_combination(schema)
    if found:
        return f"{found} at {path or '/'}"
    for kw, how in _SUBSCHEMAS.items():
        sub = schema.get(kw)
        if how == "one":
            parts = [(f"{path}/{kw}", sub)]
        elif how == "list" and isinstance(sub, list):
            parts = [(f"{path}/{kw}/{i}", x) for i, x in enumerate(sub)]
        elif how == "map" and isinstance(sub, dict):
            parts = [(f"{path}/{kw}/{name}", x) for name, x in sub.items()]
        else:
            continue
        if kw == "items" and isinstance(sub, list):  # draft-7 tuple form
            parts = [(f"{path}/items/{i}", x) for i, x in enumerate(sub)]
        for where, x in parts:
            found = unsupported_schema_part(x, where)
            if found:
                return found
    return None


def _unenforced_combination(schema: dict[str, Any]) -> str | None:
    """Keyword uses xgrammar (0.2.9) compiles but does not enforce (each seen breaking
    an output): ``required`` naming a key ``properties`` lacks (strict mode drops
    unlisted keys), a length bound beside ``pattern`` / ``format`` / ``enum``,
    ``multipleOf`` on non-integers, and a ``pattern`` that matches ``"`` or ``\\`` (its
    characters go into the JSON string unescaped)."""
    req, props = schema.get("required"), schema.get("properties")
    if isinstance(req, list):
        missing = [k for k in req if not isinstance(props, dict) or k not in props]
        if missing:
            return f"'required' naming {missing[0]!r}, which 'properties' lacks,"
    bound = next((k for k in ("minLength", "maxLength") if k in schema), None)
    other = next((k for k in ("pattern", "format", "enum") if k in schema), None)
    if bound and other:
        return f"{bound!r} with {other!r}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return "'multipleOf' on a non-integer type"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _JSON_ESCAPED_IN_PATTERN.search(pattern):
        return "a 'pattern' matching '\"' or '\\'"
    return None


# A quote, or a regex escape of a backslash or quote, in a pattern's text.
_JSON_ESCAPED_IN_PATTERN = re.compile(r'"|\\\\|\\x(?:22|5[cC])|\\u00(?:22|5[cC])')


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """The ``xgrammar.TokenizerInfo`` of a transformers fast tokenizer for a model with
    ``vocab_size`` logits. Special (control) tokens are blanked out of the vocabulary,
    so a grammar never emits them as text (they would vanish from the decoded output
    with ``skip_special_tokens``); ``stop_token_ids`` (EOS) stay the grammar's end."""
    import xgrammar as xgr

    stops = sorted(set(stop_token_ids)) or None
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stops)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, t in decoder.items() if getattr(t, "special", False)}
    if not special:
        return base
    vocab = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            vocab[i] = text
    return xgr.TokenizerInfo(vocab, base.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stops or base.stop_token_ids,
                             add_prefix_space=base.add_prefix_space)


def choice_ebnf(choices: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are
    also xgrammar's EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(so: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` of ``so``. Raises ``ValueError`` naming the field when the
    schema is not supported, the regex or the EBNF does not parse."""
    import xgrammar as xgr

    kind = so.kind
    try:
        if kind == "json":
            schema = schema_of(so.json)
            unsupported = unsupported_schema_part(schema)
            if unsupported:
                raise ValueError(f"{unsupported} is not supported (the output could "
                                 "break it)")
            g = xgr.Grammar.from_json_schema(json.dumps(schema),
                                             any_whitespace=so.any_whitespace)
            text = str(g)
            if _BOUNDED_CHAR in text:
                g = xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHAR, _JSON_CHAR))
            return g
        if kind == "json_object":
            # Not strict: any keys, any values (strict mode forbids unlisted keys).
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                any_whitespace=so.any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(so.choice))
        return xgr.Grammar.from_ebnf(so.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        msg = _LOCATION.sub("", lines[0] if lines else type(e).__name__)
        raise ValueError(f"structured_outputs.{kind}: {msg}") from e


class GrammarCache:
    """Compiled grammars by ``StructuredOutputsParams.cache_key``, compiled in a thread
    pool (``workers`` threads) against ``info`` (an ``xgrammar.TokenizerInfo``). The same
    key asked twice shares one compilation, finished or not; at most ``max_entries``
    are kept (the least recently asked finished ones go first)."""

    def __init__(self, info: Any, workers: int = 2, max_entries: int = 256) -> None:
        import xgrammar as xgr

        self.info = info
        self.max_entries = max_entries
        # xgrammar's own cache off: this one is keyed by request parameters and also
        # shares compilations still running.
        self._compiler = xgr.GrammarCompiler(info, max_threads=workers,
                                             cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="deepinfer-grammar")
        self._futures: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._lock = Lock()

    def compile(self, so: StructuredOutputsParams) -> Future:
        """A ``Future`` of ``so``'s ``xgrammar.CompiledGrammar``. A key not seen before is
        built here (``build_grammar``: ``ValueError`` for a bad schema/regex/EBNF) and
        compiled in the pool."""
        key = so.cache_key()
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None:
                self._futures.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compiler.compile_grammar, build_grammar(so))
            self._futures[key] = fut
            if len(self._futures) > self.max_entries:
                old = next((k for k, f in self._futures.items() if f.done()), None)
                if old is not None:
                    del self._futures[old]
            return fut

    def __len__(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        """Stop the pool (running compilations finish first)."""
        self._pool.shutdown(wait=True)
