"""Ahead-of-time compile check: every kernel configuration the engine launches, compiled
for sm_80 and sm_90 without a GPU, with its registers, spills and shared memory.

The interpreter checks numerics only. ``deepinfer_compile_grid.cases`` plans launches with the
ops' own ``*_launches`` functions (meta tensors, a ``Target`` standing for an A100 or an
H100/H200), so a launcher change is covered; this module compiles each one with
``triton.compile`` through the JIT's own argument specialization
(``create_function_from_signature`` + ``_pack_args``), so what is compiled is what
``kernel[grid](...)`` would compile on that GPU. ptxas runs as part of it; ``cuobjdump
-res-usage`` on the cubin then gives REG / STACK / SHARED.

Spills are read as the ptxas stack frame (``STACK``) plus ``LOCAL``: these kernels have no
local arrays and no calls, so any stack is spilled registers.

Run ``PYTHONPATH=tools python -m deepinfer_compile_grid.check [--full] [--json PATH]``
from the checkout for the table (this package lives in tools/, outside the wheel). It
re-executes itself with ``TRITON_INTERPRET=0`` when needed: compiling needs the real
``JITFunction``s, which ``deepinfer_kernels`` replaces with interpreter wrappers on a CPU
machine. tests/kernels/test_compile.py drives it. Works with Triton 3.6 (the GPU image)
and 3.9.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer_compile_grid.cases import (
    ARCHS,
    Arch,
    Case,
    KernelResult,
    full_cases,
    plan,
    quick_cases,
)
from deepinfer_kernels.runtime import Launch

# The folder holding this package. It is not installed (the wheel ships the runtime
# kernels only), so the child interpreters below are pointed at it.
TOOLS_DIR = Path(__file__).resolve().parents[1]


def compiler_env() -> dict[str, str]:
    """This process's environment for a child ``python -m deepinfer_compile_grid.check``:
    the compiler's JIT (``TRITON_INTERPRET=0``) and tools/ first on ``PYTHONPATH``."""
    paths = [str(TOOLS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(paths))

# --- compiling ---------------------------------------------------------------------------

def _gpu_target(arch: Arch) -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)


def compile_launch(launch: Launch, arch: Arch) -> Any:
    """``triton.compile`` the kernel exactly as ``launch.kernel[grid](*args, **kwargs)``
    would on ``arch``: the JIT's binder specializes the arguments (pointer alignment, ints
    divisible by 16 or equal to 1, constexprs), ``_pack_args`` turns that into the
    signature / constexprs / attrs of an ``ASTSource``. Same code path in Triton 3.6-3.9.
    """
    import triton
    from triton import knobs
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = launch.kernel
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{fn!r} is not a JITFunction: import kernels with "
                           "TRITON_INTERPRET=0 to compile ahead of time")
    target = _gpu_target(arch)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    # What JITFunction.run adds before binding (3.6: debug, instrumentation_mode; 3.9 also
    # fpsan_homomorphic_casts): options must match a real launch's.
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound_args, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _cuobjdump() -> str:
    import triton

    with contextlib.suppress(Exception):
        from triton import knobs

        return str(knobs.nvidia.cuobjdump.path)
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if bundled.exists():
        return str(bundled)
    found = shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("cuobjdump not found (neither bundled with Triton nor on PATH)")
    return found


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the (single) function in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    return parse_res_usage(text)


def parse_res_usage(text: str) -> dict[str, int]:
    """Parse ``cuobjdump -res-usage`` output (one function): ``{"REG": .., "STACK": ..,
    "SHARED": .., "LOCAL": ..}``."""
    line = next((ln for ln in text.splitlines() if "REG:" in ln), None)
    if line is None:
        raise ValueError(f"no resource usage line in cuobjdump output:\n{text}")
    return {key: int(re.search(rf"\b{key}:(\d+)", line)[1])  # type: ignore[index]
            for key in ("REG", "STACK", "SHARED", "LOCAL")}


def _config_str(launch: Launch) -> str:
    keep = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUPS", "GROUP_M", "BLOCK_T", "BLOCK_HD", "BLOCK",
            "GROUP_PAD", "S_PAD", "CHUNK", "E_PAD", "GATED", "BLOCK_H", "HAS_RESIDUAL",
            "BLOCK_I", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "HAS_NORM", "SOFTCAP",
            "num_warps", "num_stages")
    short = {"num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}={launch.kwargs[k]}" for k in keep if k in launch.kwargs)


def check_case(case: Case) -> list[KernelResult]:
    """Plan and compile one case; errors are captured in the results, not raised."""
    arch = ARCHS[case.arch]
    try:
        launches = plan(case)
    except Exception as exc:  # a planner bug is a failure of the case, reported as such
        return [KernelResult(case.id, "(plan)", "", error=f"{type(exc).__name__}: {exc}")]
    results = []
    for launch in launches:
        name = getattr(launch.kernel, "__name__", str(launch.kernel))
        res = KernelResult(case.id, name, _config_str(launch))
        start = time.perf_counter()
        try:
            compiled = compile_launch(launch, arch)
            usage = resource_usage(compiled.asm["cubin"])
            res.regs, res.stack, res.local = usage["REG"], usage["STACK"], usage["LOCAL"]
            res.shared = int(compiled.metadata.shared) + usage["SHARED"]
            res.tensor_cores = bool(re.search(r"\b(?:wgmma|mma)\.", compiled.asm["ptx"]))
        except Exception as exc:
            res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        res.seconds = time.perf_counter() - start
        results.append(res)
    return results


def _worker_init() -> None:
    # Triton 3.9 warns once per process about the fp-fusion default; the default (fusion
    # on) is what the engine runs with, so keep it and silence the noise.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def run_cases(cases: Sequence[Case], jobs: int = 2) -> list[KernelResult]:
    """Compile ``cases`` on ``jobs`` processes (this process must have the real JIT)."""
    _worker_init()
    if jobs <= 1 or len(cases) <= 1:
        return [r for c in cases for r in check_case(c)]
    import multiprocessing as mp

    # spawn: no forked Triton/torch state; children inherit TRITON_INTERPRET=0 from here.
    # Fewer chunks than cases: each worker pays the torch + triton import once.
    with mp.get_context("spawn").Pool(jobs, initializer=_worker_init) as pool:
        nested = pool.map(check_case, cases, chunksize=1)
    return [r for rs in nested for r in rs]


def results_from_subprocess(cases: Sequence[Case], jobs: int = 2, timeout: float = 1800,
                            python: str = sys.executable) -> list[KernelResult]:
    """Run the check in a fresh interpreter with ``TRITON_INTERPRET=0`` (the way tests call
    it: their process runs the kernels through the interpreter)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        out = Path(tmp) / "results.json"
        spec.write_text(json.dumps([dataclasses.asdict(c) for c in cases]))
        proc = subprocess.run(
            [python, "-m", "deepinfer_compile_grid.check", "--cases", str(spec),
             "--json", str(out), "--jobs", str(jobs), "--quiet"],
            env=compiler_env(), cwd=TOOLS_DIR, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"deepinfer_compile_grid.check failed (rc {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return [KernelResult(**r) for r in json.loads(out.read_text())["results"]]


# --- report ------------------------------------------------------------------------------

def verdicts(cases: Sequence[Case], results: Sequence[KernelResult]) -> dict[str, list[str]]:
    """Problems per case id (empty list: the case passes)."""
    by_id: dict[str, list[KernelResult]] = {}
    for r in results:
        by_id.setdefault(r.case, []).append(r)
    out = {}
    for case in cases:
        rs = by_id.get(case.id)
        out[case.id] = (["not compiled"] if not rs else
                        [p for r in rs for p in r.problems(case, ARCHS[case.arch])])
    return out


def markdown_table(cases: Sequence[Case], results: Sequence[KernelResult]) -> str:
    """One row per compiled kernel: case, kernel, config, registers, spills, shared."""
    import triton

    case_by_id = {c.id: c for c in cases}
    lines = [
        f"Triton {triton.__version__}; spill = ptxas stack frame + local bytes per thread; "
        "shared = bytes per block (dynamic + static); TC = tensor-core mma in the PTX.",
        "",
        "| case | kernel | config | regs | spill B | shared B | TC | ok |",
        "|---|---|---|---:|---:|---:|:-:|:-:|",
    ]
    for r in results:
        case = case_by_id[r.case]
        if r.error:
            lines.append(f"| {r.case} | {r.kernel} | {r.config} | - | - | - | - | FAIL: "
                         f"{r.error[:80]} |")
            continue
        spill = r.stack + r.local
        status = ("FAIL" if r.problems(case, ARCHS[case.arch])
                  else "ok (fp32 sm_80: allowed)" if spill else "ok")
        if case.variant == "canary":
            status = "spills, as it must (canary)" if r.stack > 0 else "FAIL (canary)"
        lines.append(f"| {r.case} | {r.kernel} | {r.config} | {r.regs} | {spill} "
                     f"| {r.shared} | {'y' if r.tensor_cores else '-'} | {status} |")
    return "\n".join(lines)


def _jit_is_real() -> bool:
    from triton.runtime.jit import JITFunction

    from deepinfer_kernels.prefill_attention import prefill_kernel

    return isinstance(prefill_kernel, JITFunction)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole grid (default: quick)")
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma-separated: sm_90,sm_80")
    parser.add_argument("--cases", help="JSON list of Case fields (overrides --full/--arch)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--json", help="write {triton, cases, results, seconds} here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--quiet", action="store_true", help="no table on stdout")
    args = parser.parse_args(argv)

    if not _jit_is_real():
        # deepinfer_kernels was imported in interpreter mode (no GPU and TRITON_INTERPRET unset):
        # start over with the compiler's JIT.
        cmd = [sys.executable, "-m", "deepinfer_compile_grid.check", *(argv or sys.argv[1:])]
        return subprocess.run(cmd, env=compiler_env()).returncode

    if args.cases:
        cases = [Case(**c) for c in json.loads(Path(args.cases).read_text())]
    else:
        archs = [a for a in args.arch.split(",") if a]
        cases = full_cases(archs) if args.full else quick_cases(archs)
    start = time.perf_counter()
    results = run_cases(cases, args.jobs)
    elapsed = time.perf_counter() - start
    bad = {k: v for k, v in verdicts(cases, results).items() if v}
    table = markdown_table(cases, results)
    if args.json:
        import triton

        Path(args.json).write_text(json.dumps({
            "triton": triton.__version__,
            "cases": [dataclasses.asdict(c) for c in cases],
            "results": [dataclasses.asdict(r) for r in results],
            "seconds": elapsed,
        }, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if not args.quiet:
        print(table)
        print(f"\n{len(cases)} cases, {len(results)} kernels compiled in {elapsed:.1f}s "
              f"({args.jobs} jobs); {len(bad)} failing")
        for case_id, problems in bad.items():
            for p in problems:
                print(f"FAIL {case_id}: {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
