"""What benchmark results files share: provenance (commit, UTC date) and the markdown
table of their rows."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short hash of HEAD, or ``$GIT_COMMIT`` / "unknown" outside a checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GIT_COMMIT", "unknown")


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
