"""Summary of a mutmut run (scripts/mutate.sh): score per target, survivors with diffs.

Run from scripts/mutate.sh's staging folder (build/mutate) after ``mutmut run``. Prints,
for scheduler/ and the sampler, how many mutants were killed (a test failed or timed
out), survived (every test passed) or had no test reaching them, and the score
``killed / (killed + survived + no tests)``.
Writes every survivor's diff to mutants/survivors.txt.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

# Paths in scripts/mutate.sh's staging folder, where scheduler/ is deepinfer_scheduler/.
TARGETS = {"deepinfer_scheduler/": "scheduler/", "deepinfer/sampling/sampler.py": "sampler"}
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
UNDETECTED = {"survived", "no tests"}


def main() -> int:
    root = Path("mutants")
    metas = sorted(root.rglob("*.py.meta"))
    if not metas:
        print("mutate_report: no mutants/**/*.meta: run `make mutate` first", file=sys.stderr)
        return 2
    counts: dict[str, Counter[str]] = {name: Counter() for name in TARGETS.values()}
    survivors: list[tuple[str, Path, str]] = []
    for meta in metas:
        src = meta.relative_to(root).with_suffix("")  # deepinfer_scheduler/x.py
        target = next((t for p, t in TARGETS.items() if str(src).startswith(p)), None)
        if target is None:
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in codes.items():
            status = status_by_exit_code[code]
            counts[target][status] += 1
            if status in UNDETECTED:
                survivors.append((name, src, status))
    print(f"{'target':<12} {'mutants':>8} {'killed':>7} {'survived':>9} {'no tests':>9}"
          f" {'other':>6} {'score':>7}")
    for target, c in counts.items():
        total = sum(c.values())
        killed = sum(c[s] for s in DETECTED)
        judged = killed + c["survived"] + c["no tests"]
        other = total - judged
        score = f"{100 * killed / judged:.1f}%" if judged else "-"
        print(f"{target:<12} {total:>8} {killed:>7} {c['survived']:>9} {c['no tests']:>9}"
              f" {other:>6} {score:>7}")
    out = root / "survivors.txt"
    with out.open("w") as f:
        for name, src, status in survivors:
            f.write(f"# {name}: {status}\n")
            diff = get_diff_for_mutant(name, path=src).splitlines()
            f.write("\n".join(line for line in diff[2:] if line[:1] in "-+") + "\n\n")
    print(f"{len(survivors)} survivors (diffs: {out.resolve()}; `mutmut show NAME` for "
          "context)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
