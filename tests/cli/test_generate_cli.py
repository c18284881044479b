"""``deepinfer-generate``: txt/jsonl input, per-record errors, exit status, resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer.generate import main
from deepinfer.jobs.input_records import read_inputs
from deepinfer.jobs.resume import load_done_ids


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    return ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
            "--no-progress"]


def test_txt_input(tmp_path, model_args):
    inp = tmp_path / "in.txt"
    inp.write_text("the quick brown fox\n\nhello world\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 0
    recs = {r["id"]: r for r in _records(out)}
    assert set(recs) == {"1", "3"}  # ids are line numbers; blank lines are skipped
    for r in recs.values():
        (o,) = r["outputs"]
        assert o["token_ids"] and o["finish_reason"] in ("length", "stop")
        assert isinstance(o["text"], str)


def test_jsonl_errors_are_per_record(tmp_path, model_args):
    inp = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": "hello world", "max_tokens": 3}),
        "{not json",
        json.dumps({"id": "long", "prompt": "the quick brown fox " * 40}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"id": "badtemp", "prompt": "x", "temperature": -2}),
        json.dumps({"id": "n2", "prompt": "once upon", "n": 2, "temperature": 1.0, "seed": 3}),
    ]
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 1
    recs = {r["id"]: r for r in _records(out)}
    assert set(recs) == {"a", "2", "long", "chat", "badtemp", "n2"}
    assert "malformed JSON" in recs["2"]["error"]
    assert "long" in recs["long"]["error"] and "max_model_len" in recs["long"]["error"]
    assert "temperature" in recs["badtemp"]["error"]
    assert len(recs["a"]["outputs"][0]["token_ids"]) <= 3
    assert len(recs["n2"]["outputs"]) == 2
    assert "outputs" in recs["chat"]


def test_resume_after_partial_output(tmp_path, model_args):
    inp = tmp_path / "in.txt"
    prompts = [f"prompt number {i} says hello" for i in range(6)]
    inp.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 0
    full = _records(out)
    # A killed run: two whole records, then a torn one.
    with open(out, "w") as f:
        for r in full[:2]:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps(full[2])[:15])
    assert load_done_ids(str(out)) == {full[0]["id"], full[1]["id"]}
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 0
    again = _records(out)
    assert sorted(r["id"] for r in again) == sorted(str(i) for i in range(1, 7))
    assert again[:2] == full[:2]
    # Greedy: the resumed records equal the first run's.
    assert {r["id"]: r for r in again} == {r["id"]: r for r in full}
    # Nothing left to do: a third run changes nothing and exits 0.
    assert main(["--input", str(inp), "--output", str(out), *model_args]) == 0
    assert _records(out) == again


def test_bad_input_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        list(read_inputs(str(tmp_path / "nope.txt")))
    bad = tmp_path / "in.csv"
    bad.write_text("x\n")
    with pytest.raises(ValueError, match="in.csv"):
        list(read_inputs(str(bad)))


def test_module_entry_point(tmp_path, model_args):
    """``python -m deepinfer.generate`` in a real process, with --show."""
    inp = tmp_path / "in.txt"
    inp.write_text("hello world\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output", str(out),
         "--show", *model_args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: 1 requests ok, 0 failed" in proc.stderr
    assert "hello world" in proc.stdout
    assert len(_records(out)) == 1
