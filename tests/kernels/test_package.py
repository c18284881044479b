"""Import-time behaviour of the kernels package (run in fresh interpreters)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env_drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_interpreter_enabled_without_cuda():
    res = _run("import os, kernels; print(os.environ.get('TRITON_INTERPRET'))",
               env_drop=("TRITON_INTERPRET",))
    assert res.returncode == 0, res.stderr
    expected = "None" if torch.cuda.is_available() else "1"
    assert res.stdout.strip() == expected


def test_import_without_triton_raises_on_call():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kernels\n"
        "try:\n"
        "    kernels.zero_states([], None)\n"
        "except RuntimeError as e:\n"
        "    print('ok' if 'Triton' in str(e) else e)\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_huggingface_kernels_beside_it_is_named(tmp_path):
    """An installed distribution named "kernels" (HuggingFace's, which transformers 5.25
    requires) would hide this package or be hidden by it: importing ours says so, with the
    way out, instead of transformers failing later on a missing name."""
    site = tmp_path / "site"
    info = site / "kernels-0.19.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", "import kernels"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "'kernels' distribution 0.19.1" in res.stderr
    assert "pip uninstall kernels" in res.stderr
    assert _run("import kernels").returncode == 0  # without it: imports
