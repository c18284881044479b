"""``scripts/gpu_ci.sh`` where there is no GPU: its plan (steps, caps, order) fits one
device call with the tests first; missing setup stops it at once, naming the missing
piece, before anything is installed or built; without a GPU it stops at its environment
check with a message that says why, and (with ``GPU_CI_WORK`` apart from ``OUT``, as on
the device tool's machine) leaves in ``OUT`` one archive of its logs, not a tree of
files. Its summary program turns every step's results into one table."""

from __future__ import annotations

import re
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
    """The scripts in a folder of their own: its repo root then holds no carried wheels
    and no assets."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    for name in ("gpu_ci.sh", "gpu_ci_env.py", "gpu_ci_summary.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "repo" / "scripts" / name)
    return tmp_path / "repo" / "scripts" / "gpu_ci.sh"


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in {**base, **env}.items() if v})


def _plan(res: subprocess.CompletedProcess) -> tuple[list[tuple[str, int]], int, int]:
    """``--plan``'s numbered steps with their caps, and the planned total and budget."""
    steps = [(m[1], int(m[2])) for m in re.finditer(r"^\s+\d+\.\s+(\S+)\s+(\d+)s",
                                                    res.stdout, re.M)]
    total = re.search(r"^planned: (\d+)s of (\d+)s$", res.stdout, re.M)
    return steps, int(total[1]), int(total[2])


def test_default_plan_fits_one_call_tests_first(tmp_path):
    """The default run's plan, printed without a GPU, a results folder or any setup: at
    most 500 s in all (setup and summary included), the tests first, then the headline
    benchmarks; the long steps (FlexAttention's compiles, the MoE sweep, the @slow engine
    test) are not in it."""
    res = _run(_script_copy(tmp_path), {}, "--plan")
    assert res.returncode == 0, res.stderr
    steps, total, budget = _plan(res)
    names = [n for n, _ in steps]
    assert names[:2] == ["kernel-tests", "engine-tests"]
    assert names[2:] == ["kernel-bench", "e2e-throughput"]
    assert total <= budget == 500
    assert total >= sum(cap for _, cap in steps)  # setup and summary counted too
    assert "over the budget" not in res.stdout
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["scripts"]


def test_named_steps_run_in_plan_order_and_an_unknown_one_is_refused(tmp_path):
    script = _script_copy(tmp_path)
    res = _run(script, {"GPU_CI_STEPS": "moe-sweep,kernel-tests,flex-bench"}, "--plan")
    assert [n for n, _ in _plan(res)[0]] == ["kernel-tests", "flex-bench", "moe-sweep"]
    res = _run(script, {"GPU_CI_STEPS": "all"}, "--plan")
    assert "over the budget" in res.stdout  # every step: more than one call holds
    res = _run(script, {"GPU_CI_STEPS": "kernel-tests,kernal-bench"}, "--plan")
    assert res.returncode == 2
    assert "unknown step 'kernal-bench'" in res.stderr


def test_python3_when_python_has_no_torch(tmp_path):
    """Without $PYTHON: ``python`` where it imports torch, else ``python3``."""
    script = _script_copy(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def interpreter(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)

    interpreter("python3", f'exec {sys.executable} "$@"')
    interpreter("python", "exit 1")  # a python whose import of torch fails
    env = {"PYTHON": "", "PATH": f"{bin_dir}:/usr/bin:/bin"}
    assert "python python3," in _run(script, env, "--plan").stdout
    interpreter("python", f'exec {sys.executable} "$@"')
    assert "python python," in _run(script, env, "--plan").stdout


def test_missing_packages_are_named_before_anything_runs(tmp_path):
    """An interpreter that has none of the carried packages (``-S``: no site-packages)
    and no .whl/: the script stops with rc 1 naming each, before installing wheels or
    checking the environment."""
    wrapper = tmp_path / "bare-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    wrapper.chmod(0o755)
    work = tmp_path / "work"
    res = _run(_script_copy(tmp_path), {"PYTHON": str(wrapper), "OUT": str(work)})
    assert res.returncode == 1
    for name in ("xgrammar", "gguf", "jsonschema"):
        assert f"{name} (no wheel in .whl/, not importable by {wrapper})" in res.stderr
    assert "scripts/gpu_prepare.sh" in res.stderr
    assert sorted(p.name for p in (work / "logs").iterdir()) == ["plan.txt", "setup.err"]


def test_missing_tokenizer_is_named_when_structured_runs(tmp_path):
    work = tmp_path / "work"
    res = _run(_script_copy(tmp_path), {"OUT": str(work), "GPU_CI_STEPS": "structured"})
    assert res.returncode == 1
    assert ".gpu_assets/smollm2-tokenizer" in res.stderr
    assert sorted(p.name for p in (work / "logs").iterdir()) == ["plan.txt", "setup.err"]


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


def test_summary_table_from_every_step(tmp_path):
    """The summary step reads what each step leaves (real CPU results of the benchmarks
    standing in for the GPU's, same formats) and writes one table with a line per step;
    the MoE sweep's file is not mistaken for the MoE benchmark's."""
    import json

    work = tmp_path / "work"
    logs, results = work / "logs", work / "results"
    logs.mkdir(parents=True)
    results.mkdir()
    (logs / "env.json").write_text(json.dumps({
        "gpu": "NVIDIA H200", "capability": "sm_90", "torch": "2.11", "cuda": "13.0",
        "triton": "3.6.0", "flash_attn": None, "xgrammar": "0.2.9"}))
    steps = ["env", "kernel-tests", "engine-tests", "moe-bench", "structured", "kernel-bench",
             "e2e-throughput", "moe-sweep", "compile-grid"]
    (logs / "steps.tsv").write_text("".join(f"{s}\tok\t3\t0\n" for s in steps)
                                    + "flex-bench\tskipped (budget)\t0\t0\n")
    res = ROOT / "benchmarks" / "results"
    shutil.copy(res / "structured-cpu.json", results / "structured-cuda.json")
    # bench_moe's rows as it writes them on CUDA (its CPU run times no fused kernel).
    q = "qwen3-30b-a3b"
    (results / "moe-nvidia-h200.json").write_text(json.dumps({"meta": {}, "results": [
        {"model": q, "tokens": 16, "impl": "triton-fused", "ms": 0.1, "bw_frac": 0.7},
        {"model": q, "tokens": 8, "impl": "triton-fused", "ms": 0.1, "bw_frac": 0.8},
        {"model": q, "tokens": 8, "impl": "triton-fused-gguf-q4_0", "ms": 0.1,
         "bw_frac": 0.55},
        {"model": q, "tokens": 256, "impl": "triton-fused", "ms": 0.2},
        {"model": q, "tokens": 256, "impl": "torch-per-expert-loop", "ms": 0.8,
         "speedup_of_triton-fused": 4.0}]}))
    shutil.copy(res / "throughput-cpu.json", results / "throughput-cuda.json")
    sweep = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe_sweep.py"),
                            "--out", str(results)], capture_output=True, text=True, timeout=300)
    assert sweep.returncode == 0, sweep.stderr
    (results / "kernels-h200.json").write_text(json.dumps({"meta": {}, "results": [
        {"op": "decode", "case": "b1", "impl": "sdpa-flash", "ms": 2.0, "triton_speedup": 2.0},
        {"op": "decode", "case": "b1", "impl": "triton", "ms": 1.0}]}))
    # bench_layer_ops's rows as it writes them on CUDA (its CPU run times no fused op).
    (results / "layer-ops-nvidia-h200.json").write_text(json.dumps({"meta": {}, "results": [
        {"op": "silu_and_mul", "tokens": 256, "torch_ms": 0.02, "fused_ms": 0.01,
         "speedup": 2.0, "bw_frac": 0.2},
        {"op": "layer chain", "tokens": 256, "torch_ms": 0.3, "fused_ms": 0.05,
         "speedup": 6.0, "bw_frac": 0.25}]}))
    (results / "sampling-nvidia-h200.json").write_text(json.dumps({"meta": {}, "results": [
        {"rows": 256, "vocab": 151936, "torch_ms": 0.5, "fused_ms": 0.1, "speedup": 5.0}]}))
    # bench_quant_kernels's rows (CUDA only), two types.
    (results / "quant-kernels-nvidia-h200.json").write_text(json.dumps({"meta": {}, "results": [
        {"type": "Q4_K", "M": 1, "bw_frac": 0.62, "dense_over_gguf": 2.5},
        {"type": "Q8_0", "M": 1, "bw_frac": 0.71, "dense_over_gguf": 1.6},
        {"type": "Q4_K", "M": 256, "bw_frac": 0.1, "dense_over_gguf": 0.8},
        {"type": "Q8_0", "M": 256, "bw_frac": 0.1, "dense_over_gguf": 0.95}]}))
    # No .git here, as on the device: gpu_ci.sh exports the recorded commit label.
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_ci_summary.py")],
                         cwd=tmp_path,
                         capture_output=True, text=True, timeout=60,
                         env={"WORK": str(work), "GPU_CI_SECONDS": "42", "BUDGET": "560",
                              "GIT_COMMIT": "abc1234", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    md = (work / "summary.md").read_text()
    assert md == (results / "gpu-ci-nvidia-h200.md").read_text()
    assert "commit `abc1234`" in md and "total 42 s (budget 560 s)" in md
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
            if line.startswith("| ") and " | ok | " in line}
    assert sorted(rows) == sorted(steps)
    assert "| flex-bench | skipped (budget) | 0 |" in md
    assert "decode 2.00x vs sdpa-flash" in rows["kernel-bench"]
    # From bench_moe's file, not the sweep's (which a "moe-*.json" glob also matches).
    assert ("qwen3-30b-a3b 4.0x vs loop at M=256, weight-read bw 70%-80% of copy at "
            "M<=16, Q4_0 experts 55%-55%") in rows["moe-bench"]
    assert ("layer elementwise chain fused vs torch: 6.0x at 256 tokens (25% of copy bw)"
            in rows["kernel-bench"])
    assert "temperature sampling fused vs torch: 5.0x at 256x151936" in rows["kernel-bench"]
    assert ("GGUF matmul (2 types): M=1 weight-read bw 62%-71% of copy, M=256 0.80-0.95x "
            "the speed of dense bf16") in rows["kernel-bench"]
    assert "constrained" in rows["structured"] and "valid JSON" in rows["structured"]
    assert "overlap on: 233 tok/s" in rows["e2e-throughput"]
    assert "configurations" in rows["moe-sweep"]


def test_import_names_linked_where_deepinfer_is_not_installed(tmp_path):
    """The GPU machine has no install of deepinfer: gpu_ci.sh links the import names to the
    tree. Without site's .pth files (so without the editable install), torch from its
    site-packages and deepinfer from the links import, the kernels from kernels/."""
    links = tmp_path / "links"
    subprocess.run(["bash", str(ROOT / "scripts" / "link_import_names.sh"), str(links)],
                   check=True, timeout=60)
    site = Path(torch.__file__).resolve().parents[1]
    code = ("import deepinfer_kernels, deepinfer_scheduler, deepinfer.engine_args\n"
            "print(deepinfer_kernels.__file__)\n")
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{links}:{site}"})
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).resolve() == ROOT / "kernels" / "__init__.py"
