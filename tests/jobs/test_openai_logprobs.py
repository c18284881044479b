"""OpenAI-exact logprobs in OpenAI batch output lines: tokens by their text and true UTF-8
bytes (chat), text and ``text_offset`` (completions), checked against OpenAI's shapes,
with a multi-byte character split over tokens."""

from __future__ import annotations

import math

import jsonschema
import pytest

from deepinfer.jobs.input_records import InputRecord
from deepinfer.jobs.openai_batch import OpenAIFormat, text_offsets
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.testing.random_model import build_bpe_tokenizer

# OpenAI's chat ``ChoiceLogprobs`` and legacy completions ``logprobs`` objects.
_TOP = {"type": "object", "additionalProperties": False,
        "required": ["token", "logprob", "bytes"],
        "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                       "bytes": {"type": ["array", "null"],
                                 "items": {"type": "integer", "minimum": 0,
                                           "maximum": 255}}}}
_ENTRY = {**_TOP, "required": [*_TOP["required"], "top_logprobs"],
          "properties": {**_TOP["properties"],
                         "top_logprobs": {"type": "array", "items": _TOP}}}
CHAT_SCHEMA = {"type": "object", "additionalProperties": False,
               "required": ["content", "refusal"],
               "properties": {"content": {"type": ["array", "null"], "items": _ENTRY},
                              "refusal": {"type": ["array", "null"], "items": _ENTRY}}}
COMPLETION_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}},
        "top_logprobs": {"type": "array",
                         "items": {"type": "object",
                                   "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}

TEXT = "ok é 😀 done"


@pytest.fixture(scope="module")
def tok():
    # The tiny byte-level BPE leaves non-ASCII bytes unmerged: "é" and "😀" are split.
    return build_bpe_tokenizer()


def _result(tok, api: str, top_k: int, token_ids: bool = False):
    ids = tok.encode(TEXT, add_special_tokens=False)
    other = tok.convert_tokens_to_ids("d")
    # The sampled token, a likelier alternative, and one a grammar masked (-inf).
    lps = [{t: -0.5, other: -0.25, 3: float("-inf")} for t in ids]
    rec = InputRecord(id="batch_req_x", custom_id="x", api=api,
                      overrides={"logprobs": top_k})
    fmt = OpenAIFormat([rec], "m", token_ids=token_ids)
    fmt.use_tokenizer(tok)
    out = RequestOutput("batch_req_x", None, [1, 2],
                        [CompletionOutput(0, TEXT, ids, "length", lps)], True)
    return ids, fmt.result(out)["response"]["body"]["choices"][0]["logprobs"]


def test_chat_entries_carry_text_and_true_bytes(tok):
    ids, lp = _result(tok, "chat", top_k=1)
    jsonschema.validate(lp, CHAT_SCHEMA)
    content = lp["content"]
    assert len(content) == len(ids)
    assert b"".join(bytes(e["bytes"]) for e in content) == TEXT.encode()
    split = [e for e in content if e["token"] == "\ufffd"]
    assert len(split) >= 2, "é and 😀 are split over tokens"
    for e in split:  # a piece of a character: its own bytes, not U+FFFD's
        assert bytes(e["bytes"]) != "\ufffd".encode()
        with pytest.raises(UnicodeDecodeError):
            bytes(e["bytes"]).decode()
    for e in content:
        assert e["logprob"] == -0.5
        # top_logprobs: exactly the top 1, the likelier alternative; -inf dropped.
        assert [t["logprob"] for t in e["top_logprobs"]] == [-0.25]
        assert e["top_logprobs"][0]["token"] == "d" and e["top_logprobs"][0]["bytes"] == [100]


def test_completion_tokens_offsets_and_top_dicts(tok):
    ids, lp = _result(tok, "completion", top_k=2)
    jsonschema.validate(lp, COMPLETION_SCHEMA)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids)
    for token, off in zip(lp["tokens"], lp["text_offset"]):
        if token != "\ufffd":  # a whole token reads as itself where it starts
            assert TEXT[off:off + len(token)] == token
    # The pieces of one character start where the character does.
    offs = dict(zip(range(len(ids)), lp["text_offset"]))
    e_at = TEXT.index("é")
    assert sum(1 for i, t in enumerate(lp["tokens"]) if t == "\ufffd" and offs[i] == e_at) == 2
    assert lp["text_offset"][-1] + len(lp["tokens"][-1]) == len(TEXT)
    for top in lp["top_logprobs"]:
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert all(math.isfinite(v) for v in top.values()) and "d" in top


def test_token_ids_form_on_request(tok):
    ids, lp = _result(tok, "chat", top_k=1, token_ids=True)
    jsonschema.validate(lp, CHAT_SCHEMA)
    assert [e["token"] for e in lp["content"]] == [f"token_id:{t}" for t in ids]
    assert b"".join(bytes(e["bytes"]) for e in lp["content"]) == TEXT.encode()
    _, lp = _result(tok, "completion", top_k=1, token_ids=True)
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]


def test_text_offsets_count_characters_not_bytes():
    pieces = [b"a", "é".encode()[:1], "é".encode()[1:], b"b", "😀".encode(), b"c"]
    assert text_offsets(pieces) == [0, 1, 1, 2, 3, 4]
    assert text_offsets(pieces, start=10)[0] == 10


def test_writing_logprobs_without_a_tokenizer_is_an_error(tok):
    rec = InputRecord(id="batch_req_x", custom_id="x", api="chat", overrides={"logprobs": 0})
    fmt = OpenAIFormat([rec], "m")
    out = RequestOutput("batch_req_x", None, [1], [CompletionOutput(0, "a", [5], "length",
                                                                   [{5: -0.1}])], True)
    with pytest.raises(RuntimeError, match="use_tokenizer"):
        fmt.result(out)
