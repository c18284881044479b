"""Test-wide setup: run Triton kernels through the interpreter when no GPU is present.

The variable has to be set before any module decorates a kernel with ``triton.jit``.
"""

import os
import sys
from pathlib import Path

import torch

# Ranks started with multiprocessing's spawn unpickle their functions by module name
# (tests.distributed...), with this process's sys.path: the checkout's root goes at the
# END, so that installed packages (HuggingFace's kernels above all) come first.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the same hypothesis examples every time (a failure there is reproducible);
# local runs keep exploring new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
