"""Which commit a GPU run measured, when the device gets the tree without ``.git``.

``scripts/gpu_prepare.sh`` records the commit, the tracked files and a SHA-256 over their
paths and contents in ``.gpu_assets/``; ``scripts/gpu_ci.sh`` recomputes the digest over
the same files on the device. A tree changed since (a commit made after gpu_prepare.sh
ran, an edit, a deleted file) gets a commit label that says so, instead of results
stamped with a commit they did not measure. A file added since is not seen (the device
has no list of the files git tracks), so run gpu_prepare.sh after the last commit.

    python scripts/tree_fingerprint.py record   # gpu_prepare.sh: writes .gpu_assets/
    python scripts/tree_fingerprint.py label    # gpu_ci.sh: prints the commit label
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

ASSETS = Path(".gpu_assets")


def digest(paths: list[str]) -> str:
    """SHA-256 over each path and its bytes, in the given order ("missing" for a path
    that does not exist)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode() + b"\0")
        f = Path(p)
        h.update(f.read_bytes() if f.is_file() else b"missing")
        h.update(b"\0")
    return h.hexdigest()


def record() -> str:
    """Write ``commit`` (HEAD, "+uncommitted" when the tree differs from it), ``files``
    and ``tree-sha256`` into ``.gpu_assets/``; returns the commit label."""
    git = ["git", "-c", "core.quotepath=off"]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    if subprocess.run(git + ["diff", "--quiet", "HEAD"]).returncode != 0:
        commit += "+uncommitted"
    files = subprocess.run(git + ["ls-files"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    ASSETS.mkdir(exist_ok=True)
    (ASSETS / "commit").write_text(commit + "\n")
    (ASSETS / "files").write_text("\n".join(files) + "\n")
    (ASSETS / "tree-sha256").write_text(digest(files) + "\n")
    return commit


def label() -> str:
    """The recorded commit when this tree still matches the recorded digest, else that
    commit + "+changed" (gpu_prepare.sh was not re-run after a change); "unknown" without
    a record."""
    try:
        commit = (ASSETS / "commit").read_text().strip()
        files = (ASSETS / "files").read_text().splitlines()
        want = (ASSETS / "tree-sha256").read_text().strip()
    except OSError:
        return "unknown"
    if digest(files) != want:
        return f"{commit}+changed"
    return commit


def main(argv: list[str]) -> int:
    if argv[1:] == ["record"]:
        print(record())
        return 0
    if argv[1:] == ["label"]:
        print(label())
        return 0
    print("usage: tree_fingerprint.py record|label", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
