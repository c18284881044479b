"""Ahead-of-time compile check: every kernel configuration the engine launches, compiled
for sm_80 and sm_90 without a GPU, with its registers, spills and shared memory.

The interpreter checks numerics only. This module plans launches with the ops' own
``*_launches`` functions (meta tensors, a ``Target`` standing for an A100 or an H100/H200),
so a launcher change is covered, and compiles each one with ``triton.compile`` through the
JIT's own argument specialization (``create_function_from_signature`` + ``_pack_args``), so
what is compiled is what ``kernel[grid](...)`` would compile on that GPU. ptxas runs as part
of it; ``cuobjdump -res-usage`` on the cubin then gives REG / STACK / SHARED.

Spills are read as the ptxas stack frame (``STACK``) plus ``LOCAL``: these kernels have no
local arrays and no calls, so any stack is spilled registers.

Run ``python -m kernels.compile_check [--full] [--json PATH]`` for the table (it re-executes
itself with ``TRITON_INTERPRET=0`` when needed: compiling needs the real ``JITFunction``s,
which ``kernels`` replaces with interpreter wrappers on a CPU machine).
tests/kernels/test_compile.py drives it. Works with Triton 3.6 (the GPU image) and 3.9.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.runtime import Launch, Target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Arch:
    """A compile target and the device facts the launchers would read from it."""

    name: str
    capability: tuple[int, int]
    num_sms: int  # drives the decode split choice (and so the merge kernel's S_PAD)
    max_shared: int  # bytes per block, opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)

    def target(self) -> Target:
        return Target(self.capability, self.num_sms, interpret=False)


ARCHS = {
    "sm_90": Arch("sm_90", (9, 0), 132, 232_448),  # H100 SXM / H200: 227 KB
    "sm_80": Arch("sm_80", (8, 0), 108, 166_912),  # A100: 163 KB
}

# Engine-like shapes: 8 KV heads (Qwen3-0.6B, Llama-3-8B), q heads = 8 * GQA.
NUM_KV_HEADS = 8


@dataclass(frozen=True)
class Case:
    """One op call the engine makes, on one target.

    op: ``decode`` (unsplit: a large batch already fills the GPU), ``decode_split`` (one
    long sequence: split-KV + merge), ``prefill``, ``store_kv`` (variant ``t1``: one token,
    ``batch``: a decode batch), ``clone_blocks``, ``zero_states``, ``clone_states``.
    """

    op: str
    arch: str
    dtype: str
    head_dim: int = 128
    gqa: int = 1
    block_size: int = 16
    variant: str = ""

    @property
    def id(self) -> str:
        parts = [self.op, self.arch, self.dtype, f"d{self.head_dim}", f"gqa{self.gqa}",
                 f"bs{self.block_size}"]
        return "-".join(parts + ([self.variant] if self.variant else []))

    @property
    def must_not_spill(self) -> bool:
        """What the engine serves: 16-bit everywhere, fp32 on sm_90 (fp32 on sm_80 is only
        compiled and reported)."""
        return self.dtype != "fp32" or self.arch == "sm_90"

    @property
    def wants_tensor_cores(self) -> bool:
        """16-bit attention must keep its ``tl.dot``s on the tensor cores."""
        return self.op in ("decode", "decode_split", "prefill") and self.dtype != "fp32"


@dataclass
class KernelResult:
    """One compiled kernel of a case (decode_split gives two: the split kernel, the merge)."""

    case: str
    kernel: str
    config: str
    regs: int = -1
    stack: int = -1  # ptxas stack frame bytes per thread: spilled registers here
    local: int = -1
    shared: int = -1  # dynamic (Triton) + static bytes per block
    tensor_cores: bool = False
    error: str = ""
    seconds: float = 0.0

    def problems(self, case: Case, arch: Arch) -> list[str]:
        """Why this result fails the check (empty: it passes)."""
        if self.error:
            return [f"{self.kernel}: compile error: {self.error}"]
        out = []
        if self.shared > arch.max_shared:
            out.append(f"{self.kernel}: {self.shared} B shared memory > {arch.max_shared} B "
                       f"on {arch.name}")
        if case.must_not_spill and (self.stack > 0 or self.local > 0):
            out.append(f"{self.kernel}: spills on {arch.name} ({self.regs} registers, "
                       f"{self.stack} B stack, {self.local} B local) with {self.config}")
        if case.wants_tensor_cores and self.kernel != "_merge_kernel" and not self.tensor_cores:
            out.append(f"{self.kernel}: no tensor-core mma in the PTX ({self.config})")
        return out


# --- cases -----------------------------------------------------------------------------

_ATTN_OPS = ("decode", "decode_split", "prefill")


def full_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """The whole grid: head_dim 64/128/256 x GQA 1/4/8 x block size 16/32 x bf16/fp16/fp32
    for decode (unsplit and split) and prefill, plus the engine's other block sizes (8, 64)
    at GQA 4; store_kv and the copy ops per dtype."""
    shapes = [(gqa, bs) for gqa in (1, 4, 8) for bs in (16, 32)] + [(4, 8), (4, 64)]
    cases = []
    for arch in archs:
        for op, d, (gqa, bs), dt in itertools.product(
                _ATTN_OPS, (64, 128, 256), shapes, DTYPES):
            cases.append(Case(op, arch, dt, d, gqa, bs))
        for d, bs, dt, variant in itertools.product((64, 128, 256), (16, 32), DTYPES,
                                                    ("t1", "batch")):
            cases.append(Case("store_kv", arch, dt, d, 1, bs, variant))
        for dt in DTYPES:
            cases.append(Case("clone_blocks", arch, dt, 128, 1, 16, "int64"))
        for op, variant in itertools.product(("zero_states", "clone_states"),
                                             ("int64", "int32")):
            cases.append(Case(op, arch, "fp32", 128, 1, 16, variant))
    return cases


def quick_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """A representative subset for ``make test`` (about a minute on 2 cores, cold cache).

    Every tile configuration the launchers choose on each target: prefill (the kernel that
    spilled) at every head_dim x dtype, decode at every head_dim for 16-bit and fp32 (its
    tile depends on row bytes), split and unsplit; store_kv for one token and for a batch;
    the copy kernel. GQA, block size and fp16/bf16 rotate across the cases (the full grid
    covers every combination).
    """
    shapes = itertools.cycle([(4, 16), (8, 32), (1, 16), (4, 32)])
    cases = []
    for arch in archs:
        for d, dt in itertools.product((64, 128, 256), DTYPES):
            gqa, bs = next(shapes)
            cases.append(Case("prefill", arch, dt, d, gqa, bs))
        # Every decode tile (16-bit and fp32 at each head_dim), split and unsplit.
        for d, (op, dt) in zip((64, 128, 256, 64, 128, 256),
                               [("decode", "bf16"), ("decode_split", "fp16"),
                                ("decode_split", "bf16"), ("decode_split", "fp32"),
                                ("decode", "fp32"), ("decode", "fp32")]):
            gqa, bs = next(shapes)
            cases.append(Case(op, arch, dt, d, gqa, bs))
        cases.append(Case("store_kv", arch, "bf16", 128, 1, 16, "t1"))
        cases.append(Case("store_kv", arch, "fp32", 64, 1, 32, "batch"))
        cases.append(Case("clone_blocks", arch, "bf16", 128, 1, 16, "int64"))
        cases.append(Case("zero_states", arch, "fp32", 128, 1, 16, "int64"))
    return cases


def spill_canary(arch: str = "sm_90") -> Case:
    """A configuration known to spill (the pre-fix fp32 prefill tile), to prove that the
    check sees spills: planned with ``variant="canary"``."""
    return Case("prefill", arch, "fp32", 64, 4, 16, "canary")


# --- planning (meta tensors; no GPU, no data) ---------------------------------------------

def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def plan(case: Case) -> list[Launch]:
    """The launches the engine's call for ``case`` makes, via the ops' own planners."""
    from kernels.cache_ops import clone_blocks_launches, state_launches
    from kernels.decode_attention import decode_launches
    from kernels.prefill_attention import prefill_kernel, prefill_launches
    from kernels.store_kv import store_kv_launches

    target = ARCHS[case.arch].target()
    dtype = DTYPES[case.dtype]
    d, bs, hkv = case.head_dim, case.block_size, NUM_KV_HEADS
    hq = hkv * case.gqa
    scale = d**-0.5
    i32 = torch.int32

    if case.op in ("decode", "decode_split"):
        # Unsplit: 256 sequences of up to 4K tokens (256 * 8 programs cover every SM).
        # Split: one 32K-token sequence, so the split heuristic picks many splits.
        batch, context = (256, 4096) if case.op == "decode" else (1, 32768)
        cache = _meta(batch * context // bs + 1, bs, hkv, d, dtype=dtype)
        q = _meta(batch, hq, d, dtype=dtype)
        launches = decode_launches(
            q, cache, cache, _meta(batch, context // bs, dtype=i32), _meta(batch, dtype=i32),
            torch.empty_like(q), scale, None, context, target)
        want_split = case.op == "decode_split"
        if (len(launches) > 1) != want_split:
            raise AssertionError(f"{case.id}: the split heuristic chose {len(launches)} "
                                 "launch(es); the case no longer covers what it names")
        return launches
    if case.op == "prefill":
        # 4 prompts of 1K new tokens after a cached prefix, packed.
        seqs, new, context = 4, 1024, 2048
        cache = _meta(seqs * context // bs + 1, bs, hkv, d, dtype=dtype)
        q = _meta(seqs * new, hq, d, dtype=dtype)
        launches = prefill_launches(
            q, cache, cache, _meta(seqs, context // bs, dtype=i32), _meta(seqs + 1, dtype=i32),
            _meta(seqs, dtype=i32), torch.empty_like(q), scale, new, target)
        if case.variant == "canary":
            # The fp32 d=64 tile used before the per-target table: 560 B stack on sm_90.
            (launch,) = launches
            launch.kwargs.update(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3)
            assert launch.kernel is prefill_kernel
        return launches
    if case.op == "store_kv":
        tokens = 1 if case.variant == "t1" else 256
        k = _meta(tokens, hkv, d, dtype=dtype)
        cache = _meta(4096, bs, hkv, d, dtype=dtype)
        return store_kv_launches(k, torch.empty_like(k), cache, cache,
                                 _meta(tokens, dtype=torch.int64), target)
    index_dtype = getattr(torch, case.variant or "int64")
    if case.op == "clone_blocks":
        kv = _meta(28, 2, 4096, bs, hkv, d, dtype=dtype)  # [layers, K/V, blocks, bs, Hkv, D]
        return clone_blocks_launches(kv, _meta(64, 2, dtype=index_dtype), target)
    if case.op in ("zero_states", "clone_states"):
        # The sampler's per-slot state: token counts (int32) and a seen-token mask (bool)
        # over a 151,936-token vocabulary.
        states = [_meta(256, 151_936, dtype=torch.int32), _meta(256, 151_936, dtype=torch.bool)]
        idx = (_meta(8, dtype=index_dtype) if case.op == "zero_states"
               else _meta(8, 2, dtype=index_dtype))
        return state_launches(states, idx, case.op == "zero_states", target)
    raise ValueError(f"unknown op {case.op!r}")


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
    keep = ("BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_HD", "BLOCK", "GROUP_PAD", "S_PAD",
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
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        out = Path(tmp) / "results.json"
        spec.write_text(json.dumps([dataclasses.asdict(c) for c in cases]))
        env = dict(os.environ, TRITON_INTERPRET="0")
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(
            [python, "-m", "kernels.compile_check", "--cases", str(spec), "--json", str(out),
             "--jobs", str(jobs), "--quiet"],
            env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"kernels.compile_check failed (rc {proc.returncode}):\n"
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

    from kernels.prefill_attention import prefill_kernel

    return isinstance(prefill_kernel, JITFunction)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole grid (default: quick)")
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma-separated: sm_90,sm_80")
    parser.add_argument("--cases", help="JSON list of Case fields (overrides --full/--arch)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--json", help="write {cases, results} here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--quiet", action="store_true", help="no table on stdout")
    args = parser.parse_args(argv)

    if not _jit_is_real():
        # kernels was imported in interpreter mode (no GPU and TRITON_INTERPRET unset):
        # start over with the compiler's JIT.
        env = dict(os.environ, TRITON_INTERPRET="0")
        cmd = [sys.executable, "-m", "kernels.compile_check", *(argv or sys.argv[1:])]
        return subprocess.run(cmd, env=env).returncode

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
        Path(args.json).write_text(json.dumps({
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
