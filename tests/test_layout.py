"""The code's shape, checked like behaviour: small modules, no private names across
modules. (Import direction and cycles are import-linter's job: ``make lint``.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("deepinfer", "scheduler", "kernels")
PACKAGES = ("deepinfer", "deepinfer_scheduler", "deepinfer_kernels")  # their import names
MAX_LINES = 450


def _sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _sources("deepinfer", "scheduler"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small(path: Path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)}: {n} lines; a file past " \
                           f"{MAX_LINES} usually holds two concepts: split it"


def test_no_private_name_imported_across_modules():
    bad = []
    for path in _sources(*FOLDERS, "benchmarks", "tools"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                               f"from {node.module} import {alias.name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
