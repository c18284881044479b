"""The OpenAI batch file format through ``deepinfer-generate``: detection, per-line
errors, output lines in input order, resume by ``custom_id``, and ``--dp 2``."""

from __future__ import annotations

import json

import pytest

from deepinfer.generate import main
from deepinfer.jobs.formats import open_job
from deepinfer.jobs.openai_batch import is_openai_batch, parse_openai_line


def _line(cid, url="/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _chat(cid, text, **kw) -> str:
    return _line(cid, messages=[{"role": "user", "content": text}], model="m", **kw)


def _batch_lines() -> list[str]:
    return [
        _chat("c1", "hello world", max_tokens=4),
        _line("p1", "/v1/completions", prompt="the quick brown fox", max_tokens=5,
              temperature=0.0, logprobs=2),
        _line("bad-url", "/v1/embeddings", input="x"),
        "{not json",
        _chat("c1", "a second c1", max_tokens=3),  # duplicate custom_id
        _chat("c2", "once upon a time", max_completion_tokens=3, n=2, temperature=1.0,
              seed=5, logprobs=True, top_logprobs=1),
        _chat("streamed", "x", stream=True),
        _chat("tools", "x", tools=[]),
    ]


@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    return ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
            "--no-progress"]


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _check_batch_output(recs: list[dict]) -> None:
    """One line per input line, in input order, with the right custom_id and status."""
    assert [r["custom_id"] for r in recs] == ["c1", "p1", "bad-url", None, "c1", "c2",
                                             "streamed", "tools"]
    ok = [r for r in recs if r["error"] is None]
    assert [r["custom_id"] for r in ok] == ["c1", "p1", "c2"]
    for r in ok:
        resp = r["response"]
        assert resp["status_code"] == 200 and r["id"] == resp["request_id"]
        body = resp["body"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        for ch in body["choices"]:
            assert ch["finish_reason"] in ("stop", "length")
    c1, p1, c2 = (r["response"]["body"] for r in ok)
    assert c1["object"] == "chat.completion" and c1["choices"][0]["message"]["role"] == (
        "assistant")
    assert c1["usage"]["completion_tokens"] <= 4
    assert p1["object"] == "text_completion" and isinstance(p1["choices"][0]["text"], str)
    lp = p1["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == p1["usage"]["completion_tokens"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert len(c2["choices"]) == 2 and c2["usage"]["completion_tokens"] <= 6
    assert c2["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    errors = {r["custom_id"]: r["error"]["message"] for r in recs if r["error"] is not None}
    assert "url" in errors["bad-url"] and "/v1/embeddings" in errors["bad-url"]
    assert "line 4" in errors[None] and "malformed JSON" in errors[None]
    assert "duplicate custom_id" in errors["c1"] and "line 5" in errors["c1"]
    assert "stream" in errors["streamed"]
    assert "body.tools" in errors["tools"]


def test_detects_the_format_and_parses_fields(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(_batch_lines()) + "\n")
    assert is_openai_batch(str(path))
    native = tmp_path / "native.jsonl"
    native.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    assert not is_openai_batch(str(native))
    recs, _ = open_job(str(path), "auto", None)
    assert recs[0].api == "chat" and recs[0].overrides == {"max_tokens": 4}
    assert recs[1].api == "completion" and recs[1].prompt == "the quick brown fox"
    assert recs[1].overrides == {"max_tokens": 5, "temperature": 0.0, "logprobs": 2}
    assert recs[5].overrides["max_tokens"] == 3 and recs[5].overrides["logprobs"] == 1
    rec = parse_openai_line(_chat("s", "x", response_format={"type": "json_object"}), 1)
    assert rec.error is None and rec.overrides["structured_outputs"].json_object
    for body, field in ((dict(prompt=3), "body.prompt"), (dict(prompt="x", frobnicate=1),
                                                          "body.frobnicate")):
        rec = parse_openai_line(_line("x", "/v1/completions", **body), 9)
        assert rec.error is not None and field in rec.error and "line 9" in rec.error
    with pytest.raises(ValueError, match="--format"):
        open_job(str(path), "xml", None)


def test_round_trip_and_resume(tmp_path, model_args):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(_batch_lines()) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 1
    first = _read(out)
    _check_batch_output(first)

    # A killed run: two success lines and an error line survive, plus a torn line. The
    # first is marked (created = 0) to show that the resumed run does not redo it.
    keep = out.read_text().splitlines(keepends=True)[:3]
    marked = json.loads(keep[0])
    marked["response"]["body"]["created"] = 0
    keep[0] = json.dumps(marked) + "\n"
    out.write_text("".join(keep) + keep[1][: len(keep[1]) // 2])
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 1
    again = _read(out)
    _check_batch_output(again)
    assert again[0] == marked
    assert again[1] == first[1]
    # Finished: a rerun changes nothing but the error lines, written again.
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 1
    third = _read(out)
    _check_batch_output(third)
    assert [r for r in third if r["error"] is None] == [r for r in again if r["error"] is None]


def test_dp2_writes_the_same_lines(tmp_path, model_args):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(_batch_lines()) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), "--dp", "2", *model_args]) == 1
    _check_batch_output(_read(out))


def test_pd_writes_openai_lines(tmp_path, model_args):
    """``--pd 1:1``: the PD ranks write the same line format (n > 1 is a per-line error
    there: disaggregated prefill hands off single sequences)."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(_batch_lines()) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), "--pd", "1:1", *model_args]) == 1
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["c1", "p1", "bad-url", None, "c1", "c2",
                                             "streamed", "tools"]
    assert [r["custom_id"] for r in recs if r["error"] is None] == ["c1", "p1"]
    assert "n=2" in recs[5]["error"]["message"]
    assert recs[0]["response"]["body"]["object"] == "chat.completion"
