"""``deepinfer-generate --pd 1:1`` (spawned PROMPT + COMPLETION processes over gloo):
greedy records equal a one-engine run's, per-record errors (n > 1 among them), resume
from a killed run's output and leftover part files, bad flag combinations."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

from deepinfer.generate import main
from deepinfer.jobs.parts import list_part_files
from tests.distributed.test_dp_generate import _torchrun_style

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

LONG = "the quick brown fox jumps over the lazy dog"  # 33 tokens: 3 blocks of 16


@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    return ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
            "--no-progress"]


def _by_id(path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in recs}) == len(recs), "one record per id"
    return {r["id"]: r for r in recs}


def test_pd_matches_one_engine_with_error_records(tmp_path, model_args, capfd):
    records = [
        {"id": "long", "prompt": LONG, "max_tokens": 8, "ignore_eos": True},
        {"id": "short", "prompt": "hello world"},
        "{not json",
        {"id": "chat", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "first", "prompt": "once upon a time", "max_tokens": 1},  # ends on PROMPT
        {"id": "toolong", "prompt": LONG * 4},
        {"id": "badtemp", "prompt": "x", "temperature": -2},
        {"id": "n2", "prompt": "once upon", "n": 2, "temperature": 1.0, "seed": 3},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                           for r in records))
    one, pd = tmp_path / "one.jsonl", tmp_path / "pd.jsonl"
    assert main(["--input", str(inp), "--output", str(one), *model_args]) == 1
    capfd.readouterr()
    rc = main(["--input", str(inp), "--output", str(pd), "--pd", "1:1", *model_args])
    err = capfd.readouterr().err
    assert rc == 1, err
    assert "done: 4 requests ok, 4 failed" in err, err
    assert "1 prompt + 1 completion ranks, 3 sequences handed off" in err, err
    want, got = _by_id(one), _by_id(pd)
    ids = ["long", "short", "3", "chat", "first", "toolong", "badtemp", "n2"]
    assert list(got) == ids  # merged in input order
    for rid in ("long", "short", "chat", "first"):
        assert got[rid] == want[rid], rid
    assert len(got["long"]["outputs"][0]["token_ids"]) == 8
    for rid in ("3", "toolong", "badtemp"):
        assert "error" in want[rid] and "error" in got[rid], rid
    assert "temperature" in got["badtemp"]["error"]
    assert "outputs" in want["n2"] and "n=2" in got["n2"]["error"]
    assert list_part_files(str(pd)) == []


def test_pd_streams_its_input_within_the_bound(tmp_path, model_args, capfd):
    """``--pd 1:1 --max-in-flight 3``: the PROMPT rank reads its records lazily and never
    holds more than 3 (waiting, prefilling or waiting for a hand-off); each hand-off lets
    another in. The records equal a one-engine run's."""
    inp = tmp_path / "in.txt"
    inp.write_text("".join(f"record {i} of a stream\n" for i in range(14)))
    one, pd = tmp_path / "one.jsonl", tmp_path / "pd.jsonl"
    assert main(["--input", str(inp), "--output", str(one), *model_args]) == 0
    capfd.readouterr()
    assert main(["--input", str(inp), "--output", str(pd), "--pd", "1:1",
                 "--max-in-flight", "3", *model_args]) == 0
    err = capfd.readouterr().err
    assert "done: 14 requests ok, 0 failed" in err, err
    assert "14 sequences handed off" in err, err
    held = int(re.search(r"at most (\d+) requests held by a prompt rank", err)[1])
    assert 1 <= held <= 3, err
    assert _by_id(pd) == _by_id(one)


def test_pd_resumes_partial_output_and_parts(tmp_path, model_args):
    prompts = [LONG, "hello world", "once upon a time", "paged attention", "a b c d e",
               "lazy dog"]
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(prompts) + "\n")
    one = tmp_path / "one.jsonl"
    assert main(["--input", str(inp), "--output", str(one), *model_args]) == 0
    want = _by_id(one)
    line = {rid: json.dumps(rec) for rid, rec in want.items()}
    # A killed run: two whole records and a torn one in the output, one whole record
    # and a torn one in a leftover part file.
    out = tmp_path / "pd.jsonl"
    out.write_text(line["2"] + "\n" + line["1"] + "\n" + line["3"][:25])
    (tmp_path / "pd.jsonl.part1").write_text(line["5"] + "\n" + line["6"][:10])
    assert main(["--input", str(inp), "--output", str(out), "--pd", "1:1",
                 *model_args]) == 0
    got = _by_id(out)
    assert list(got) == [str(i) for i in range(1, 7)]
    assert got == want
    assert list_part_files(str(out)) == []
    # Nothing left: a rerun changes nothing.
    before = out.read_text()
    assert main(["--input", str(inp), "--output", str(out), "--pd", "1:1",
                 *model_args]) == 0
    assert out.read_text() == before


def test_pd_torchrun_style_launch(tmp_path, model_args):
    """Two processes started with the torchrun variables (no spawning): rank 0 resumes
    the output, the PROMPT rank writes the error records of the lines it reads, both
    join the PD rounds."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": LONG}, {"id": "b", "prompt": "hello world"},
        {"id": "c", "prompt": "once upon", "n": 2}, {"id": "d", "prompt": "lazy dog"}]))
    one = tmp_path / "one.jsonl"
    assert main(["--input", str(inp), "--output", str(one), *model_args]) == 0
    want = _by_id(one)
    out = tmp_path / "pd.jsonl"
    out.write_text(json.dumps(want["b"]) + "\n")
    procs = _torchrun_style(2, ["--input", str(inp), "--output", str(out), "--pd", "1:1",
                                *model_args], tmp_path)
    codes = [p.wait(timeout=120) for p in procs]
    log0 = (tmp_path / "rank0.log").read_text()
    assert codes == [1, 1], log0  # the n=2 record failed: every rank says so
    assert "resuming: 1 of 4 records" in log0 and "done: 2 requests ok, 1 failed" in log0
    got = _by_id(out)
    assert list(got) == ["a", "b", "c", "d"]
    assert {k: got[k] for k in "abd"} == {k: want[k] for k in "abd"}
    assert "n=2" in got["c"]["error"]
    assert list_part_files(str(out)) == []


def test_pd_world_size_mismatch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    inp = tmp_path / "in.txt"
    inp.write_text("hello\n")
    assert main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                 "--pd", "1:1"]) == 2
    assert "needs WORLD_SIZE=2" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--pd", "1:1", "--dp", "2"], "cannot be combined"),
    (["--pd", "2"], "expected P:D"),
    (["--pd", "0:1"], "at least one"),
])
def test_pd_bad_flags(tmp_path, capsys, extra, message):
    inp = tmp_path / "in.txt"
    inp.write_text("hello\n")
    assert main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_pd_runs_constrained_requests(tmp_path, model_args, capfd):
    """A constrained request waits for its grammar in the PROMPT engine (not in its
    scheduler) and is still prefilled, handed off and finished: the records equal a
    one-engine run's, its output obeys its constraint."""
    records = [
        {"id": "choice", "prompt": "hello world", "structured_outputs":
            {"choice": ["left", "right"]}},
        {"id": "plain", "prompt": "once upon a time"},
        {"id": "regex", "prompt": LONG, "max_tokens": 8, "temperature": 1.0, "seed": 5,
         "structured_outputs": {"regex": "[a-e]{6,9}"}},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    one, pd = tmp_path / "one.jsonl", tmp_path / "pd.jsonl"
    assert main(["--input", str(inp), "--output", str(one), *model_args]) == 0
    capfd.readouterr()
    rc = main(["--input", str(inp), "--output", str(pd), "--pd", "1:1", *model_args])
    err = capfd.readouterr().err
    assert rc == 0, err
    assert "done: 3 requests ok, 0 failed" in err, err
    want, got = _by_id(one), _by_id(pd)
    assert list(got) == ["choice", "plain", "regex"]
    assert got == want
    assert got["choice"]["outputs"][0]["text"] in ("left", "right")
    assert got["choice"]["outputs"][0]["finish_reason"] == "stop"


def test_pd_gpu_count_is_per_node_under_torchrun(tmp_path, monkeypatch, capsys,
                                                 tiny_checkpoints):
    """Node 0 of `torchrun --nnodes 2 --nproc-per-node 8 ... --pd 8:8` has 8 GPUs: enough
    (each rank checks its own GPU); spawned here, 16 ranks need 16 GPUs on this node."""
    import deepinfer.cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    launched = []
    monkeypatch.setattr(deepinfer.cli, "launch",
                        lambda fn, world, fn_args: launched.append(world) or 0)
    inp = tmp_path / "in.txt"
    inp.write_text("hello\n")
    argv = ["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--model",
            tiny_checkpoints["llama_tied"].path, "--device", "cuda", "--pd", "8:8"]
    assert main(argv) == 2
    assert "--pd 8:8 needs 16 GPUs, 8 visible" in capsys.readouterr().err
    for k, v in {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 0, capsys.readouterr().err
    assert launched == [16]
