"""Ray's cost per replica: ``deepinfer-generate --ray --replicas N`` against N bare
``deepinfer-generate`` processes, each over 1/N of the same records, every engine on one
thread (``OMP_NUM_THREADS=1``), same run. Reported per configuration: wall seconds from
the command's start to its end (model loading and Ray's start included), output tok/s
over that, Ray's overhead (Ray wall / bare wall - 1) and the seconds to the first record
on disk (Ray writes a block's records when the block is done).

A random 1-layer SmolLM2-shaped model (float32), short prompts, ``max_tokens`` 16.

    python benchmarks/bench_ray.py [--records 4000] [--save] [--out DIR]

Results: ``ray-cpu.{json,md}`` in ``--out`` / ``$DEEPINFER_BENCH_OUT``, or
benchmarks/results with ``--save`` / ``DEEPINFER_BENCH_SAVE=1``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from bench_moe import out_dir, write  # noqa: E402
from results_meta import git_commit, header_lines, table_lines, utc_now  # noqa: E402

from deepinfer.testing.random_model import make_random_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "ray"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _argv(model: str, inp: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output",
            str(out), "--model", model, "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(32 << 20), "--max-model-len", "128", "--no-progress"]


def _tokens(paths: list[str]) -> int:
    n = 0
    for path in paths:
        with open(path) as f:
            for line in f:
                n += sum(len(o["token_ids"]) for o in json.loads(line).get("outputs", ()))
    return n


def _run(procs_argv: list[list[str]], first_record: callable) -> tuple[float, float]:
    """Start the commands, wait for all; (wall seconds, seconds to the first record)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(a, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for a in procs_argv]
    first = None
    while any(p.poll() is None for p in procs):
        if first is None and first_record():
            first = time.perf_counter() - t0
        time.sleep(0.05)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a run failed: {[p.returncode for p in procs]}")
    wall = time.perf_counter() - t0
    return wall, first if first is not None else wall


def run(records: int, replicas: tuple[int, ...] = (1, 2)) -> tuple[dict, list[dict]]:
    work = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    model = str(work / "model")
    make_random_checkpoint(model, "smollm2-135m", num_layers=1)
    rows = []
    for n in replicas:
        parts = []
        for k in range(n):
            part = work / f"in{n}-{k}.jsonl"
            part.write_text("".join(
                json.dumps({"id": f"r{i}", "prompt": f"record {i} of the batch",
                            "max_tokens": 16, "ignore_eos": True}) + "\n"
                for i in range(k, records, n)))
            parts.append(part)
        outs = [work / f"bare{n}-{k}.jsonl" for k in range(n)]
        bare_wall, bare_first = _run(
            [_argv(model, p, o) for p, o in zip(parts, outs)],
            lambda outs=outs: any(o.exists() and o.stat().st_size for o in outs))
        full = work / f"in{n}.jsonl"
        full.write_text("".join(p.read_text() for p in parts))
        ray_out = work / f"ray{n}.jsonl"
        ray_wall, ray_first = _run(
            [_argv(model, full, ray_out) + ["--ray", "--replicas", str(n)]],
            lambda: bool(glob.glob(str(work / ".deepinfer-ray-*" / "out" / "*.json"))))
        tokens = _tokens([str(o) for o in outs])
        assert tokens == _tokens([str(ray_out)]) == records * 16
        rows.append({"replicas": n, "records": records, "tokens": tokens,
                     "bare_s": round(bare_wall, 1), "ray_s": round(ray_wall, 1),
                     "bare_tok_s": round(tokens / bare_wall, 1),
                     "ray_tok_s": round(tokens / ray_wall, 1),
                     "overhead": round(ray_wall / bare_wall - 1, 3),
                     "bare_first_record_s": round(bare_first, 1),
                     "ray_first_record_s": round(ray_first, 1)})
        print(rows[-1], file=sys.stderr)
    import ray

    meta = {"device": "cpu", "commit": git_commit(), "date": utc_now(), "torch": "-",
            "triton": "-", "ray": ray.__version__, "cores": os.cpu_count()}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["replicas", "records", "tokens", "bare_s", "ray_s", "bare_tok_s", "ray_tok_s",
            "overhead", "bare_first_record_s", "ray_first_record_s"]
    lines = header_lines("Ray replicas against bare engines", meta,
                         f"Ray {meta['ray']}, {meta['cores']} cores, one thread an engine")
    lines += ["bare = N deepinfer-generate processes over 1/N of the records each; ray = "
              "deepinfer-generate --ray --replicas N over all of them; walls include model "
              "loading (and Ray's start); overhead = ray_s / bare_s - 1 (a fixed start-up "
              "cost shrinks with more records).", ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--save", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    meta, rows = run(args.records)
    print(markdown(meta, rows))
    dest = out_dir(args.save, args.out)
    if dest is not None:
        print(f"written: {write(meta, rows, dest, PREFIX, markdown)}")
    return 0


@pytest.mark.skipif(os.environ.get("DEEPINFER_BENCH_RAY") != "1",
                    reason="starts a Ray cluster (a minute on 2 cores): "
                    "DEEPINFER_BENCH_RAY=1 runs it; tests/jobs/test_ray_job.py covers --ray")
def test_bench_ray(tmp_path):
    """Smoke test (no timing assertions): one replica each way, a few records."""
    pytest.importorskip("ray")
    meta, rows = run(8, replicas=(1,))
    assert rows[0]["tokens"] == 8 * 16
    path = write(meta, rows, out_dir(False, None) or tmp_path, PREFIX, markdown)
    print("\n" + path.read_text())


if __name__ == "__main__":
    sys.exit(main())
