"""Structured-output parts below the engine: ``StructuredOutputsParams`` validation, the
jsonl fields, grammar building with xgrammar (errors name the field), the compile cache,
and the tokenizer's vocabulary as xgrammar sees it (the default model's GGUF tokenizer)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from deepinfer import SamplingParams, StructuredOutputsParams
from deepinfer.jobs.input_records import parse_jsonl_line
from deepinfer.structured.grammar import GrammarCache, build_grammar, tokenizer_info

SO = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


# ------------------------------------------------------------------ params
@pytest.mark.parametrize("kwargs, field", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json_object": False}, "exactly one of"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"grammar": None, "choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"json_object": 1}, "structured_outputs.json_object"),
    # Falsy values are bad values, not "unset" (0 == False).
    ({"json": 0}, "structured_outputs.json"),
    ({"json": 0, "regex": "a"}, "exactly one of"),
    ({"regex": 0.0}, "structured_outputs.regex"),
    ({"json_object": 0}, "structured_outputs.json_object"),
    ({"json_object": True, "any_whitespace": "yes"}, "structured_outputs.any_whitespace"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SO(**kwargs)


def test_kind_key_and_dict_forms():
    assert SO(json=SCHEMA).kind == "json"
    assert SO(json_object=True).kind == "json_object"
    # A schema dict and the same schema as a string (other whitespace) share a key; the
    # property order is kept (it is the output's order), so another order is another key.
    assert SO(json=SCHEMA).cache_key() == SO(json=json.dumps(SCHEMA, indent=2)).cache_key()
    two = {"type": "object", "properties": {"reasoning": {"type": "string"},
                                            "answer": {"type": "integer"}}}
    swapped = {**two, "properties": dict(reversed(list(two["properties"].items())))}
    assert SO(json=two).cache_key() != SO(json=swapped).cache_key()
    assert SO(json=SCHEMA).cache_key() != SO(json=SCHEMA, any_whitespace=True).cache_key()
    assert SO(choice=["a", "b"]).cache_key() != SO(choice=["b", "a"]).cache_key()
    assert SO.from_dict({"regex": "[0-9]+"}) == SO(regex="[0-9]+")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pattern'\]"):
        SO.from_dict({"pattern": "x"})
    with pytest.raises(ValueError, match="structured_outputs: expected an object"):
        SO.from_dict(["regex"])


def test_sampling_params_field():
    sp = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert sp.structured_outputs == SO(choice=["yes", "no"])
    # to_dict / from_dict round trip (PD hand-off, records).
    again = SamplingParams.from_dict(sp.to_dict())
    assert again.structured_outputs == sp.structured_outputs
    assert sp.replace(temperature=0.5).structured_outputs == sp.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs="):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        SamplingParams(structured_outputs={"choice": []})


def test_response_format():
    assert SO.from_response_format({"type": "text"}) is None
    assert SO.from_response_format({"type": "json_object"}) == SO(json_object=True)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert SO.from_response_format(rf) == SO(json=SCHEMA)
    for bad, msg in [({"type": "xml"}, r"response_format\.type='xml'"),
                     ({"json_schema": {}}, "with a 'type'"),
                     ({"type": "json_schema"}, r"response_format\.json_schema"),
                     ({"type": "json_schema", "json_schema": {"schema": "[]"}},
                      r"response_format\.json_schema\.schema")]:
        with pytest.raises(ValueError, match=msg):
            SO.from_response_format(bad)


# ------------------------------------------------------------------ jsonl fields
def _line(**obj) -> str:
    return json.dumps({"prompt": "hi", **obj})


def test_jsonl_structured_fields():
    rec = parse_jsonl_line(_line(structured_outputs={"regex": "[a-z]+"}), 1)
    assert rec.error is None and rec.overrides["structured_outputs"] == SO(regex="[a-z]+")
    rec = parse_jsonl_line(_line(sampling_params={"structured_outputs": {"choice": ["a"]},
                                                  "temperature": 0}), 2)
    assert rec.error is None and rec.overrides["structured_outputs"] == SO(choice=["a"])
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    rec = parse_jsonl_line(_line(response_format=rf), 3)
    assert rec.error is None and rec.overrides["structured_outputs"] == SO(json=SCHEMA)
    rec = parse_jsonl_line(_line(response_format={"type": "json_object"}), 4)
    assert rec.overrides["structured_outputs"] == SO(json_object=True)
    rec = parse_jsonl_line(_line(response_format={"type": "text"}), 5)
    assert rec.error is None and "structured_outputs" not in rec.overrides


@pytest.mark.parametrize("obj, msg", [
    ({"structured_outputs": {"choice": "yes"}}, r"line 7: structured_outputs\.choice"),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "line 7: structured_outputs: "
                                                             "exactly one"),
    ({"structured_outputs": "json"}, "line 7: structured_outputs: expected an object"),
    ({"response_format": {"type": "json_schema"}}, r"line 7: response_format\.json_schema"),
    ({"response_format": "json"}, "line 7: response_format: expected an object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "line 7: give 'structured_outputs' or 'response_format', not both"),
    ({"sampling_params": [1]}, "line 7: 'sampling_params' must be an object"),
])
def test_jsonl_bad_structured_fields_fail_the_line(obj, msg):
    rec = parse_jsonl_line(_line(**obj), 7)
    assert rec.error is not None and rec.error.startswith("line 7")
    assert re.search(msg, rec.error), rec.error


# ------------------------------------------------------------------ xgrammar
@pytest.mark.parametrize("so, field, words", [
    (SO(regex="((("), "regex", "parenthesis"),
    (SO(regex="(?=a)b"), "regex", "Lookahead"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "json", "minimum"),
    (SO(json={"$ref": "#/definitions/x"}), "json", "definitions"),
    (SO(json={"type": "foo"}), "json", "foo"),
    (SO(grammar="root ::= foo"), "grammar", "foo"),
    (SO(grammar="root ::= \"a"), "grammar", ""),
])
def test_build_grammar_errors_name_the_field(so, field, words):
    with pytest.raises(ValueError) as e:
        build_grammar(so)
    msg = str(e.value)
    assert msg.startswith(f"structured_outputs.{field}: ") and words in msg, msg
    assert ".cc:" not in msg  # the C++ source location is stripped


_OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "integer"}}}
_INTS = {"type": "array", "items": {"type": "integer"}}
# Each keyword build_grammar refuses: a schema using it and a string that breaks it.
IGNORED_BY_XGRAMMAR = {
    "uniqueItems": ({**_INTS, "uniqueItems": True}, "[1, 1]"),
    "contains": ({**_INTS, "contains": {"const": 3}, "maxContains": 1}, "[3, 3]"),
    "dependentRequired": ({**_OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**_OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
                         '{"a": 1}'),
    "not": ({"not": {"type": "string"}}, '"hi"'),
    "if": ({**_OBJ_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}'),
}


def test_refused_schema_keywords_are_the_ones_xgrammar_ignores(info):
    """Each refused keyword: xgrammar's own grammar accepts a string that breaks it (so
    outputs could), and build_grammar names it; when xgrammar learns one, this fails and
    the keyword can be allowed."""
    import xgrammar as xgr

    from deepinfer.structured.grammar import UNSUPPORTED_SCHEMA_KEYWORDS

    assert set(IGNORED_BY_XGRAMMAR) == set(UNSUPPORTED_SCHEMA_KEYWORDS)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    for kw, (schema, breaking) in IGNORED_BY_XGRAMMAR.items():
        raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(compiler.compile_grammar(raw))
        assert m.accept_string(breaking) and m.is_completed(), kw
        with pytest.raises(ValueError, match=f"structured_outputs.json: '{kw}' at / "):
            build_grammar(SO(json=schema))
    two = {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}
    m = xgr.GrammarMatcher(compiler.compile_grammar(
        xgr.Grammar.from_json_schema(json.dumps(two))))
    assert m.accept_string("9") and m.is_completed()  # the second subschema is dropped
    with pytest.raises(ValueError, match="'allOf' with 2 subschemas at /"):
        build_grammar(SO(json=two))


# Keyword uses xgrammar compiles but does not enforce: a schema and a string breaking it.
UNENFORCED_BY_XGRAMMAR = {
    "'required' naming 'age', which 'properties' lacks,": (
        {"type": "object", "properties": {"name": {"type": "string"}},
         "required": ["name", "age"]}, '{"name": "x"}'),
    "'maxLength' with 'pattern'": (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, '"abcdefgh"'),
    "'multipleOf' on a non-integer type": (
        {"type": "number", "multipleOf": 0.25}, "4.55"),
    "a 'pattern' matching '\"' or '\\'": (
        {"type": "string", "pattern": "^say \"[a-z]+\"$"}, '"say "hi""'),
}


def test_refused_keyword_uses_are_the_ones_xgrammar_does_not_enforce(info):
    """Each refused use: xgrammar's own grammar accepts a string that breaks the schema
    (a JSON quote left unescaped, a bound or a required key ignored), and build_grammar
    names it; integers' multipleOf and bare length bounds stay accepted."""
    import jsonschema
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    for words, (schema, breaking) in UNENFORCED_BY_XGRAMMAR.items():
        raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(compiler.compile_grammar(raw))
        assert m.accept_string(breaking) and m.is_completed(), words
        try:  # what it accepts is not JSON, or JSON the schema refuses
            jsonschema.validate(json.loads(breaking), schema)
            raise AssertionError(f"{breaking} is valid: not a breaking string ({words})")
        except (ValueError, jsonschema.ValidationError):
            pass
        with pytest.raises(ValueError, match=re.escape(f"structured_outputs.json: {words} "
                                                       "at /")):
            build_grammar(SO(json=schema))
    build_grammar(SO(json={"type": "integer", "multipleOf": 3}))
    build_grammar(SO(json={"type": "string", "maxLength": 3, "minLength": 1}))
    build_grammar(SO(json={"type": "string", "pattern": "^\\d+-[a-z]+$"}))


def test_schema_values_json_cannot_hold_are_named():
    """numpy scalars are the numbers they hold; a set is not JSON: a ValueError naming
    the field, not a TypeError."""
    import numpy as np

    key = SO(json={"type": "integer", "maximum": np.int64(5)}).cache_key()
    assert key[1] == '{"type": "integer", "maximum": 5}'
    with pytest.raises(ValueError, match="structured_outputs.json: not a JSON value"):
        SO(json={"enum": {1, 2}})


def test_unsupported_keywords_are_found_nested_and_names_are_not_keywords():
    nested = {"type": "object", "properties": {"not": {
        "type": "array", "items": {"type": "object", "properties": {
            "if": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}}
    with pytest.raises(ValueError, match="'uniqueItems' at /properties/not/items/"
                                         "properties/if"):
        build_grammar(SO(json=nested))
    refs = {"$defs": {"t": {"anyOf": [{"type": "string"}, {"not": {"const": 1}}]}},
            "$ref": "#/$defs/t"}
    with pytest.raises(ValueError, match=r"'not' at /\$defs/t/anyOf/1"):
        build_grammar(SO(json=refs))
    # Property names that are keywords elsewhere, "required" naming them, one-schema
    # allOf (pydantic's $ref wrapper): all enforced, all accepted.
    fine = {"type": "object", "$defs": {"x": {"type": "integer"}},
            "properties": {"not": {"type": "string"}, "if": {"allOf": [{"$ref": "#/$defs/x"}]},
                           "contains": {"enum": [{"not": 1}]}},
            "required": ["not", "if"]}
    build_grammar(SO(json=fine))


@pytest.fixture(scope="module")
def info(smollm2_tokenizer):
    return tokenizer_info(smollm2_tokenizer, 49152, [2])


def test_tokenizer_info_matches_the_tokenizer(info, smollm2_tokenizer):
    import xgrammar as xgr

    tok = smollm2_tokenizer
    assert info.vocab_size == 49152 and info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.stop_token_ids == [2]
    vocab = info.decoded_vocab
    # Every token's bytes, concatenated, give back the text (spaces, UTF-8, emoji, code).
    text = 'Héllo, wörld! {"a": [1, 2.5e-3]}\n\tdef f(x):  return x ** 2  # 😀 日本語'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == text.encode("utf-8")
    for i in range(0, 49152, 97):
        if i not in tok.all_special_ids and "\ufffd" not in tok.decode([i]):
            assert vocab[i].decode("utf-8") == tok.decode([i]), i
    # Control tokens (<|im_start|>, ...) are never text to a grammar.
    special = [i for i, t in tok.added_tokens_decoder.items() if t.special]
    assert special and all(vocab[i] == b"" for i in special)
    assert set(special) - {2} <= set(info.special_token_ids)


def test_choice_escaping_and_matcher(info):
    import xgrammar as xgr

    choices = ['say "hi"', "back\\slash", "two\nlines", "émoji 😀", "a"]
    cache = GrammarCache(info)
    try:
        compiled = cache.compile(SO(choice=choices)).result(timeout=60)
        for c in choices:
            m = xgr.GrammarMatcher(compiled)
            assert m.accept_string(c) and m.is_completed(), c
        m = xgr.GrammarMatcher(compiled)
        assert not m.accept_string("z")
    finally:
        cache.close()


def test_grammar_cache_shares_compilations(info):
    cache = GrammarCache(info, max_entries=2)
    try:
        f1 = cache.compile(SO(json=SCHEMA))
        assert isinstance(f1, Future)
        assert cache.compile(SO(json=json.dumps(SCHEMA))) is f1  # same key, one future
        f2 = cache.compile(SO(regex="[0-9]{3}"))
        assert f2 is not f1
        f1.result(timeout=60)
        f2.result(timeout=60)
        f3 = cache.compile(SO(choice=["x"]))  # over max_entries: the oldest done goes
        assert len(cache) == 2 and cache.compile(SO(choice=["x"])) is f3
        assert cache.compile(SO(json=SCHEMA)) is not f1
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            cache.compile(SO(regex="((("))
        assert len(cache) == 2
    finally:
        cache.close()


def test_bounded_json_strings_exclude_control_characters(info):
    """xgrammar 0.2.9 lets raw control characters into minLength/maxLength strings
    (invalid JSON); ``build_grammar`` closes that hole."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"]}
    cache = GrammarCache(info)
    try:
        compiled = cache.compile(SO(json=schema)).result(timeout=60)
    finally:
        cache.close()
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('{"s": "ab') and not m.accept_string("\x0b")
    assert m.accept_string('é"}') and m.is_completed()
    # Not more than 4 characters (code points, as jsonschema counts them).
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('{"s": "éééé') and not m.accept_string("é")
