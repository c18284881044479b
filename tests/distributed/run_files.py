"""Files and processes of multi-rank ``deepinfer-generate`` tests: the environment of a
rank, a long-running input whose ranks can be killed mid-run, and checks on the output
and part files afterwards."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from deepinfer.jobs.parts import list_part_files

ROOT = str(Path(__file__).resolve().parents[2])
# Ranks share 2 cores with everything else: one thread each.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LONG = "the quick brown fox jumps over the lazy dog"  # 33 tokens


def read_lines(path) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def write_jsonl(path, records: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))


def long_run_input(tmp_path) -> Path:
    """Each rank gets a quick record first, then long ones (one sequence at a time)."""
    records = []
    for i in range(6):
        quick = i in (0, 1)
        records.append({"id": f"r{i}", "prompt": "hello world" if quick else LONG,
                        "max_tokens": 2 if quick else 150, "ignore_eos": True})
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, records)
    return inp


def wait_for_record(path: Path, procs, deadline_s: float = 90) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if path.exists() and path.read_text().count("\n") >= 1:
            return
        assert all(p.poll() is None for p in procs), "a rank ended before the kill"
        time.sleep(0.02)
    raise AssertionError(f"no record in {path}")


def check_completed(out: Path, expect_kept: list[str]) -> None:
    lines = read_lines(out)
    recs = [json.loads(x) for x in lines]
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(6)]  # one each, in order
    for r in recs:
        assert len(r["outputs"][0]["token_ids"]) == (2 if r["id"] in ("r0", "r1") else 150)
    assert set(expect_kept) <= set(lines)  # what the killed run wrote stays as it was
    assert list_part_files(str(out)) == []


def valid_part_lines(out: Path) -> list[str]:
    kept = []
    for part in list_part_files(str(out)):
        kept += [x for x in Path(part).read_text().split("\n")[:-1]]
    return kept


def children(pid: int) -> list[int]:
    """Child pids of ``pid``, oldest first (spawned ranks start in rank order)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and b"multiprocessing-fork" in cmd \
                and b"resource_tracker" not in cmd:
            kids.append((int(fields[19]), int(entry)))  # (start time, pid)
    return [p for _, p in sorted(kids)]
