"""The compile grid as one table per kernel tile: ``deepinfer_compile_grid.check``'s JSON,
from one or more Triton versions, folded into a row per (kernel, dtype class, configuration).

``check --markdown`` lists every compiled kernel (over a thousand rows for the full grid);
this is the table to read or commit: each row gives, for every Triton version and target,
the register range over the shapes that configuration serves, the worst spill and the
largest shared-memory footprint.

    export PYTHONPATH=tools   # from the checkout: this package is not installed
    python -m deepinfer_compile_grid.check --full --json full-3.9.json     # per Triton version
    python -m deepinfer_compile_grid.report full-3.9.json full-3.6.json --out compile-table.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer_compile_grid.cases import ARCHS, Case, KernelResult


@dataclass
class CompileRun:
    """One ``check --json`` file: the grid compiled under one Triton version."""

    triton: str
    cases: list[Case]
    results: list[KernelResult]
    seconds: float = 0.0

    @classmethod
    def load(cls, path: str | Path) -> CompileRun:
        data = json.loads(Path(path).read_text())
        if "triton" not in data:
            raise ValueError(f"{path}: no 'triton' field: write it with "
                             "`python -m deepinfer_compile_grid.check --json`")
        return cls(data["triton"], [Case(**c) for c in data["cases"]],
                   [KernelResult(**r) for r in data["results"]], data.get("seconds", 0.0))


@dataclass
class _Cell:
    """What one (row, Triton version, target) saw over its cases."""

    regs: list[int] = field(default_factory=list)
    spill: int = 0
    shared: int = 0
    errors: int = 0

    def add(self, r: KernelResult) -> None:
        if r.error:
            self.errors += 1
            return
        self.regs.append(r.regs)
        self.spill = max(self.spill, r.stack + r.local)
        self.shared = max(self.shared, r.shared)

    def regs_text(self) -> str:
        if self.errors:
            return f"{self.errors} errors"
        lo, hi = min(self.regs), max(self.regs)
        return str(lo) if lo == hi else f"{lo}-{hi}"


# Ops whose tiles depend on head_dim: the rows name the head sizes they serve.
_HEAD_DIM_OPS = ("decode", "decode_split", "prefill", "store_kv", "rotary_qk")


def _row_key(case: Case, r: KernelResult) -> tuple[str, str, str]:
    dtype = "fp32" if case.dtype == "fp32" else "16-bit"
    return r.kernel, dtype, r.config


def summary_table(runs: Sequence[CompileRun]) -> str:
    """Markdown: one row per (kernel, 16-bit or fp32, configuration), with for each target
    and Triton version the register range, the largest spill (ptxas stack + local bytes
    per thread) and the largest shared memory per block over the cases it compiled for;
    then each run's totals. A spill where the engine serves that dtype on that target
    (``Case.must_not_spill``) is marked **bold**; fp32 on sm_80 is compiled and reported
    only."""
    if not runs:
        raise ValueError("runs: no compile check results to summarize")
    archs = [a for a in ARCHS if any(c.arch == a for run in runs for c in run.cases)]
    cells: dict[tuple[str, str, str], dict[tuple[int, str], _Cell]] = {}
    ncases: dict[tuple[str, str, str], set[str]] = {}
    tensor_cores: dict[tuple[str, str, str], bool] = {}
    served_spill: dict[tuple[str, str, str], set[tuple[int, str]]] = {}
    head_dims: dict[tuple[str, str, str], set[int]] = {}
    for i, run in enumerate(runs):
        by_id = {c.id: c for c in run.cases}
        for r in run.results:
            case = by_id.get(r.case)
            if case is None or r.kernel == "(plan)":
                continue
            key = _row_key(case, r)
            cells.setdefault(key, {}).setdefault((i, case.arch), _Cell()).add(r)
            ncases.setdefault(key, set()).add(case.id)
            if case.op in _HEAD_DIM_OPS:
                head_dims.setdefault(key, set()).add(case.head_dim)
            tensor_cores[key] = tensor_cores.get(key, False) or r.tensor_cores
            if case.must_not_spill and not r.error and r.stack + r.local > 0:
                served_spill.setdefault(key, set()).add((i, case.arch))
    versions = " / ".join(run.triton for run in runs)
    head = ["kernel", "dtype", "config", "head_dim", "cases"]
    for a in archs:
        head += [f"{a} regs ({versions})", f"{a} spill B", f"{a} shared B"]
    head.append("TC")
    lines = [
        f"Triton {versions}: each cell lists the versions in that order. regs: the range "
        "over the cases that configuration serves; spill: the largest ptxas stack frame + "
        "local bytes per thread (**bold** where the engine serves that dtype on that "
        "target); shared: the largest bytes per block; TC: tensor-core mma in the PTX.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if h.endswith("B") or h == "cases" else "---"
                       for h in head) + "|",
    ]
    for key in sorted(cells):
        kernel, dtype, config = key
        dims = "/".join(str(d) for d in sorted(head_dims.get(key, ()))) or "-"
        row = [f"`{kernel}`", dtype, config or "-", dims, str(len(ncases[key]))]
        for a in archs:
            per_run = [cells[key].get((i, a)) for i in range(len(runs))]
            if not any(per_run):
                row += ["-", "-", "-"]
                continue
            regs, spill, shared = [], [], []
            for i, cell in enumerate(per_run):
                if cell is None:
                    regs.append("-"), spill.append("-"), shared.append("-")
                    continue
                regs.append(cell.regs_text())
                s = str(cell.spill)
                spill.append(f"**{s}**" if (i, a) in served_spill.get(key, ()) else s)
                shared.append(str(cell.shared))
            row += [" / ".join(regs), " / ".join(spill),
                    " / ".join(dict.fromkeys(shared))]  # shared rarely differs: once
        row.append("y" if tensor_cores[key] else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for run in runs:
        errors = sum(1 for r in run.results if r.error)
        lines.append(f"- Triton {run.triton}: {len(run.cases)} cases, {len(run.results)} "
                     f"kernels compiled in {run.seconds:.0f} s, {errors} errors.")
    bad = sorted(k for k, v in served_spill.items() if v)
    named = ", ".join(f"`{k[0]}` {k[1]} {k[2]}" for k in bad)
    lines.append(f"- Configurations that spill where the engine serves their dtype: "
                 f"{len(bad)}{': ' + named if bad else ''}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="check --json files, one per "
                                                "Triton version")
    parser.add_argument("--out", help="write the table here (default: stdout)")
    args = parser.parse_args(argv)
    runs = [CompileRun.load(p) for p in args.json]
    table = summary_table(runs)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
        head = [f"# Compile grid: every kernel configuration for sm_90 and sm_80, "
                f"Triton {' and '.join(r.triton for r in runs)}", "",
                "Compiled ahead of time without a GPU (`python -m "
                "deepinfer_compile_grid.check --full --json F`, then `python -m "
                f"deepinfer_compile_grid.report F...`), commit "
                f"`{commit}`, {datetime.date.today().isoformat()}.", ""]
        Path(args.out).write_text("\n".join(head) + "\n" + table + "\n")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
