"""Memory of a batch job against the size of its input: peak RSS of ``deepinfer-generate``
over 10k and 200k short lines (a tiny random model, ``max_tokens`` 1-2), and the bytes
each extra line costs. A streamed job reads its input lazily and holds at most
``--max-in-flight`` requests, so what still grows is the id index (``jobs.input_index``)
and the resume set: a small, fixed number of bytes a line.

``--ref REV`` runs the same inputs through the CLI of an earlier commit (a git worktree),
for the design it replaced (the whole file read and submitted at once).

float32: a bfloat16 model's oneDNN kernels cache one primitive per batch shape (up to
1024 of them), which grows the RSS of a long run by a few hundred MB whatever the input
size; float32 keeps that out of the per-line figure.

    python benchmarks/bench_streaming.py [--lines 10000 200000] [--ref REV] [--save]

Results: ``streaming-cpu.{json,md}`` in ``--out`` / ``$DEEPINFER_BENCH_OUT``, or
benchmarks/results with ``--save`` / ``DEEPINFER_BENCH_SAVE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_moe import out_dir, write  # noqa: E402
from results_meta import git_commit, header_lines, table_lines, utc_now  # noqa: E402

from deepinfer.testing.random_model import make_random_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "streaming"


def write_input(path: Path, lines: int) -> None:
    with open(path, "w") as f:
        for i in range(lines):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"line {i} of the input",
                                "max_tokens": 1 + i % 2}) + "\n")


def run_job(src: Path, model: str, inp: Path, work: Path) -> dict:
    """One CLI run in a fresh process; its peak RSS (``wait4``) and wall time."""
    out = work / f"out-{inp.stem}-{src.name}.jsonl"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output",
            str(out), "--model", model, "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(8 << 20), "--max-model-len", "64", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=src, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    if status != 0:
        raise RuntimeError(f"{src}: the run failed:\n{err[-2000:]}")
    records = sum(1 for _ in open(out))
    return {"peak_rss_MB": round(usage.ru_maxrss / 1024, 1),
            "seconds": round(time.perf_counter() - t0, 1), "records": records}


def run(lines: list[int], ref: str | None) -> tuple[dict, list[dict]]:
    work = Path(tempfile.mkdtemp(prefix="bench_streaming_"))
    model = str(work / "tiny")
    make_random_checkpoint(model, "smollm2-135m", num_layers=1)
    sources = [("this commit", ROOT)]
    if ref:
        tree = work / "ref"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                        ref], check=True, capture_output=True)
        sources.append((f"ref {ref}", tree))
    rows = []
    try:
        for n in lines:
            inp = work / f"in{n}.jsonl"
            write_input(inp, n)
            for name, src in sources:
                rows.append({"code": name, "lines": n, **run_job(src, model, inp, work)})
                print(rows[-1], file=sys.stderr)
    finally:
        if ref:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(work / "ref")], check=False)
    for name, _ in sources:
        mine = [r for r in rows if r["code"] == name]
        lo, hi = mine[0], mine[-1]
        per_line = (hi["peak_rss_MB"] - lo["peak_rss_MB"]) * 2**20 / max(
            hi["lines"] - lo["lines"], 1)
        for r in mine:
            r["bytes_per_extra_line"] = round(per_line)
    meta = {"device": "cpu", "commit": git_commit(), "date": utc_now(),
            "torch": "-", "triton": "-", "ref": ref or "-"}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["code", "lines", "records", "peak_rss_MB", "seconds", "bytes_per_extra_line"]
    lines = header_lines("Batch job memory against input size", meta,
                         "deepinfer-generate, a random 1-layer SmolLM2-shaped model, "
                         "max_tokens 1-2")
    lines += ["peak_rss_MB: the job process's peak resident set (wait4); "
              "bytes_per_extra_line: (peak at the largest input - peak at the smallest) / "
              "(extra lines).", ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, nargs="+", default=[10_000, 200_000])
    p.add_argument("--ref", default=None, help="also run this commit's CLI")
    p.add_argument("--save", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    meta, rows = run(sorted(args.lines), args.ref)
    print(markdown(meta, rows))
    dest = out_dir(args.save, args.out)
    if dest is not None:
        print(f"written: {write(meta, rows, dest, PREFIX, markdown)}")
    return 0


def test_bench_streaming(tmp_path):
    """Smoke test (no timing or memory assertions): two small inputs run to the end."""
    meta, rows = run([20, 60], None)
    assert [r["records"] for r in rows] == [20, 60]
    path = write(meta, rows, out_dir(False, None) or tmp_path, PREFIX, markdown)
    print("\n" + path.read_text())


if __name__ == "__main__":
    sys.exit(main())
