"""Every deepinfer module sits in the import-linter layers contract (``make lint`` checks
the direction; this checks that no module escapes it by being left unlisted)."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _contract(name_start: str) -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (found,) = [c for c in contracts if c["name"].startswith(name_start)]
    return found


def _layer_names(contract: dict) -> set[str]:
    return {name for layer in contract["layers"] for name in re.split(r"[|:]", layer)
            for name in [name.strip()] if name}


def test_every_deepinfer_module_is_in_the_layers_contract():
    listed = _layer_names(_contract("Inside deepinfer"))
    pkg = ROOT / "deepinfer"
    modules = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in pkg.glob("*/__init__.py")}
    assert modules - listed == set(), f"deepinfer modules outside the layers contract: " \
                                      f"{sorted(modules - listed)}"
    assert listed - modules == set(), f"the contract names modules that are gone: " \
                                      f"{sorted(listed - modules)}"
