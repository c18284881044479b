"""scripts/tree_fingerprint.py: the commit label a GPU run stamps on its results, checked
against the tree the device got (no .git travels there)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tree_fingerprint.py"


def _run(cwd: Path, *args: str) -> str:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_label_follows_the_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    (repo / "b.txt").write_text("b\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert _run(repo, "record") == head
    assert (repo / ".gpu_assets" / "files").read_text().split() == ["b.txt", "pkg/a.py"]

    # The device: the same files without .git.
    device = tmp_path / "device"
    shutil.copytree(repo, device, ignore=shutil.ignore_patterns(".git"))
    assert _run(device, "label") == head
    (device / "pkg" / "a.py").write_text("x = 2\n")  # a change after the record
    assert _run(device, "label") == f"{head}+changed"
    (device / "pkg" / "a.py").write_text("x = 1\n")
    (device / "b.txt").unlink()  # a file gone is a change too
    assert _run(device, "label") == f"{head}+changed"
    shutil.rmtree(device / ".gpu_assets")
    assert _run(device, "label") == "unknown"

    # Uncommitted edits at record time are named in the recorded commit.
    (repo / "b.txt").write_text("edited\n")
    assert _run(repo, "record") == f"{head}+uncommitted"
