"""Test-wide setup: run Triton kernels through the interpreter when no GPU is present.

The variable has to be set before any module decorates a kernel with ``triton.jit``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
