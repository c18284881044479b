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
        _line("bad-url", "/v1/moderations", input="x"),
        "{not json",
        _chat("c1", "a second c1", max_tokens=3),  # duplicate custom_id
        _chat("c2", "once upon a time", max_completion_tokens=3, n=2, temperature=1.0,
              seed=5, logprobs=True, top_logprobs=1),
        _chat("streamed", "x", stream=True),
        _chat("tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
    ]


@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    # --temperature 0: lines that leave it out are greedy (OpenAI's default is 1).
    return ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "6", "--temperature", "0", "--kv-cache-memory", str(8 << 20),
            "--max-model-len", "64", "--no-progress"]


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
    # Tokens by their text (the tokenizer's), each with where it starts in the text.
    assert all(isinstance(t, str) and not t.startswith("token_id:") for t in lp["tokens"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert len(lp["text_offset"]) == len(lp["tokens"])
    for top in lp["top_logprobs"]:  # most likely first, as OpenAI lists them
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert len(top) >= 2
    for pos in c2["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in pos["top_logprobs"]]
        assert values == sorted(values, reverse=True)
    assert len(c2["choices"]) == 2 and c2["usage"]["completion_tokens"] <= 6
    for entry in c2["choices"][0]["logprobs"]["content"]:
        for e in (entry, *entry["top_logprobs"]):
            assert bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"]
    # usage counts every choice's tokens (n = 2).
    assert c2["usage"]["completion_tokens"] == sum(
        len(ch["logprobs"]["content"]) for ch in c2["choices"])
    errors = {r["custom_id"]: r["error"]["message"] for r in recs if r["error"] is not None}
    assert "url" in errors["bad-url"] and "/v1/moderations" in errors["bad-url"]
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
    recs = list(open_job(str(path), "auto", None)[0])
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
    there: disaggregated prefill hands off single sequences). Streamed one request at a
    time: each handed-off line's record travels with its sequence to the decode rank,
    which writes it."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(_batch_lines()) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), "--pd", "1:1",
                 "--max-in-flight", "1", *model_args]) == 1
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["c1", "p1", "bad-url", None, "c1", "c2",
                                             "streamed", "tools"]
    assert [r["custom_id"] for r in recs if r["error"] is None] == ["c1", "p1"]
    assert "n=2" in recs[5]["error"]["message"]
    assert recs[0]["response"]["body"]["object"] == "chat.completion"


# ---------------------------------------------------------------- review fixes
def _strict_read(path) -> list[dict]:
    """The lines of ``path``, refusing NaN / Infinity (not JSON)."""
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def _run(inp, out, model_args, *extra) -> int:
    return main(["--input", str(inp), "--output", str(out), *model_args, *extra])


@pytest.mark.parametrize("lines", [
    [_chat("a", "hi", max_tokens=2), "{oops", _chat("line2", "hi", max_tokens=2)],
    [_chat("line2", "hi", max_tokens=2), "{oops"],
    [_chat("x", "hi", max_tokens=2), _chat("x", "again"), _chat("batch_line_2", "hi",
                                                               max_tokens=2)],
], ids=["good-after-bad", "good-before-bad", "duplicate"])
def test_failed_line_ids_cannot_collide_with_custom_ids(tmp_path, model_args, lines):
    """A custom_id such as "line2" (or "batch_line_2") once shared the id of a failed
    line 2: the good line then failed as a duplicate id, or the run crashed."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = _strict_read(out)
    assert len(recs) == len(lines)
    assert len({r["id"] for r in recs}) == len(recs)
    bad = [r for r in recs if r["error"] is not None]
    assert len(bad) == 1 and bad[0]["id"] == "batch_line_2"
    assert "line 2:" in bad[0]["error"]["message"]
    for r in recs:
        if r["error"] is None:
            assert r["id"] == "batch_req_" + r["custom_id"] == r["response"]["request_id"]
    # A rerun rewrites the error line only.
    assert _run(inp, out, model_args) == 1
    assert [r["id"] for r in _strict_read(out)] == [r["id"] for r in recs]


def test_logprobs_of_grammar_masked_tokens_are_dropped(tmp_path, model_args):
    """Under structured output the top k hold tokens the grammar rules out (logprob -inf):
    they were written as ``-Infinity``, which is not JSON."""
    choice = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {
        "enum": ["yes", "no"]}}}
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([
        _chat("chat", "Is the sky blue?", response_format=choice, logprobs=True,
              top_logprobs=5, max_tokens=8),
        _line("cmpl", "/v1/completions", prompt="Is the sky", logprobs=5, max_tokens=8,
              response_format=choice),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    chat, cmpl = (r["response"]["body"]["choices"][0]["logprobs"] for r in _strict_read(out))
    content = chat["content"]
    assert content
    for pos in content:
        tops = pos["top_logprobs"]
        assert pos["token"] in {t["token"] for t in tops}
        assert all(t["logprob"] > float("-inf") for t in tops)
    # The first token must be '"': the grammar leaves fewer than 5 real alternatives.
    assert len(content[0]["top_logprobs"]) < 5
    assert len(cmpl["top_logprobs"][0]) < 5
    assert all(tok in top for tok, top in zip(cmpl["tokens"], cmpl["top_logprobs"]))


def test_write_record_refuses_non_finite_numbers(tmp_path, capsys):
    """A NaN or infinity that still reaches the writer is reported and fails its record
    alone, as an error line of its format (valid JSON), instead of killing the job."""
    import io

    from deepinfer.jobs.output_records import write_record

    out = io.StringIO()
    assert write_record(out, {"id": "ok", "outputs": [{"text": "x"}]})
    assert not write_record(out, {"id": "n", "outputs": [{"logprob": float("nan")}]})
    assert not write_record(out, {"id": "batch_req_o", "custom_id": "o", "response": {
        "status_code": 200, "body": {"x": float("-inf")}}, "error": None})
    ok, native, openai = (json.loads(x) for x in out.getvalue().splitlines())
    assert ok["outputs"] == [{"text": "x"}]
    assert native["id"] == "n" and "non-finite" in native["error"]
    assert openai["id"] == "batch_req_o" and openai["custom_id"] == "o"
    assert openai["response"] is None and "non-finite" in openai["error"]["message"]
    err = capsys.readouterr().err
    assert "'n'" in err and "'batch_req_o'" in err


def _done_line(cid: str, rid: str, marker: str) -> str:
    return json.dumps({"id": rid, "custom_id": cid, "response": {
        "status_code": 200, "request_id": "req_x", "body": {"marker": marker}},
        "error": None}) + "\n"


def test_resume_is_keyed_on_custom_id(tmp_path, model_args):
    """A status-200 line written by OpenAI's service (or an older deepinfer) has another
    id: its custom_id is done all the same; a second one for it is dropped; an error line
    is written again."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([_chat("a", "hi", max_tokens=2),
                              _chat("b", "hi", max_tokens=2)]) + "\n")
    out = tmp_path / "out.jsonl"
    failed_b = json.dumps({"id": "batch_req_b", "custom_id": "b", "response": None,
                           "error": {"code": "x", "message": "old failure"}}) + "\n"
    out.write_text(failed_b + _done_line("a", "batch_req_6f1c0a", "first")
                   + _done_line("a", "batch_req_77", "second"))
    assert _run(inp, out, model_args) == 0
    recs = _strict_read(out)
    assert [r["custom_id"] for r in recs] == ["a", "b"]
    assert recs[0]["response"]["body"] == {"marker": "first"}  # not run again
    assert recs[1]["response"]["status_code"] == 200


def test_resume_reruns_a_line_holding_infinity(tmp_path, model_args):
    """An older deepinfer wrote ``-Infinity`` logprobs: such a line is not JSON, so resume
    does not count it as done; the record runs again and the file becomes valid."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([_chat("a", "hi", max_tokens=2),
                              _chat("b", "hi", max_tokens=2)]) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "batch_req_a", "custom_id": "a", "response": {"status_code": '
                   '200, "request_id": "x", "body": {"lp": -Infinity}}, "error": null}\n'
                   + _done_line("b", "batch_req_b", "kept"))
    assert _run(inp, out, model_args) == 0
    a, b = _strict_read(out)
    assert a["custom_id"] == "a" and a["response"]["body"]["object"] == "chat.completion"
    assert b["response"]["body"] == {"marker": "kept"}


def test_bom_and_crlf_input(tmp_path, model_args):
    """A UTF-8 BOM broke format detection and line 1; CRLF line ends work too."""
    lines = [_line("a", "/v1/completions", prompt="hi", max_tokens=2),
             _chat("b", "hi", max_tokens=2)]
    inp = tmp_path / "batch.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    assert is_openai_batch(str(inp))
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    assert [r["custom_id"] for r in _strict_read(out)] == ["a", "b"]


def test_native_input_with_bom_and_crlf(tmp_path):
    from deepinfer.jobs.input_records import read_inputs

    txt = tmp_path / "in.txt"
    txt.write_bytes(b"\xef\xbb\xbfhello\r\nworld\r\n")
    assert [r.prompt for r in read_inputs(str(txt))] == ["hello", "world"]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "q", "prompt": "hi"}).encode()
                      + b"\r\n")
    (rec,) = read_inputs(str(jsonl))
    assert rec.error is None and rec.id == "q" and rec.prompt == "hi"


_NULLABLE = ("temperature", "top_p", "n", "max_tokens", "max_completion_tokens", "seed",
             "stop", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
             "response_format", "user", "metadata", "stream", "stream_options", "top_k",
             "min_p", "tools", "logit_bias")


def test_null_body_fields_mean_default(tmp_path, model_args):
    """OpenAI documents these fields as nullable: null is the default, not an error."""
    for field in _NULLABLE:
        for url, extra in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/completions", {"prompt": "x"})):
            rec = parse_openai_line(_line("c", url, **extra, **{field: None}), 3)
            assert rec.error is None, (field, url, rec.error)
            assert None not in (rec.overrides or {}).values(), field
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([
        _chat("chat", "hi", **{f: None for f in _NULLABLE if f != "max_tokens"},
              max_tokens=2),
        _line("cmpl", "/v1/completions", prompt="hi", max_tokens=None, n=None, logprobs=None,
              temperature=None, echo=None, suffix=None, best_of=None),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    chat, cmpl = _strict_read(out)
    assert chat["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert cmpl["response"]["body"]["usage"]["completion_tokens"] <= 6  # --max-tokens
    assert chat["response"]["body"]["choices"][0]["logprobs"] is None


def test_chat_flag_does_not_wrap_completions_lines(tmp_path, model_args):
    """For OpenAI lines the url decides: a /v1/completions prompt stays raw under --chat
    (its answer is a text_completion), /v1/chat/completions always uses the template."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([_line("p", "/v1/completions", prompt="hello world",
                                    max_tokens=3),
                              _chat("c", "hello world", max_tokens=3)]) + "\n")
    plain, chat = tmp_path / "plain.jsonl", tmp_path / "chat.jsonl"
    assert _run(inp, plain, model_args) == 0
    assert _run(inp, chat, model_args, "--chat") == 0

    def bodies(path):
        return [{k: v for k, v in r["response"]["body"].items() if k != "created"}
                for r in _strict_read(path)]

    assert bodies(plain) == bodies(chat)
    # The template adds tokens: the raw prompt is shorter than the chat one.
    p, c = bodies(chat)
    assert p["usage"]["prompt_tokens"] < c["usage"]["prompt_tokens"]


def test_rerun_with_nothing_pending_restores_input_order(tmp_path, model_args):
    """A run killed after its last record but before the final reorder: the rerun has
    nothing to run and must still leave the output in input order."""
    inp = tmp_path / "batch.jsonl"
    cids = ["a", "b", "c"]
    inp.write_text("\n".join(_chat(c, "hi " + c, max_tokens=2) for c in cids) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(reversed(lines)))  # completion order, say
    assert _run(inp, out, model_args) == 0
    assert out.read_text().splitlines(keepends=True) == lines  # byte for byte


def test_rerun_with_nothing_pending_restores_input_order_dp2(tmp_path, model_args):
    """The same under ``--dp 2``, whose merge is separate: an unordered output (a killed
    one-engine run) and leftover part files (a killed DP run) are both put in order."""
    inp = tmp_path / "batch.jsonl"
    cids = ["a", "b", "c", "d"]
    inp.write_text("\n".join(_chat(c, "hi " + c, max_tokens=2) for c in cids) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[3] + lines[1])
    (tmp_path / "out.jsonl.part0").write_text(lines[2])
    (tmp_path / "out.jsonl.part1").write_text(lines[0])
    assert _run(inp, out, model_args, "--dp", "2") == 0
    assert out.read_text().splitlines(keepends=True) == lines
    assert not list(tmp_path.glob("out.jsonl.part*"))
    out.write_text("".join(reversed(lines)))
    assert _run(inp, out, model_args, "--dp", "2") == 0
    assert out.read_text().splitlines(keepends=True) == lines


def test_result_of_a_removed_custom_id_is_dropped(tmp_path, model_args, capfd):
    """The input changed between runs: a status-200 line whose custom_id has no input line
    any more is dropped (one output line per input line), with a warning naming it."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(_chat(c, "hi", max_tokens=2) for c in ("a", "b")) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text(_done_line("gone", "batch_req_gone", "old")
                   + _done_line("b", "batch_req_b", "kept"))
    assert _run(inp, out, model_args) == 0
    recs = _strict_read(out)
    assert [r["custom_id"] for r in recs] == ["a", "b"]
    assert recs[1]["response"]["body"] == {"marker": "kept"}
    err = capfd.readouterr().err
    assert "'gone'" in err and "no line in the input" in err


def test_openai_lines_default_to_openai_sampling():
    """What a line leaves out: OpenAI's defaults in an OpenAI batch file (temperature 1,
    up to the rest of the context), deepinfer's in its own records (greedy, 128 tokens);
    a flag given on the command line is the default for both."""
    from deepinfer.cli import build_parser, default_sampling_params

    args = build_parser().parse_args(["--input", "i.jsonl", "--output", "o.jsonl"])
    openai, native = default_sampling_params(args, openai=True), default_sampling_params(args)
    assert openai.temperature == 1.0 and openai.max_tokens >= 1 << 40
    assert native.temperature == 0.0 and native.max_tokens == 128
    args = build_parser().parse_args(["--input", "i.jsonl", "--output", "o.jsonl",
                                      "--temperature", "0.3", "--max-tokens", "7"])
    for sp in (default_sampling_params(args, openai=True), default_sampling_params(args)):
        assert (sp.temperature, sp.max_tokens) == (0.3, 7)


def test_openai_line_without_max_tokens_runs_to_the_model_length(tmp_path, tiny_checkpoints):
    """No max_tokens in the body and none on the command line: the line generates up to
    max_model_len (``"length"``), as OpenAI's API and vLLM's run-batch do."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text(_line("p", "/v1/completions", prompt="hello world", ignore_eos=True,
                         temperature=0.0) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), "--model",
                 tiny_checkpoints["llama_tied"].path, "--device", "cpu", "--kv-cache-memory",
                 str(8 << 20), "--max-model-len", "32", "--no-progress"]) == 0
    (rec,) = _read(out)
    body = rec["response"]["body"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 32


def test_return_tokens_as_token_ids(tmp_path, model_args):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([
        _chat("c", "hello", logprobs=True, top_logprobs=2, max_tokens=3),
        _line("p", "/v1/completions", prompt="hello", logprobs=1, max_tokens=3),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *model_args,
                 "--return-tokens-as-token-ids"]) == 0
    chat, cmpl = (r["response"]["body"]["choices"][0]["logprobs"] for r in _read(out))
    for entry in chat["content"]:
        for e in (entry, *entry["top_logprobs"]):
            assert e["token"].startswith("token_id:") and isinstance(e["bytes"], list)
    assert all(t.startswith("token_id:") for t in cmpl["tokens"])
    assert all(k.startswith("token_id:") for top in cmpl["top_logprobs"] for k in top)
