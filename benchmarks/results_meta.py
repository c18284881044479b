"""What benchmark results files share: provenance (commit, UTC date) and the markdown
table of their rows."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def git_commit() -> str:
    """Short hash of HEAD, or ``$GIT_COMMIT`` / "unknown" outside a checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GIT_COMMIT", "unknown")


def vector_isa() -> str:
    """The CPU's widest vector instructions that the native kernels use, from
    /proc/cpuinfo ("AVX512-VNNI+BF16", "AVX512-VNNI", "AVX2" or "no AVX2"): results
    from different classes are not comparable, and their files say which."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f
                          if line.startswith("flags")), set())
    except OSError:
        flags = set()
    if "avx512_vnni" in flags:
        return "AVX512-VNNI+BF16" if "avx512_bf16" in flags else "AVX512-VNNI"
    return "AVX2" if "avx2" in flags else "no AVX2"


def utc_now() -> str:
    """ISO 8601 UTC timestamp, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def table_lines(cols: list[str], rows: list[dict]) -> list[str]:
    """A markdown table: header, rule, one line per row (a missing value left empty)."""
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows])


def header_lines(title: str, meta: dict, detail: str) -> list[str]:
    """A results file's title and provenance line (device, commit, date, torch and
    triton versions from ``meta``), then ``detail``."""
    return [f"# {title}: {meta['device']}", "",
            f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, triton "
            f"{meta['triton']}, {detail}.", ""]


def interleaved_medians_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Each call's median wall time in ms over ``reps`` rounds that run every call once in
    turn (after one untimed warm-up each, for first-call costs), so that a busy machine
    slows them alike and their ratios hold."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def save_cpu_table(stem: str, title: str, command: str, rows: list[dict], note: str,
                   reps: int) -> Path:
    """Write ``results/{stem}.json`` (provenance and ``rows``) and ``.md`` (``title`` with
    the machine and threads, provenance, ``command``, the table, ``note``) beside this
    file, for a CPU benchmark run with torch's threads; returns the path without suffix."""
    import torch

    meta = {"commit": git_commit(), "date": utc_now(), "torch": torch.__version__,
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "reps": reps, "rows": rows}
    out = Path(__file__).resolve().parent / "results" / stem
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = [f"# {title} ({meta['machine']}, {meta['threads']} threads)", "",
             f"commit `{meta['commit']}`, {meta['date']}, torch {torch.__version__}, "
             f"`{command}`", "", *table_lines(list(rows[0]), rows), "", note]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out
