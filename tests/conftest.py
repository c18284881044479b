"""Test-wide setup: run Triton kernels through the interpreter when no GPU is present.

The variable has to be set before any module decorates a kernel with ``triton.jit``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the same hypothesis examples every time (a failure there is reproducible);
# local runs keep exploring new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
