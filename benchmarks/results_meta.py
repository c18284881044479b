"""Provenance stamped on every benchmark results file: commit and UTC date."""

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
