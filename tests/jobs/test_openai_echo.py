"""OpenAI completions with ``echo``: the prompt leads the text and, with ``logprobs``, the
logprob lists (its first token with null entries, as the legacy API gives them), scored by
the engine's ``prompt_logprobs``; ``max_tokens: 0`` scores without generating. Checked
against OpenAI's shapes and, end to end on the default model, transformers' logprobs. Bad
lines (echo on chat, ``max_tokens: 0`` without echo, a prompt logprob count over the cap)
fail alone, naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from deepinfer.generate import main
from deepinfer.jobs.openai_batch import parse_openai_line
from tests.models.test_models import hf_logits

# OpenAI's legacy completions ``logprobs`` object with ``echo``: the first token's
# logprob and top_logprobs are null.
ECHO_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {"type": "array",
                         "items": {"type": ["object", "null"],
                                   "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}

URL = "/v1/completions"


def _line(cid: str, url: str = URL, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "body.echo"),
    ({"prompt": "x", "max_tokens": 0}, "body.max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "body.max_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "body.logprobs"),
])
def test_bad_lines_name_the_field(body, field):
    url = "/v1/chat/completions" if "messages" in body else URL
    rec = parse_openai_line(_line("x", url, **body), 3)
    assert rec.error is not None and field in rec.error and "line 3" in rec.error


def test_echo_fields_become_prompt_logprobs():
    rec = parse_openai_line(_line("a", prompt="hi", echo=True, logprobs=3), 1)
    assert rec.echo and rec.overrides == {"logprobs": 3, "prompt_logprobs": 3}
    rec = parse_openai_line(_line("b", prompt="hi", echo=True, max_tokens=0), 1)
    assert rec.overrides == {"max_tokens": 0, "prompt_logprobs": 0}
    rec = parse_openai_line(_line("c", prompt="hi", echo=True), 1)
    assert rec.echo and rec.overrides == {}  # echoed text only: nothing to score


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_echo_end_to_end_matches_transformers(tmp_path, smollm2_path, hf_smollm2,
                                              smollm2_tokenizer):
    prompt = "The capital of France is Paris. The capital of Italy is"
    lines = [
        _line("score", prompt=prompt, echo=True, logprobs=2, max_tokens=0),
        _line("gen", prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0),
        _line("text", prompt=prompt, echo=True, max_tokens=2, temperature=0),
        _line("chat-echo", "/v1/chat/completions", echo=True,
              messages=[{"role": "user", "content": "hi"}]),
        _line("no-echo-zero", prompt=prompt, max_tokens=0),
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["--input", str(inp), "--output", str(out), "--model", smollm2_path,
               "--dtype", "float32", "--quantization", "none", "--device", "cpu",
               "--no-progress"])
    assert rc == 1  # the two bad lines failed, alone
    recs = {r["custom_id"]: r for r in _read(out)}
    for cid, field in (("chat-echo", "body.echo"), ("no-echo-zero", "body.max_tokens")):
        assert recs[cid]["response"] is None and field in recs[cid]["error"]["message"]

    ids = smollm2_tokenizer.encode(prompt, add_special_tokens=True)
    want = torch.log_softmax(hf_logits(hf_smollm2, ids), dim=-1)
    score = recs["score"]["response"]["body"]
    choice = score["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert score["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    jsonschema.validate(lp, ECHO_SCHEMA)
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - want[p - 1, ids[p]].item()) <= 1e-4
        assert len(lp["top_logprobs"][p]) >= 2
    assert lp["text_offset"][0] == 0
    assert all(prompt[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))

    gen = recs["gen"]["response"]["body"]["choices"][0]
    assert gen["text"].startswith(prompt) and len(gen["text"]) > len(prompt)
    glp = gen["logprobs"]
    jsonschema.validate(glp, ECHO_SCHEMA)
    assert len(glp["tokens"]) == len(ids) + 3
    assert glp["token_logprobs"][0] is None
    assert glp["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:],
                                                              abs=1e-5)
    assert "".join(glp["tokens"]) == gen["text"]
    text = recs["text"]["response"]["body"]["choices"][0]
    assert text["text"].startswith(prompt) and text["logprobs"] is None


def test_native_lines_with_bad_prompt_logprobs_fail_alone(tmp_path, tiny_checkpoints):
    lines = [{"id": "ok", "prompt": "hello world", "prompt_logprobs": 1, "max_tokens": 0},
             {"id": "over", "prompt": "hello", "prompt_logprobs": 21},
             {"id": "negative", "prompt": "hello", "prompt_logprobs": -1},
             {"id": "zero", "prompt": "hello", "max_tokens": 0}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.jsonl"
    rc = main(["--input", str(inp), "--output", str(out), "--model",
               tiny_checkpoints["llama3"].path, "--device", "cpu", "--no-progress"])
    assert rc == 1
    recs = {r["id"]: r for r in _read(out)}
    assert recs["ok"]["outputs"][0]["token_ids"] == []
    assert recs["ok"]["prompt_logprobs"][0] is None and len(recs["ok"]["prompt_logprobs"]) > 1
    for rid, field in (("over", "prompt_logprobs=21"), ("negative", "prompt_logprobs=-1"),
                       ("zero", "max_tokens=0")):
        assert field in recs[rid]["error"], recs[rid]
