"""Whether the source a benchmark ran differs from the commit its results file names
(``results_meta.git_commit`` is HEAD): tracked changes and untracked files under the
packages, so a figure measured on work in progress says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

PACKAGES = ("deepinfer", "scheduler", "kernels")


def uncommitted_source() -> list[str]:
    """Paths under the packages that differ from HEAD (modified, added or untracked);
    empty outside a checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", *PACKAGES],
                             capture_output=True, text=True, cwd=root, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(line[3:] for line in out.splitlines() if line.strip())


def commit_label(commit: str, changed: list[str]) -> str:
    """``abc1234`` or ``abc1234 + uncommitted changes to N source files``."""
    if not changed:
        return commit
    return f"{commit} + uncommitted changes to {len(changed)} source files"
