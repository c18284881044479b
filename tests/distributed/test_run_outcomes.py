"""What a multi-rank ``deepinfer-generate`` run reports matches a one-engine run: a result
that cannot be written as JSON fails (``--dp``, ``--pd``), ``--pd`` on an OpenAI batch
file (``--show``, a rerun that only rewrites error lines), a clean end without
leaked-semaphore warnings, Ctrl-C; and which rank errors count as a lost peer."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from deepinfer.distributed.ranks import RankFailedError, RankInfo, free_port, run_in_group
from deepinfer.generate import main
from deepinfer.jobs.parts import list_part_files
from tests.distributed.run_files import (
    ENV,
    ROOT,
    children,
    long_run_input,
    wait_for_record,
    write_jsonl,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

ARGS = ["--device", "cpu", "--max-tokens", "6", "--kv-cache-memory", str(8 << 20),
        "--max-model-len", "64", "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama_tied"].path


@pytest.fixture(scope="module")
def nan_model(tiny, tmp_path_factory) -> str:
    """The tiny checkpoint with a NaN final norm: every logprob is NaN, so each result
    line is refused by ``write_record`` and written as an internal_error line."""
    path = tmp_path_factory.mktemp("nan_model") / "m"
    shutil.copytree(tiny, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"].fill_(float("nan"))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _openai_line(cid: str, **body) -> dict:
    body.setdefault("temperature", 0.0)  # OpenAI's default is 1: sampled
    chat = "messages" in body
    return {"custom_id": cid, "method": "POST",
            "url": "/v1/chat/completions" if chat else "/v1/completions", "body": body}


def _done(err: str) -> str:
    """The ``N requests ok, M failed`` part of a run's summary line."""
    match = re.search(r"done: \d+ requests ok, \d+ failed", err)
    assert match, err
    return match.group(0)


def _error_codes(path) -> list:
    return [(json.loads(x)["error"] or {}).get("code") for x in path.read_text().splitlines()]


def test_unwritable_results_fail_as_with_one_engine(tmp_path, nan_model, capfd):
    """--dp 2 (a fresh launcher process: its stderr also shows the resource tracker's
    report at exit) and --pd 1:1 count the internal_error lines as failed and exit 1."""
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [_openai_line(c, prompt=f"hello {c}", max_tokens=3, logprobs=1)
                      for c in "ab"])
    model = ["--model", nan_model, *ARGS]
    one = tmp_path / "one.jsonl"
    capfd.readouterr()
    rc_one = main(["--input", str(inp), "--output", str(one), *model])
    want = _done(capfd.readouterr().err)
    assert (rc_one, want) == (1, "done: 0 requests ok, 2 failed")
    assert _error_codes(one) == ["internal_error"] * 2

    dp = tmp_path / "dp.jsonl"
    proc = subprocess.run([sys.executable, "-m", "deepinfer.generate", "--input", str(inp),
                           "--output", str(dp), "--dp", "2", *model], env=ENV, cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=180)
    assert (proc.returncode, _done(proc.stderr)) == (1, want), proc.stderr
    assert "leaked semaphore" not in proc.stderr, proc.stderr  # ranks end via os._exit
    assert _error_codes(dp) == ["internal_error"] * 2

    pd = tmp_path / "pd.jsonl"
    rc = main(["--input", str(inp), "--output", str(pd), "--pd", "1:1", *model])
    assert (rc, _done(capfd.readouterr().err)) == (1, want)
    assert _error_codes(pd) == ["internal_error"] * 2


def test_pd_openai_show_and_error_only_rerun(tmp_path, tiny, capfd):
    """--pd --show prints an OpenAI file's results as one engine does; a rerun whose only
    pending lines are error lines (rewritten on every resume) keeps input order."""
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [
        {"custom_id": "bad", "method": "POST", "url": "/v1/bogus", "body": {"prompt": "x"}},
        _openai_line("b", prompt="hello world", max_tokens=3),
        _openai_line("c", messages=[{"role": "user", "content": "hi"}], max_tokens=3),
    ])
    model = ["--model", tiny, *ARGS, "--show"]
    capfd.readouterr()
    assert main(["--input", str(inp), "--output", str(tmp_path / "one.jsonl"), *model]) == 1
    shown_one = capfd.readouterr().out.splitlines()
    out = tmp_path / "pd.jsonl"
    assert main(["--input", str(inp), "--output", str(out), "--pd", "1:1", *model]) == 1
    shown_pd = capfd.readouterr().out.splitlines()
    assert len(shown_one) == 4  # two results, two lines each
    assert sorted(shown_pd) == sorted(shown_one)
    ids = ["batch_line_1", "batch_req_b", "batch_req_c"]
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ids
    results = out.read_text().splitlines()[1:]
    assert main(["--input", str(inp), "--output", str(out), "--pd", "1:1", *model]) == 1
    lines = out.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ids
    assert lines[1:] == results  # kept byte for byte
    assert list_part_files(str(out)) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_the_ranks_with_one_line(tmp_path, tiny):
    """SIGINT to a --dp 2 launcher (Ctrl-C): one line, exit 130, no traceback, the ranks
    are stopped."""
    inp = long_run_input(tmp_path)
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output",
            str(out), "--dp", "2", "--model", tiny, *ARGS, "--max-model-len", "256",
            "--max-num-seqs", "1"]
    launcher = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_for_record(tmp_path / "out.jsonl.part0", [launcher])
        ranks = children(launcher.pid)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, err
    assert "interrupted: rerun the same command to resume" in err
    assert "Traceback" not in err, err
    assert ranks and not any(os.path.exists(f"/proc/{pid}") for pid in ranks)


# ------------------------------------------------------------ which errors are a lost peer
def _broadcast_from_missing_rank() -> None:
    # gloo refuses it with a plain RuntimeError raised through torch.distributed, as it
    # reports a peer that closed its connection.
    dist.broadcast(torch.zeros(1), src=1)


def _raise(error: Exception):
    def body() -> None:
        raise error
    return body


@pytest.fixture
def one_rank(monkeypatch) -> RankInfo:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps this process's thread count
    return RankInfo(0, 1, 0, 1)


@pytest.mark.parametrize("body", [
    _broadcast_from_missing_rank,
    _raise(dist.DistNetworkError("connection reset")),
], ids=["gloo-runtime-error", "dist-error-type"])
def test_collective_errors_become_rank_failed(one_rank, body):
    with pytest.raises(RankFailedError, match="rank 0: a collective failed"):
        run_in_group(one_rank, "cpu", 30.0, body)
    assert not dist.is_initialized()


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    torch.cuda.OutOfMemoryError("CUDA out of memory"),
    KeyError("a bug"),
], ids=["runtime-error", "oom", "key-error"])
def test_own_errors_are_raised_as_they_are(one_rank, error):
    """Not blamed on another rank: the rank exits 1 with its own traceback."""
    with pytest.raises(type(error)) as info:
        run_in_group(one_rank, "cpu", 30.0, _raise(error))
    assert info.value is error and not isinstance(info.value, RankFailedError)
    assert info.traceback[-1].name == "body"  # where it was raised
    assert not dist.is_initialized()
