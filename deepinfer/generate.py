"""``deepinfer-generate`` / ``python -m deepinfer.generate``: the entry module. The
command line lives in ``deepinfer.cli``, the jobs in ``deepinfer.jobs`` and
``deepinfer.distributed``."""

from __future__ import annotations

import sys

from deepinfer.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
