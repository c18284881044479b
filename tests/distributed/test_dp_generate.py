"""``deepinfer-generate`` over real gloo DP groups: ``--dp N`` (spawned ranks) and
torchrun-style launches (one process per rank, the torchrun variables set by hand).

Greedy decoding makes every record independent of how the input was split, so the merged
output of N ranks must equal a one-rank run record for record, in input order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from deepinfer.distributed.ranks import EXIT_RANK_FAILED, free_port
from deepinfer.generate import main
from deepinfer.jobs.parts import list_part_files
from tests.distributed.run_files import (
    ENV,
    LONG,
    ROOT,
    check_completed,
    children,
    long_run_input,
    read_lines,
    valid_part_lines,
    wait_for_record,
    write_jsonl,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")



@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    return ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
            "--no-progress"]


def _one_rank(tmp_path, inp, model_args) -> tuple[int, list[str]]:
    out = tmp_path / "one.jsonl"
    rc = main(["--input", str(inp), "--output", str(out), *model_args])
    return rc, read_lines(out)


def _same_records(dp_lines: list[str], one_lines: list[str], input_ids: list[str]) -> None:
    """The same multiset of records; the DP file is in input order."""
    assert sorted(dp_lines) == sorted(one_lines)
    ids = [json.loads(x)["id"] for x in dp_lines]
    assert ids == sorted(ids, key=input_ids.index)


def test_dp2_unequal_loads_and_error_records(tmp_path, model_args, capfd):
    """Round-robin puts every long prompt on rank 0; errors behave as with one rank."""
    records = []
    for i in range(4):
        records.append({"id": f"long{i}", "prompt": LONG, "max_tokens": 8})
        records.append({"id": f"short{i}", "prompt": "hi", "max_tokens": 2})
    records += [
        "{not json",
        {"id": "toolong", "prompt": LONG * 4},
        {"id": "badtemp", "prompt": "x", "temperature": -2},
        {"id": "chat", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "short0", "prompt": "a duplicate id"},
        {"id": "n2", "prompt": "once upon", "n": 2, "temperature": 1.0, "seed": 3},
        # A second repeat: one engine writes two identical error lines, so must the merge.
        {"id": "short0", "prompt": "the same id again"},
    ]
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, records)
    ids = [r["id"] if isinstance(r, dict) else "9" for r in records]
    rc1, one = _one_rank(tmp_path, inp, model_args)
    out = tmp_path / "dp.jsonl"
    capfd.readouterr()
    # Each replica streams its share with at most 2 requests in flight.
    rc = main(["--input", str(inp), "--output", str(out), "--dp", "2", *model_args,
               "--max-in-flight", "2"])
    err = capfd.readouterr().err  # the spawned ranks write to the inherited stderr
    assert (rc1, rc) == (1, 1), err
    assert "done: 10 requests ok, 5 failed" in err, err  # summed over the ranks
    _same_records(read_lines(out), one, ids)
    assert list_part_files(str(out)) == []


def test_dp3_more_ranks_than_prompts(tmp_path, model_args):
    """Rank 2 has nothing to do: it still steps (empty batches) and votes to the end."""
    inp = tmp_path / "in.txt"
    inp.write_text("the quick brown fox\nhello world\n")
    rc1, one = _one_rank(tmp_path, inp, model_args)
    out = tmp_path / "dp.jsonl"
    rc = main(["--input", str(inp), "--output", str(out), "--dp", "3", *model_args])
    assert (rc1, rc) == (0, 0)
    _same_records(read_lines(out), one, ["1", "2"])


def _torchrun_style(world: int, argv: list[str], log_dir: Path) -> list[subprocess.Popen]:
    """What ``torchrun --nproc-per-node world -m deepinfer.generate ...`` starts."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        log = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer.generate", *argv],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        log.close()
    return procs


def test_torchrun_style_launch_resumes_leftovers(tmp_path, model_args):
    """Ranks started with the torchrun variables join one group (no --dp); the run also
    resumes from an earlier output and a killed run's leftover part file."""
    prompts = ["the quick brown fox", "hello world", "once upon a time", "a b c d e",
               "lazy dog", "paged attention"]
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(prompts) + "\n")
    _, one = _one_rank(tmp_path, inp, model_args)
    by_id = {json.loads(x)["id"]: x for x in one}
    out = tmp_path / "dp.jsonl"
    out.write_text(by_id["4"] + "\n")
    (tmp_path / "dp.jsonl.part7").write_text(by_id["2"] + "\n" + by_id["5"][:20])
    procs = _torchrun_style(2, ["--input", str(inp), "--output", str(out), *model_args],
                            tmp_path)
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()
    _same_records(read_lines(out), one, [str(i) for i in range(1, 7)])
    assert "resuming: 2 of 6 records" in (tmp_path / "rank0.log").read_text()
    assert list_part_files(str(out)) == []


LONG_ARGS = ["--max-model-len", "256", "--max-num-seqs", "1", "--dp-timeout", "20"]


def test_torchrun_rank_killed_then_rerun(tmp_path, model_args):
    """SIGKILL rank 1 once it wrote a record: rank 0 fails fast (gloo sees the closed
    peer; at worst --dp-timeout), naming itself; a --dp 1 rerun completes the file."""
    inp = long_run_input(tmp_path)
    out = tmp_path / "out.jsonl"
    procs = _torchrun_style(2, ["--input", str(inp), "--output", str(out), *model_args,
                                *LONG_ARGS], tmp_path)
    try:
        wait_for_record(tmp_path / "out.jsonl.part1", procs)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code0 = procs[0].wait(timeout=40)
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.kill()
            p.wait()
    log0 = (tmp_path / "rank0.log").read_text()
    assert code0 == EXIT_RANK_FAILED, log0
    assert "rank 0: a collective failed" in log0
    kept = valid_part_lines(out)
    assert kept
    assert main(["--input", str(inp), "--output", str(out), *model_args,
                 "--max-model-len", "256"]) == 0
    check_completed(out, kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_spawned_rank_killed_is_named_then_rerun(tmp_path, model_args):
    """``--dp 2``: the launcher names the dead rank and its exit code and stops the
    other; a rerun completes the file."""
    inp = long_run_input(tmp_path)
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output",
            str(out), "--dp", "2", *model_args, *LONG_ARGS]
    launcher = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_for_record(tmp_path / "out.jsonl.part1", [launcher])
        ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=40)
    finally:
        launcher.kill()
    assert launcher.returncode == EXIT_RANK_FAILED, err
    assert "rank 1 exited with code -9 (SIGKILL)" in err
    kept = valid_part_lines(out)
    assert main(["--input", str(inp), "--output", str(out), *model_args,
                 "--max-model-len", "256"]) == 0
    check_completed(out, kept)
