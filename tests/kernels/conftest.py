"""Puts tools/ on ``sys.path`` for the compile-grid tests: ``deepinfer_compile_grid``, the
kernels' ahead-of-time compile tooling, is lab code kept out of the installed packages.
Only tools/ goes there, never the checkout's root (its kernels/ folder would stand in for
Hugging Face's ``kernels``); appended, so it can shadow nothing installed."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
if TOOLS not in sys.path:
    sys.path.append(TOOLS)
