"""Ahead-of-time compilation of every kernel for sm_80 and sm_90, with no GPU.

The interpreter tests check numerics; these check what only the compiler sees: compile
errors, shared memory over the target's limit, register spills, and 16-bit attention (and
the MoE grouped GEMM) falling off the tensor cores. Launches are planned by the ops' own
``*_launches`` functions (see ``deepinfer_compile_grid.check``, in tools/: the conftest puts
it on sys.path), so a launcher change is covered.

``make test`` compiles a representative subset (about a minute on 2 cores with a cold
Triton cache, seconds with a warm one). The full grid (head_dim x GQA x block size x dtype
x op x target, ~1450 kernels with the MoE, decoder-layer, sampling and GGUF ones) runs with
``DEEPINFER_COMPILE_FULL=1``: ``make compile-check`` and scripts/gpu_ci.sh.
``DEEPINFER_COMPILE_JOBS`` sets its process count; ``DEEPINFER_COMPILE_OUT`` a folder for
its table (markdown) and results (JSON).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from deepinfer_compile_grid import cases as cc_cases  # noqa: E402
from deepinfer_compile_grid import check as cc  # noqa: E402
from deepinfer_compile_grid import report as cr  # noqa: E402

QUICK = cc_cases.quick_cases()
FULL_ENABLED = os.environ.get("DEEPINFER_COMPILE_FULL", "") not in ("", "0")


def _jobs(default: int) -> int:
    return int(os.environ.get("DEEPINFER_COMPILE_JOBS", default))


@pytest.fixture(scope="module")
def quick_results() -> list[cc_cases.KernelResult]:
    return cc.results_from_subprocess(QUICK, jobs=_jobs(min(2, os.cpu_count() or 1)),
                                      timeout=900)


@pytest.fixture(scope="module")
def quick_verdicts(quick_results) -> dict[str, list[str]]:
    return cc.verdicts(QUICK, quick_results)


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.id)
def test_compiles_fits_and_does_not_spill(case: cc_cases.Case, quick_verdicts) -> None:
    assert quick_verdicts[case.id] == []


def test_quick_subset_covers_the_axes() -> None:
    """Every tile configuration (target x element size x head_dim) of prefill and decode,
    both decode paths, store_kv and a copy op are in the subset ``make test`` compiles."""
    for arch in cc_cases.ARCHS:
        prefill = {(c.dtype, c.head_dim) for c in QUICK if c.op == "prefill" and c.arch == arch}
        assert prefill == {(dt, d) for dt in cc_cases.DTYPES for d in (64, 128, 256)}
        ops = {c.op for c in QUICK if c.arch == arch}
        assert {"decode", "decode_split", "store_kv", "clone_blocks"} <= ops
        decode = [c for c in QUICK if c.arch == arch and c.op.startswith("decode")]
        # The decode tile depends on head_dim and element size: every one is compiled.
        assert {(c.dtype == "fp32", c.head_dim) for c in decode} == {
            (wide, d) for wide in (False, True) for d in (64, 128, 256)}
        assert {c.op for c in decode if c.dtype == "fp32"} == {"decode", "decode_split"}
        assert {c.op for c in decode if c.dtype != "fp32"} == {"decode", "decode_split"}
        # The decoder layer's elementwise ops and the sampler's, each on each target.
        assert set(cc_cases.LAYER_OPS) <= ops
        assert set(cc_cases.SAMPLING_OPS) <= ops


def test_case_ids_are_unique() -> None:
    """Results and verdicts are keyed by case id: two cases with one id would share a row."""
    cases = cc_cases.full_cases() + cc_cases.quick_cases() + [cc_cases.spill_canary()]
    ids = [c.id for c in cases]
    assert len(set(ids)) == len({dataclasses.astuple(c) for c in cases})
    assert cc_cases.Case("rms_norm", "sm_90", "bf16", variant="h4096-t256").id == (
        "rms_norm-sm_90-bf16-h4096-t256")
    assert cc_cases.Case("rotary_qk", "sm_80", "fp16", 128, 2, variant="norm").id == (
        "rotary_qk-sm_80-fp16-d128-hq16-hkv8-norm")
    assert cc_cases.Case("sample_tokens", "sm_90", "fp32", variant="v151936-n256").id == (
        "sample_tokens-sm_90-fp32-v151936-n256")


def test_layer_cases_cover_the_shapes() -> None:
    """The full grid plans every hidden size and rotary half width, with and without the
    residual add and the q/k norm; no elementwise op is held to tensor cores."""
    layer = [c for c in cc_cases.full_cases() if c.op in cc_cases.LAYER_OPS]
    assert not any(c.wants_tensor_cores for c in layer)
    flags = {(c.op, launch.kwargs.get("HAS_RESIDUAL"), launch.kwargs.get("HAS_NORM"),
              launch.kwargs.get("BLOCK_H"), launch.kwargs.get("BLOCK_HALF"))
             for c in layer if c.arch == "sm_90" and c.dtype == "bf16"
             for launch in cc_cases.plan(c)}
    assert {f[:3] for f in flags} == {("rms_norm", False, None), ("add_rms_norm", True, None),
                                      ("silu_and_mul", None, None), ("rotary_qk", None, False),
                                      ("rotary_qk", None, True)}
    assert {f[3] for f in flags if f[0] == "rms_norm"} == set(cc_cases.LAYER_HIDDEN)
    assert {f[4] for f in flags if f[0] == "rotary_qk"} == {32, 64, 128}


def test_sampling_cases_cover_the_vocabularies() -> None:
    """The full grid plans ``sample_tokens`` for each vocabulary x fp32/bf16 logits on each
    target: one program per row, no tensor cores expected."""
    cases = [c for c in cc_cases.full_cases() if c.op in cc_cases.SAMPLING_OPS]
    assert {(c.arch, c.dtype, c.variant) for c in cases} == {
        (a, dt, f"v{v}-n256") for a in cc_cases.ARCHS for dt in ("fp32", "bf16")
        for v in (151_936, 49_152, 128_256)}
    assert not any(c.wants_tensor_cores for c in cases)
    for case in cases:
        (launch,) = cc_cases.plan(case)
        logits = launch.args[0]
        assert launch.grid == (256,) and logits.dtype == cc_cases.DTYPES[case.dtype]
        assert logits.shape[1] == int(case.variant[1:].split("-")[0])


def test_planning_matches_the_case() -> None:
    """The planner yields the launches a case names (in-process, meta tensors: no compile):
    split + merge for decode_split, one per state tensor (two) for the state ops."""
    expected = {"decode_split": 2, "zero_states": 2, "clone_states": 2, "moe_gemm": 2,
                "moe_align": 3, "moe_gguf": 2}
    for case in QUICK:
        launches = cc_cases.plan(case)
        assert len(launches) == expected.get(case.op, 1), case.id


def test_moe_cases_cover_every_block_m() -> None:
    """The full grid reaches every BLOCK_M bucket of the MoE GEMM for both model shapes
    and every dtype; the quick subset has the decode and prefill tiles on each target."""
    full = [c for c in cc_cases.full_cases() if c.op == "moe_gemm"]
    seen = {(c.arch, c.dtype, c.variant.split("-")[0], cc_cases.plan(c)[0].kwargs["BLOCK_M"])
            for c in full}
    assert seen == {(a, dt, model, bm) for a in cc_cases.ARCHS for dt in cc_cases.DTYPES
                    for model in cc_cases.MOE_SHAPES for bm in (16, 32, 64, 128)}
    for arch in cc_cases.ARCHS:
        quick = {cc_cases.plan(c)[0].kwargs["BLOCK_M"] for c in QUICK
                 if c.op == "moe_gemm" and c.arch == arch}
        assert quick == {16, 128}
    assert {c.op for c in QUICK} >= {"moe_gemm", "moe_align", "moe_route"}
    # Decode: both N tiles (32 where the grid would leave SMs idle, 64 otherwise).
    decode_n = {launch.kwargs["BLOCK_N"] for c in QUICK if c.op == "moe_gemm"
                for launch in cc_cases.plan(c) if launch.kwargs["BLOCK_M"] == 16}
    assert decode_n == {32, 64}


def test_moe_gguf_cases_cover_every_type_and_block_m() -> None:
    """GGUF experts: the full grid plans both grouped GEMMs for every block type at the
    decode and prefill tiles, and one type through every BLOCK_M bucket and dtype, for
    both model shapes on each target; the quick subset compiles a decode and a prefill
    tile on each target; 16-bit ones must use the tensor cores."""
    full = [c for c in cc_cases.full_cases() if c.op == "moe_gguf"]
    seen = {(c.arch, c.dtype, c.variant.split("-")[1], cc_cases.plan(c)[0].kwargs["BLOCK_M"])
            for c in full}
    assert {t for _, _, t, _ in seen} == {t.lower() for t in cc_cases.GGUF_TYPES}
    assert {(a, t, bm) for a, dt, t, bm in seen if dt == "bf16"} >= {
        (a, t.lower(), bm) for a in cc_cases.ARCHS for t in cc_cases.GGUF_TYPES
        for bm in (16, 128)}
    assert {(a, dt, bm) for a, dt, t, bm in seen if t == "q4_k"} == {
        (a, dt, bm) for a in cc_cases.ARCHS for dt in cc_cases.DTYPES
        for bm in (16, 32, 64, 128)}
    for case in full:
        gate_up, down = cc_cases.plan(case)
        assert gate_up.kwargs["GATED"] and not down.kwargs["GATED"]
        assert case.wants_tensor_cores == (case.dtype != "fp32")
    for arch in cc_cases.ARCHS:
        quick = {cc_cases.plan(c)[0].kwargs["BLOCK_M"] for c in QUICK
                 if c.op == "moe_gguf" and c.arch == arch}
        assert quick == {16, 128}


def test_gguf_cases_cover_every_tile() -> None:
    """The full grid plans both GGUF matmul kernels for every block type x dtype x tile
    (the GEMV's BLOCK_M 1-16, the GEMM's 32/64/128, fp32's 32/64) on each target; the
    quick subset compiles both kernels on each target; a variant whose rows take the
    other kernel is refused."""
    full = [c for c in cc_cases.full_cases() if c.op in cc_cases.GGUF_OPS]
    seen = {(c.arch, c.op, c.dtype, c.variant.split("-")[0],
             cc_cases.plan(c)[0].kwargs["BLOCK_M"]) for c in full}
    tiles = {"gguf_gemv": (1, 2, 4, 8, 16), "gguf_gemm": (32, 64, 128)}
    assert seen == {(a, op, dt, t.lower(), bm) for a in cc_cases.ARCHS for dt in cc_cases.DTYPES
                    for t in cc_cases.GGUF_TYPES for op in tiles for bm in tiles[op]
                    if not (dt == "fp32" and bm == 128)}
    assert {c.op: c.wants_tensor_cores for c in full if c.dtype == "bf16"} == {
        "gguf_gemv": False, "gguf_gemm": True}
    assert {(c.arch, c.op) for c in QUICK if c.op in cc_cases.GGUF_OPS} == {
        (a, op) for a in cc_cases.ARCHS for op in cc_cases.GGUF_OPS}
    with pytest.raises(ValueError, match="17 rows of x do not run the gguf_gemv kernel"):
        cc_cases.plan(cc_cases.Case("gguf_gemv", "sm_90", "bf16", variant="q4_0-m17"))


def test_verdict_rules() -> None:
    """What fails: a compile error, shared memory over the limit, a spill where the engine
    runs (fp32 on sm_80 may spill), a 16-bit attention kernel without tensor-core mma."""
    fp32_80 = cc_cases.Case("prefill", "sm_80", "fp32", 128)
    bf16_80 = cc_cases.Case("prefill", "sm_80", "bf16", 128)
    fp32_90 = cc_cases.Case("prefill", "sm_90", "fp32", 128)
    ok = cc_cases.KernelResult("x", "prefill_kernel", "", regs=200, stack=0, local=0,
                         shared=50_000, tensor_cores=True)

    def problems(case: cc_cases.Case, **changes: object) -> list[str]:
        return dataclasses.replace(ok, **changes).problems(case, cc_cases.ARCHS[case.arch])

    assert problems(bf16_80) == []
    assert problems(fp32_80, stack=96) == []
    assert problems(fp32_90, stack=8)
    assert problems(bf16_80, local=4)
    assert problems(bf16_80, shared=cc_cases.ARCHS["sm_80"].max_shared + 1)
    assert problems(fp32_90, shared=cc_cases.ARCHS["sm_80"].max_shared + 1) == []  # fits sm_90
    assert problems(bf16_80, tensor_cores=False)
    assert problems(fp32_90, tensor_cores=False) == []
    assert problems(bf16_80, error="CompilationError: ...")


def test_parse_res_usage() -> None:
    text = (" Function prefill_kernel:\n  REG:255 STACK:560 SHARED:1024 LOCAL:0 "
            "CONSTANT[0]:640 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert cc.parse_res_usage(text) == {"REG": 255, "STACK": 560, "SHARED": 1024, "LOCAL": 0}


@pytest.mark.slow
@pytest.mark.skipif(not FULL_ENABLED,
                    reason="full compile grid: `make compile-check` (DEEPINFER_COMPILE_FULL=1)")
def test_full_grid() -> None:
    """Every configuration of the grid, plus a canary known to spill (the check must see it)."""
    canary = cc_cases.spill_canary()
    cases = cc_cases.full_cases() + [canary]
    results = cc.results_from_subprocess(cases, jobs=_jobs(os.cpu_count() or 1),
                                         timeout=3600)
    verdicts = cc.verdicts(cases, results)
    canary_problems = verdicts.pop(canary.id)
    failing = {k: v for k, v in verdicts.items() if v}
    out = os.environ.get("DEEPINFER_COMPILE_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "compile-check.md").write_text(cc.markdown_table(cases, results) + "\n")
        Path(out, "compile-check.json").write_text(json.dumps({
            "triton": triton.__version__, "cases": [dataclasses.asdict(c) for c in cases],
            "results": [dataclasses.asdict(r) for r in results], "failing": failing,
        }, indent=1))
    assert any("spills" in p for p in canary_problems), "the spill canary did not spill"
    assert not failing, "\n".join(f"{k}: {p}" for k, v in failing.items() for p in v)


def test_summary_table_folds_the_grid(quick_results) -> None:
    """``deepinfer_compile_grid.report`` gives one row per (kernel, dtype class, config)
    with the register range over its cases for each run; a spill where the engine serves
    the dtype is bold and named below the table, fp32 on sm_80 is not."""
    run = cr.CompileRun(triton.__version__, QUICK, quick_results)
    by_id = {c.id: c for c in QUICK}
    table = cr.summary_table([run])
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    keys = {(r.kernel, "fp32" if by_id[r.case].dtype == "fp32" else "16-bit", r.config or "-")
            for r in quick_results}
    assert len(rows) == len(keys)
    r0 = next(r for r in quick_results if r.kernel == "prefill_kernel"
              and by_id[r.case].arch == "sm_90" and by_id[r.case].dtype == "bf16")
    same = [r.regs for r in quick_results if r.kernel == r0.kernel and r.config == r0.config
            and by_id[r.case].arch == "sm_90" and by_id[r.case].dtype != "fp32"]
    row = next(line for line in rows if f"| `{r0.kernel}` | 16-bit | {r0.config} |" in line)
    regs = f"{min(same)}-{max(same)}" if min(same) != max(same) else str(min(same))
    assert f"| {regs} |" in row
    assert "serves their dtype: 0." in table
    # Two versions side by side: cells "a / b".
    assert f"| {regs} / {regs} |" in cr.summary_table([run, run])

    def spill_one(dtype: str, arch: str) -> str:
        target = next(r for r in quick_results if by_id[r.case].dtype == dtype
                      and by_id[r.case].arch == arch and not r.error)
        results = [dataclasses.replace(r, stack=64) if r is target else r
                   for r in quick_results]
        return cr.summary_table([cr.CompileRun("x", QUICK, results)])

    served = spill_one("bf16", "sm_80")
    assert "**64**" in served and "serves their dtype: 1: `" in served
    allowed = spill_one("fp32", "sm_80")
    assert "**64**" not in allowed and "| 64 |" in allowed and "serves their dtype: 0." in allowed
