"""``scripts/gpu_ci.sh`` where there is no GPU: it stops at its environment check with a
message that says why, and (with ``GPU_CI_WORK`` apart from ``OUT``, as on the device
tool's machine) leaves in ``OUT`` one archive of its logs, not a tree of files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or shutil.which("bash") is None,
                                reason="checks the no-GPU path of the script")


def _script_copy(tmp_path: Path) -> Path:
    """The script in a folder of its own: its repo root then holds no carried wheels."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    dst = tmp_path / "repo" / "scripts" / "gpu_ci.sh"
    shutil.copy(ROOT / "scripts" / "gpu_ci.sh", dst)
    return dst


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                            **env})


def test_needs_a_results_folder(tmp_path):
    res = _run(_script_copy(tmp_path), {})
    assert res.returncode == 2
    assert "name a results folder" in res.stderr


def test_stops_without_a_gpu_and_packs_its_logs(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    res = _run(_script_copy(tmp_path), {"OUT": str(out), "GPU_CI_WORK": str(work)})
    assert res.returncode == 1
    assert "CUDA is not available" in res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu-ci.tar.gz"]
    with tarfile.open(out / "gpu-ci.tar.gz") as tar:
        names = tar.getnames()
        err = tar.extractfile("logs/env.err").read().decode()
    assert "logs/env.err" in names and "CUDA is not available" in err
    assert (work / "logs" / "env.err").exists()
