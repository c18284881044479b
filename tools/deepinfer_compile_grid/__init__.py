"""Ahead-of-time compile grid of deepinfer's Triton kernels: every configuration the engine
launches, compiled for sm_80 and sm_90 without a GPU, checked for compile errors, shared
memory over the limit and register spills.

Lab tooling, not runtime code: it lives in tools/ and is not in the wheel. tools/ goes on
``sys.path`` (tests/kernels/conftest.py, or ``PYTHONPATH=tools``); never the checkout's
root, whose kernels/ folder would stand in for Hugging Face's ``kernels``.

- ``cases``: the targets, the op calls (``Case``), a kernel's result and launch planning.
- ``check``: compiles the cases (``python -m deepinfer_compile_grid.check``).
- ``report``: folds ``check --json`` files into one table per kernel tile.
"""
