"""``deepinfer-generate``'s input and output files: an output that is the input (or a
folder) or of the other format, repeated ids across a resume, lone surrogates and
non-UTF-8 bytes in one line, OpenAI format detection past a bad first line, duplicate
custom_ids of a bad line, no-op values of unsupported OpenAI fields, logprob limits and
shapes, native ids and logprobs, the output lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.generate import main
from deepinfer.jobs.input_records import parse_jsonl_line
from deepinfer.jobs.openai_batch import parse_openai_line

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    return ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
            "--no-progress"]


def _run(inp, out, model_args, *extra) -> int:
    return main(["--input", str(inp), "--output", str(out), *model_args, *extra])


def _line(cid, url=CHAT_URL, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _chat(cid, text, **kw) -> str:
    return _line(cid, messages=[{"role": "user", "content": text}], model="m", **kw)


def _native(**obj) -> str:
    return json.dumps(obj)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _read(path) -> list[dict]:
    """The output lines, strictly: UTF-8 and JSON without NaN / Infinity."""
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    text = Path(path).read_bytes().decode("utf-8")  # raises on a lone surrogate's bytes
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def _errors(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("error") is not None]


# ----------------------------------------------------------------- resume, empty input
def test_a_bad_line_inside_the_output_loses_nothing_after_it(tmp_path, model_args, capsys):
    """A whole line that is not a record (a blank line, an edit) in the middle of the
    output is dropped with a warning naming it; the records after it are kept, not run
    again."""
    inp = _write_lines(tmp_path / "in.jsonl", [_native(id=k, prompt=f"p {k}", max_tokens=2)
                                              for k in ("a", "b", "c")])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    a, b, c = out.read_text().splitlines()
    out.write_text("\n".join([a, "", "not a record", b]) + "\n")
    capsys.readouterr()
    assert _run(inp, out, model_args) == 0
    err = capsys.readouterr().err
    assert "dropped 2 line(s) that are not output records (line 2, 3)" in err
    assert "2 of 3 records already in" in err  # b was kept past the bad lines
    lines = out.read_text().splitlines()
    assert lines[:2] == [a, b] and [json.loads(x)["id"] for x in lines] == ["a", "b", "c"]


def test_empty_input_leaves_an_empty_output(tmp_path, model_args):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n\n")
    out = tmp_path / "sub" / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    assert out.read_bytes() == b""


def test_a_hub_model_id_naming_the_loaded_model_does_not_warn(tmp_path, model_args, capsys):
    inp = _write_lines(tmp_path / "in.jsonl", [
        _line("a", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
              model="some-org/llama_tied"),
        _line("b", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
              model="other-org/other-model")])
    capsys.readouterr()
    assert _run(inp, tmp_path / "out.jsonl", model_args) == 0
    err = capsys.readouterr().err
    assert "names model(s) ['other-org/other-model']" in err


def test_an_output_of_the_other_format_is_refused(tmp_path, model_args, capsys):
    """Resume would take none of another format's lines as done and drop them all."""
    native_in = _write_lines(tmp_path / "in.jsonl", [_native(id="a", prompt="hi",
                                                             max_tokens=2)])
    openai_in = _write_lines(tmp_path / "batch.jsonl", [_chat("a", "hi", max_tokens=2)])
    native_out, openai_out = tmp_path / "native.jsonl", tmp_path / "openai.jsonl"
    assert _run(native_in, native_out, model_args) == 0
    assert _run(openai_in, openai_out, model_args) == 0
    before = native_out.read_bytes(), openai_out.read_bytes()
    capsys.readouterr()
    assert _run(openai_in, native_out, model_args) == 2
    assert "holds deepinfer's own records and the input is an OpenAI batch file" in (
        capsys.readouterr().err)
    assert _run(native_in, openai_out, model_args) == 2
    assert "holds OpenAI batch lines" in capsys.readouterr().err
    assert (native_out.read_bytes(), openai_out.read_bytes()) == before


# ----------------------------------------------------------------- 1. output paths
@pytest.mark.parametrize("kind", ["txt", "openai"])
@pytest.mark.parametrize("spelling", ["same", "dotted"])
def test_output_that_is_the_input_is_refused(tmp_path, model_args, capsys, kind, spelling):
    if kind == "txt":
        inp = tmp_path / "in.txt"
        inp.write_text("hello world\nthe quick brown fox\n")
    else:
        inp = _write_lines(tmp_path / "in.jsonl", [_chat("a", "hello", max_tokens=2),
                                                   _chat("b", "hi", max_tokens=2)])
    before = inp.read_bytes()
    out = inp if spelling == "same" else tmp_path / "." / inp.name
    assert _run(inp, out, model_args) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "is the --input file" in err, err
    assert inp.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [inp.name]  # no lock left


def test_folder_as_output_or_input_is_refused(tmp_path, model_args, capsys):
    inp = tmp_path / "in.txt"
    inp.write_text("hello\n")
    folder = tmp_path / "results"
    folder.mkdir()
    assert _run(inp, folder, model_args) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "is a folder" in err, err
    assert list(folder.iterdir()) == []

    in_folder = tmp_path / "prompts"
    in_folder.mkdir()
    out = tmp_path / "out.jsonl"
    assert _run(in_folder, out, model_args) == 2
    err = capsys.readouterr().err
    assert "--input" in err and "not a file" in err, err
    assert not out.exists()


# ----------------------------------------------------------------- 2. repeated ids
def test_repeated_id_error_line_is_rewritten_on_resume(tmp_path, model_args):
    inp = _write_lines(tmp_path / "in.jsonl", [
        _native(id="x", prompt="hello", max_tokens=3),
        _native(id="x", prompt="hi", max_tokens=3),
    ])
    out = tmp_path / "out.jsonl"
    # A run killed after writing only the duplicate's error line.
    out.write_text(json.dumps({"id": "x", "error": "duplicate id 'x' in the input"}) + "\n")

    def check() -> None:
        recs = _read(out)
        assert len(recs) == 2, recs
        results = [r for r in recs if "outputs" in r]
        errors = [r for r in recs if "error" in r]
        assert len(results) == 1 and results[0]["id"] == "x", recs
        assert 1 <= len(results[0]["outputs"][0]["token_ids"]) <= 3
        assert len(errors) == 1 and errors[0]["id"] == "x", recs
        assert "duplicate id" in errors[0]["error"]

    assert _run(inp, out, model_args) == 1
    check()
    result_line = next(r for r in _read(out) if "outputs" in r)
    # Nothing new to run: the error line is written again, not doubled; the result kept.
    assert _run(inp, out, model_args) == 1
    check()
    assert next(r for r in _read(out) if "outputs" in r) == result_line


# ---------------------------------------------------- 3-4. lone surrogates, bytes not UTF-8
def test_lone_surrogate_custom_id_fails_its_line_alone(tmp_path, model_args):
    bad = json.dumps({"custom_id": "bad\ud800", "method": "POST", "url": CHAT_URL,
                      "body": {"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2}}, ensure_ascii=True)
    assert "\\ud800" in bad  # the escape, literally, in the file
    inp = _write_lines(tmp_path / "batch.jsonl", [_chat("a", "hello", max_tokens=2), bad,
                                                  _chat("c", "hi there", max_tokens=2)])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["a", None, "c"]
    assert recs[1]["response"] is None
    msg = recs[1]["error"]["message"]
    assert "line 2" in msg and "surrogate" in msg, msg
    for r in (recs[0], recs[2]):
        assert r["error"] is None and r["response"]["status_code"] == 200


@pytest.mark.parametrize("bad, words", [
    # A lone surrogate escape: valid JSON, but no tokenizer or UTF-8 writer takes it.
    (json.dumps({"id": "b", "prompt": "x\ud800y"}, ensure_ascii=True).encode(), "surrogate"),
    (b'{"id": "b", "prompt": "caf\xe9"}', "not UTF-8"),
])
def test_a_bad_native_line_fails_alone(tmp_path, model_args, bad, words):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_native(id="a", prompt="hello", max_tokens=2).encode() + b"\n" + bad
                    + b"\n" + _native(id="c", prompt="hi", max_tokens=2).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = {r["id"]: r for r in _read(out)}
    assert set(recs) == {"a", "2", "c"}
    msg = recs["2"]["error"]
    assert "line 2" in msg and words in msg, msg
    assert "outputs" in recs["a"] and "outputs" in recs["c"]


def test_non_utf8_line_of_openai_batch_fails_alone(tmp_path, model_args):
    inp = tmp_path / "batch.jsonl"
    inp.write_bytes(_chat("a", "hello", max_tokens=2).encode() + b"\n"
                    + _chat("b", "caf_", max_tokens=2).encode().replace(b"caf_", b"caf\xe9")
                    + b"\n" + _chat("c", "hi", max_tokens=2).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["a", None, "c"]
    msg = recs[1]["error"]["message"]
    assert "line 2" in msg and "not UTF-8" in msg, msg
    assert [r["response"]["status_code"] for r in (recs[0], recs[2])] == [200, 200]


# ----------------------------------------------------------------- 5. format detection
def test_openai_format_is_detected_past_a_malformed_first_line(tmp_path, model_args):
    inp = _write_lines(tmp_path / "batch.jsonl", ["{bad", _chat("a", "hello", max_tokens=2),
                                                  _chat("b", "hi", max_tokens=2)])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = _read(out)
    assert len(recs) == 3
    assert recs[0]["custom_id"] is None and recs[0]["response"] is None
    msg = recs[0]["error"]["message"]
    assert "line 1" in msg and "malformed JSON" in msg, msg
    assert [r["custom_id"] for r in recs[1:]] == ["a", "b"]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in recs[1:])


# ----------------------------------------------------------------- 6. duplicate custom_id
def test_duplicate_of_an_invalid_line_also_fails(tmp_path, model_args):
    inp = _write_lines(tmp_path / "batch.jsonl", [
        _chat("dup", "hello", max_tokens=2,
              tools=[{"type": "function", "function": {"name": "f"}}]),
        _chat("dup", "hello again", max_tokens=2),
        _chat("ok", "hi", max_tokens=2),
    ])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["dup", "dup", "ok"]
    assert "body.tools" in recs[0]["error"]["message"]
    assert "duplicate custom_id" in recs[1]["error"]["message"], recs[1]
    assert not [r for r in recs if r["custom_id"] == "dup" and r["response"] is not None]
    assert recs[2]["response"]["status_code"] == 200


# ----------------------------------------------------------------- 7. no-op values
def test_no_op_values_of_unsupported_fields_are_accepted(tmp_path, model_args):
    chat = _chat("c", "hello", max_tokens=2, tools=[], logit_bias={}, best_of=1)
    cmpl = _line("p", COMPLETIONS_URL, prompt="hello", max_tokens=2, echo=False,
                 logit_bias={}, best_of=1)
    for text in (chat, cmpl):
        rec = parse_openai_line(text, 1)
        assert rec.error is None, rec.error
        assert rec.overrides == {"max_tokens": 2}
    # A value that asks for something still fails, naming the field.
    for url, extra, field in (
            (CHAT_URL, {"tools": [{"type": "function", "function": {"name": "f"}}]},
             "body.tools"),
            (CHAT_URL, {"best_of": 2}, "body.best_of"),
            (CHAT_URL, {"echo": True}, "body.echo"),
            (COMPLETIONS_URL, {"echo": "yes"}, "body.echo"),
            (COMPLETIONS_URL, {"best_of": 2}, "body.best_of")):
        content = ({"messages": [{"role": "user", "content": "x"}]} if url == CHAT_URL
                   else {"prompt": "x"})
        rec = parse_openai_line(_line("x", url, **content, **extra), 4)
        assert rec.error is not None and field in rec.error and "line 4" in rec.error, (
            field, rec.error)

    inp = _write_lines(tmp_path / "batch.jsonl", [chat, cmpl])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["c", "p"]
    assert [r["response"]["status_code"] for r in recs] == [200, 200]
    assert recs[0]["response"]["body"]["object"] == "chat.completion"
    assert recs[1]["response"]["body"]["object"] == "text_completion"


# ----------------------------------------------------------------- 8. OpenAI logprobs
def test_openai_logprob_limits_and_shapes(tmp_path, model_args):
    ok20 = parse_openai_line(_chat("a", "x", logprobs=True, top_logprobs=20), 1)
    assert ok20.error is None and ok20.overrides["logprobs"] == 20
    ok_cmpl = parse_openai_line(_line("b", COMPLETIONS_URL, prompt="x", logprobs=20), 1)
    assert ok_cmpl.error is None and ok_cmpl.overrides["logprobs"] == 20

    inp = _write_lines(tmp_path / "batch.jsonl", [
        _chat("top21", "hello", logprobs=True, top_logprobs=21, max_tokens=2),
        _line("cmpl21", COMPLETIONS_URL, prompt="hello", logprobs=21, max_tokens=2),
        _chat("plain", "hello", logprobs=True, max_tokens=4),
        _chat("top2", "once upon", logprobs=True, top_logprobs=2, temperature=1.0, seed=1,
              max_tokens=6),
    ])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = {r["custom_id"]: r for r in _read(out)}
    assert set(recs) == {"top21", "cmpl21", "plain", "top2"}
    msg = recs["top21"]["error"]["message"]
    assert "body.top_logprobs" in msg and "20" in msg, msg
    assert "body.logprobs" in recs["cmpl21"]["error"]["message"], recs["cmpl21"]

    def content(cid) -> list[dict]:
        r = recs[cid]
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        entries = body["choices"][0]["logprobs"]["content"]
        assert len(entries) == body["usage"]["completion_tokens"] > 0
        return entries

    for entry in content("plain"):
        assert entry["top_logprobs"] == [], entry
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
        assert entry["logprob"] <= 0.0
    for entry in content("top2"):
        assert len(entry["top_logprobs"]) == 2, entry
        assert all(bytes(t["bytes"]).decode("utf-8", errors="replace") == t["token"]
                   for t in entry["top_logprobs"])


# ----------------------------------------------------------------- 9. native logprobs
def test_native_logprobs_per_generated_token(tmp_path, model_args):
    inp = _write_lines(tmp_path / "in.jsonl", [
        _native(id="lp", prompt="hello", max_tokens=4, logprobs=2),
        _native(id="plain", prompt="hello", max_tokens=4),
    ])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 0
    recs = {r["id"]: r for r in _read(out)}
    (o,) = recs["lp"]["outputs"]
    lps = o["logprobs"]
    assert isinstance(lps, list) and o["token_ids"]
    assert len(lps) == len(o["token_ids"])
    for tok, d in zip(o["token_ids"], lps):
        assert isinstance(d, dict) and 2 <= len(d) <= 3, d  # top 2 and the sampled one
        assert str(tok) in d, (tok, d)
        for k, v in d.items():
            assert k.isdigit() and isinstance(v, float) and v <= 0.0, (k, v)
    assert "logprobs" not in recs["plain"]["outputs"][0]


# ----------------------------------------------------------------- 10. native ids
def test_native_id_null_object_and_integer(tmp_path, model_args):
    assert parse_jsonl_line('{"id": null, "prompt": "x"}', 5).id == "5"
    rec = parse_jsonl_line('{"id": {"a": 1}, "prompt": "x"}', 6)
    assert rec.error is not None and "'id'" in rec.error
    assert "must be a string or an integer" in rec.error and "line 6" in rec.error
    rec = parse_jsonl_line('{"id": true, "prompt": "x"}', 7)
    assert rec.error is not None and "'id'" in rec.error
    rec = parse_jsonl_line('{"id": 7, "prompt": "x"}', 8)
    assert rec.error is None and rec.id == "7"

    inp = _write_lines(tmp_path / "in.jsonl", [
        '{"id": null, "prompt": "hello", "max_tokens": 2}',
        '{"id": {"a": 1}, "prompt": "hello", "max_tokens": 2}',
        '{"id": 7, "prompt": "hi", "max_tokens": 2}',
    ])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, model_args) == 1
    recs = {r["id"]: r for r in _read(out)}
    assert set(recs) == {"1", "2", "7"}
    assert "outputs" in recs["1"] and "outputs" in recs["7"]
    msg = recs["2"]["error"]
    assert "'id'" in msg and "must be a string or an integer" in msg, msg


# ----------------------------------------------------------------- 11. output lock
def test_output_lock_refuses_a_second_run(tmp_path, model_args, capsys):
    from deepinfer.jobs.resume import lock_output

    inp = tmp_path / "in.txt"
    inp.write_text("hello world\n")
    out = tmp_path / "out.jsonl"
    held = lock_output(str(out))
    if held is None:
        pytest.skip("no fcntl: outputs are not locked on this platform")
    try:
        assert _run(inp, out, model_args) == 2
        err = capsys.readouterr().err
        assert "another run is writing it" in err and "--output" in err, err
        assert not out.exists()  # the refused run wrote nothing
    finally:
        held.close()
    assert _run(inp, out, model_args) in (0, 1)
    assert [r["id"] for r in _read(out)] == ["1"]
    assert not Path(f"{out}.lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"]
