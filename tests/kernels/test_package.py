"""Import-time behaviour of the kernels package (run in fresh interpreters)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def _run(code: str, env_drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_interpreter_enabled_without_cuda():
    res = _run("import os, deepinfer_kernels; print(os.environ.get('TRITON_INTERPRET'))",
               env_drop=("TRITON_INTERPRET",))
    assert res.returncode == 0, res.stderr
    expected = "None" if torch.cuda.is_available() else "1"
    assert res.stdout.strip() == expected


def test_import_without_triton_raises_on_call():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import deepinfer_kernels\n"
        "try:\n"
        "    deepinfer_kernels.zero_states([], None)\n"
        "except RuntimeError as e:\n"
        "    print('ok' if 'Triton' in str(e) else e)\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
