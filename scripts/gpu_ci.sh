#!/usr/bin/env bash
# GPU CI: the one command a lent GPU runs, in 9 minutes on an H200.
#
#   OUT=/some/dir scripts/gpu_ci.sh        # or: scripts/gpu_ci.sh /some/dir
#
# On the device tool's machine (nothing can be downloaded there; prepare here first with
# scripts/gpu_prepare.sh, which writes .whl/ and .gpu_assets/), in one call: a session has
# 15 minutes of device time in all, the machine's start (1-2 minutes) and idle waits
# included, so one call of the default 9-minute budget leaves room to rerun a step:
#   run(command="GPU_CI_WORK=/tmp/gpu-ci GPU_CI_STEPS=kernel-tests,engine-tests,moe-bench,
#       structured,kernel-bench,e2e-throughput,moe-sweep scripts/gpu_ci.sh",
#       carry=[".whl", ".gpu_assets"], timeout_s=600)
# The compile grid is left out there: Triton's wheel carries its own ptxas, so the grid
# compiled here under the GPU image's Triton (3.6) gives the same cubins; `make test`
# and tests/kernels/test_compile.py run it on any machine.
# (Step names: compile-grid kernel-tests engine-tests moe-bench structured kernel-bench
# e2e-throughput moe-sweep e2e-tp; GPU_CI_STEPS unset runs them all.)
#
# Steps (each capped, and every cap cut to what is left of GPU_CI_BUDGET seconds, 540 by
# default, so the summary is always written; a step that runs out of time is a failure,
# never a silent skip):
#   0. wheels carried in .whl/ (xgrammar, gguf, jsonschema, ... that the GPU image lacks)
#      installed into a scratch folder on PYTHONPATH
#   1. environment: GPU, torch, triton, pytest; stops at once with a clear message
#   2. compile grid (background, CPU only): every kernel configuration AOT-compiled for
#      sm_80 and sm_90: compile errors, shared memory, register spills
#   3. kernel tests on the GPU (compiled Triton kernels vs the torch reference)
#   4. engine tests on CUDA (compiled kernels, CUDA graphs, memory-sized KV cache)
#   5. the fused MoE layer vs a per-expert loop of torch matmuls (benchmarks/bench_moe.py)
#   6. structured output cost (benchmarks/bench_structured.py): a JSON-schema batch of 64
#      against the same batch unconstrained, overlap on and off, on a random-weight model
#      of SmolLM2-135M's shapes with SmolLM2's real tokenizer (.gpu_assets/; without it a
#      small BPE, whose masks are cheaper than a real vocabulary's)
#   7. kernel benchmarks vs SDPA, FlexAttention (GPU_CI_FLEX=0 leaves it out: each shape
#      costs a compile) and flash-attn (where installed); layer ops and sampling; the GGUF
#      matmuls per block type against the copy bandwidth and a dense bf16 matmul
#   8. end-to-end throughput, nano-vllm's workload (256 requests, 100-1024 tokens in and
#      out) on a random-weight model of Qwen3-0.6B's shapes, with overlapped scheduling
#      on (the CUDA default) and off
#   9. MoE GEMM tile sweep (benchmarks/bench_moe_sweep.py): the rule's tiles against their
#      neighbours at the MoE targets' shapes, in the time the budget leaves
# Then it prints one table. Everything goes under $WORK (GPU_CI_WORK, default $OUT):
# logs/ (step logs, junit xml, compile table) and results/ (markdown + json that can be
# committed to benchmarks/results/ as they are). When GPU_CI_WORK is set apart from $OUT,
# $OUT gets only summary.md and gpu-ci.tar.gz (logs/ + results/, rewritten after every
# step, so a run cut short still brings back what it did): the device tool brings back 8
# files at most.
#
# Expected time on an H200 box (16 cores), estimated from CPU measurements (not yet timed
# on the GPU); the caps in brackets, each cut to what the budget leaves:
#   wheels ~5 s | env ~5 s | compile grid ~110-170 s (~1450 kernels), in the background
#   [300 s] | kernel tests ~60-100 s [180 s] | engine tests ~40-80 s (one builds a
#   Qwen3-0.6B-shaped model) [150 s] | MoE ~30-50 s [90 s] | structured ~40-80 s [150 s,
#   its table rewritten after each round] | attention benchmarks ~60-100 s + layer ops and
#   sampling ~15 s + GGUF matmuls ~30-50 s (24 cases, 24 compiles) [200 s] | e2e, two runs ~100-180 s [180 s, each run's files kept as it
#   ends] | MoE sweep, what is left [<= 150 s]  =>  about 5-9 minutes without the sweep.
#   The steps run in that order, so a run cut by the budget loses the e2e runs and the
#   sweep first, never the tests or the MoE and structured-output targets.
#
# Does not assume the repo's venv: the GPU machine has torch + triton system-wide
# ($PYTHON, else python / python3 from PATH). Exit status: 0 when every step passed.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
OUT="${1:-${OUT:-}}"
if [ -z "$OUT" ]; then
    echo "gpu_ci.sh: name a results folder: OUT=/path/to/results scripts/gpu_ci.sh" \
         "(or pass it as the first argument)" >&2
    exit 2
fi
# Results files stamp $GIT_COMMIT where there is no .git (the device machine): the commit
# gpu_prepare.sh recorded, marked "+changed" when this tree is no longer the one it saw.
if [ -z "${GIT_COMMIT:-}" ] && ! git rev-parse HEAD >/dev/null 2>&1; then
    GIT_COMMIT=$("$PY" scripts/tree_fingerprint.py label 2>/dev/null || echo unknown)
    export GIT_COMMIT
fi
WORK="${GPU_CI_WORK:-$OUT}"
mkdir -p "$OUT" "$WORK/logs" "$WORK/results" \
    || { echo "gpu_ci.sh: cannot create $OUT or $WORK" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
WORK=$(cd "$WORK" && pwd)
export OUT WORK
BUDGET=${GPU_CI_BUDGET:-540}
T0=$SECONDS
# GPU_CI_STEPS: a comma-separated subset of the steps below (default: all), e.g. to rerun
# one step that failed, on the machine still warm.
STEPS="${GPU_CI_STEPS:-all}"
selected() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }

# pack: when $WORK is not $OUT, bring logs/ + results/ into $OUT as one file (the device
# tool brings back 8 files at most), with the summary beside it once there is one.
pack() {
    [ "$WORK" = "$OUT" ] && return 0
    # Exit status 1: a file changed while read (the background compile grid's log).
    tar -czf "$OUT/gpu-ci.tar.gz.part" -C "$WORK" logs results 2>/dev/null
    [ $? -le 1 ] && mv -f "$OUT/gpu-ci.tar.gz.part" "$OUT/gpu-ci.tar.gz"
    [ -f "$WORK/summary.md" ] && cp -f "$WORK/summary.md" "$OUT/summary.md"
    return 0
}

# --- 0. wheels carried from the developer's machine -------------------------------------
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    SITE="${TMPDIR:-/tmp}/deepinfer-gpu-site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$REPO"/.whl/*.whl > "$WORK/logs/wheels.log" 2>&1; then
        cat "$WORK/logs/wheels.log" >&2
        echo "gpu_ci.sh: the wheels in .whl/ do not install (see above)" >&2
        exit 1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# --- 1. environment: fail fast -------------------------------------------------------
if ! "$PY" - > "$WORK/logs/env.json" 2> "$WORK/logs/env.err" <<'PYEOF'
import json, sys
try:
    import torch
except Exception as e:
    sys.exit(f"gpu_ci.sh: torch cannot be imported ({e})")
try:
    import triton
except Exception as e:
    sys.exit(f"gpu_ci.sh: triton cannot be imported ({e})")
try:
    import pytest  # noqa: F401
except Exception as e:
    sys.exit(f"gpu_ci.sh: pytest cannot be imported ({e}); pip install pytest")
if not torch.cuda.is_available():
    sys.exit(f"gpu_ci.sh: CUDA is not available (torch {torch.__version__}, "
             f"built for CUDA {torch.version.cuda}); this script needs a GPU")
major, minor = torch.cuda.get_device_capability()
if major < 8:
    sys.exit(f"gpu_ci.sh: {torch.cuda.get_device_name()} is sm_{major}{minor}; the kernels "
             "and CUDA graphs are tuned and tested for sm_80+")
tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
if tv < (3, 6):
    sys.exit(f"gpu_ci.sh: triton {triton.__version__} is older than 3.6 (the oldest "
             "the kernels are compiled and checked with)")
try:
    import flash_attn
    fa = flash_attn.__version__
except Exception:
    fa = None
try:
    import xgrammar  # noqa: F401  (it has no __version__: read the installed metadata)
    from importlib.metadata import version
    xg = version("xgrammar")
except Exception:
    xg = None  # the structured-output step fails then; the others run
free, total = torch.cuda.mem_get_info()
print(json.dumps({
    "gpu": torch.cuda.get_device_name(), "capability": f"sm_{major}{minor}",
    "gpu_mem_gib": round(total / 2**30, 1), "gpu_free_gib": round(free / 2**30, 1),
    "python": sys.version.split()[0], "torch": torch.__version__,
    "cuda": torch.version.cuda, "triton": triton.__version__, "flash_attn": fa,
    "xgrammar": xg,
}))
PYEOF
then
    cat "$WORK/logs/env.err" >&2
    pack
    exit 1
fi
"$PY" -c "import json,sys; e=json.load(open(sys.argv[1])); print(' | '.join(f'{k} {v}' for k, v in e.items()))" \
    "$WORK/logs/env.json"
printf 'env\tok\t%d\t0\n' $((SECONDS - T0)) > "$WORK/logs/steps.tsv"

# The repo's pytest config passes --benchmark-disable; without the plugin that flag would
# be an error, so fall back to plain options.
if "$PY" -c "import pytest_benchmark" >/dev/null 2>&1; then
    BASE_OPTS=(-p no:cacheprovider)
else
    BASE_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
fi
unset TRITON_INTERPRET  # compiled kernels, never the interpreter
# xgrammar's tvm-ffi would otherwise try to build its torch DLPack extension at import
# (a compiler run, and nothing can be downloaded there); the plain DLPack path is enough.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
# deepinfer is not installed there: its import names (kernels/ is deepinfer_kernels,
# scheduler/ deepinfer_scheduler) come from a folder of links to the working tree, so the
# steps run the tree as it is. The repo root stays on the path for tests/ and
# benchmarks/; its kernels/ folder, found there as "kernels", stands aside for
# HuggingFace's (kernels/__init__.py).
LINKS="${TMPDIR:-/tmp}/deepinfer-gpu-links"
bash "$REPO/scripts/link_import_names.sh" "$LINKS" "$REPO"
export PYTHONPATH="$LINKS:$REPO${PYTHONPATH:+:$PYTHONPATH}"
NCPU=$(nproc 2>/dev/null || echo 8)

# step NAME CAP_SECONDS CMD...: run with a time cap (SIGINT first, so pytest still writes
# its report), log to logs/NAME.log, append "name status seconds rc" to logs/steps.tsv.
# The cap is cut to what is left of the budget (30 s kept for the summary); a step with
# less than 10 s left does not start and counts as a timeout.
step() {
    local name=$1 cap=$2
    shift 2
    selected "$name" || return 0
    local left=$((BUDGET - (SECONDS - T0) - 30))
    [ "$left" -lt "$cap" ] && cap=$left
    local t=$SECONDS rc status
    if [ "$cap" -lt 10 ]; then
        echo "== $name: not started, the budget of ${BUDGET}s is spent =="
        rc=124
        status="not run (budget ${BUDGET}s spent)"
    else
        echo "== $name (cap ${cap}s) =="
        timeout -s INT -k 10 "$cap" "$@" > "$WORK/logs/$name.log" 2>&1
        rc=$?
        case $rc in
            0) status=ok ;;
            124|137) status="timeout (${cap}s)" ;;
            *) status="FAIL (rc $rc)" ;;
        esac
        tail -n 3 "$WORK/logs/$name.log"
    fi
    printf '%s\t%s\t%d\t%d\n' "$name" "$status" $((SECONDS - t)) "$rc" >> "$WORK/logs/steps.tsv"
    pack
    return 0
}

# --- 2. compile grid, in the background (CPU only; half the cores) ----------------------
COMPILE_PID=
if selected compile-grid; then
    COMPILE_JOBS=$(( NCPU > 4 ? NCPU / 2 : 2 ))
    echo "== compile-grid (background, $COMPILE_JOBS jobs) =="
    (
        t=$SECONDS
        DEEPINFER_COMPILE_FULL=1 DEEPINFER_COMPILE_JOBS=$COMPILE_JOBS \
        DEEPINFER_COMPILE_OUT="$WORK/logs/compile" \
            timeout -s INT -k 10 300 "$PY" -m pytest "${BASE_OPTS[@]}" tests/kernels/test_compile.py \
            -q --junitxml="$WORK/logs/compile-grid.xml" > "$WORK/logs/compile-grid.log" 2>&1
        echo "$? $((SECONDS - t))" > "$WORK/logs/compile-grid.rc"
    ) &
    COMPILE_PID=$!
fi

# --- 3-6 --------------------------------------------------------------------------------
# Most of the kernel tests' time is Triton compiling each configuration they use: spread
# over workers (a file to a worker, so a file's configurations compile once) where
# pytest-xdist is installed (the GPU image has it); the compile grid has the other cores.
KTEST_OPTS=()
if "$PY" -c "import xdist" >/dev/null 2>&1; then
    KTEST_OPTS=(-n "$(( NCPU > 12 ? 6 : 2 ))" --dist loadfile)
fi
step kernel-tests 180 "$PY" -m pytest "${BASE_OPTS[@]}" "${KTEST_OPTS[@]}" tests/kernels -q \
    --durations=10 --ignore=tests/kernels/test_compile.py \
    --junitxml="$WORK/logs/kernel-tests.xml"

step engine-tests 150 "$PY" -m pytest "${BASE_OPTS[@]}" tests/engine/test_cuda_engine.py \
    tests/engine/test_llm.py tests/structured/test_token_mask.py -q -k "cuda or tiny" \
    --junitxml="$WORK/logs/engine-tests.xml"

step moe-bench 90 env DEEPINFER_BENCH_OUT="$WORK/results" "$PY" -m pytest \
    "${BASE_OPTS[@]}" benchmarks/bench_moe.py -q -s

# Structured output's cost at batch 64: SmolLM2-135M's shapes, random weights (no model
# can be downloaded there and the GGUF is too big to carry), SmolLM2's real tokenizer when
# scripts/gpu_prepare.sh put it in .gpu_assets/ (the masks' cost depends on the vocabulary).
SMOL_DIR="${TMPDIR:-/tmp}/deepinfer-smollm2-135m-random"
SMOL_TOKENIZER="$REPO/.gpu_assets/smollm2-tokenizer"
structured() {
    local tok=()
    [ -f "$SMOL_TOKENIZER/tokenizer_config.json" ] && tok=(--tokenizer "$SMOL_TOKENIZER")
    [ -f "$SMOL_DIR/config.json" ] || "$PY" -m deepinfer.testing.random_model --preset smollm2-135m \
        "${tok[@]}" --out "$SMOL_DIR" || return 1
    # --save-to: the table is rewritten after each round, so a cut run keeps its rounds.
    "$PY" benchmarks/bench_structured.py --model "$SMOL_DIR" --batch 64 --reps 3 \
        --save-to "$WORK/results" || return 1
}
export -f structured
export PY SMOL_DIR SMOL_TOKENIZER
step structured 150 bash -c structured

step kernel-bench 200 env DEEPINFER_BENCH_OUT="$WORK/results" \
    DEEPINFER_BENCH_FLEX="${GPU_CI_FLEX:-1}" "$PY" -m pytest "${BASE_OPTS[@]}" \
    benchmarks/bench_kernels.py benchmarks/bench_layer_ops.py benchmarks/bench_sampling.py \
    benchmarks/bench_quant_kernels.py -q -s

# nano-vllm's workload scale on a random-weight model of Qwen3-0.6B's shapes (weights
# cannot be downloaded there; only the shapes matter for speed).
MODEL_DIR="${TMPDIR:-/tmp}/deepinfer-qwen3-0.6b-random"
e2e() {
    [ -f "$MODEL_DIR/config.json" ] \
        || "$PY" -m deepinfer.testing.random_model --preset qwen3-0.6b --out "$MODEL_DIR" || return 1
    "$PY" benchmarks/bench_throughput.py --model "$MODEL_DIR" --num-requests 256 \
        --min-len 100 --max-len 1024 --no-hf --name throughput-cuda || return 1
    cp benchmarks/results/throughput-cuda.json benchmarks/results/throughput-cuda.md \
        "$WORK/results/"
    # The same with the plain loop: what overlapped scheduling buys.
    "$PY" benchmarks/bench_throughput.py --model "$MODEL_DIR" --num-requests 256 \
        --min-len 100 --max-len 1024 --no-hf --no-async-scheduling \
        --name throughput-cuda-sync || return 1
    cp benchmarks/results/throughput-cuda-sync.json benchmarks/results/throughput-cuda-sync.md \
        "$WORK/results/"
}
export -f e2e
export PY MODEL_DIR
step e2e-throughput 180 bash -c e2e

# The MoE GEMM's tiles around the rule's, in what the budget leaves (tuning data for when
# a target is missed); the sweep stops itself in time to write its files.
SWEEP_SECONDS=$(( BUDGET - (SECONDS - T0) - 60 ))
[ "$SWEEP_SECONDS" -gt 120 ] && SWEEP_SECONDS=120
step moe-sweep $(( SWEEP_SECONDS + 30 )) "$PY" benchmarks/bench_moe_sweep.py \
    --out "$WORK/results" --max-seconds "$SWEEP_SECONDS"

# Tensor parallelism needs a GPU per rank (NCCL refuses two ranks on one GPU): with one
# GPU the TP layers run at size 1 inside the runs above; with two or more, --tp 1 vs 2.
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    e2e_tp() {
        "$PY" benchmarks/bench_throughput.py --model "$MODEL_DIR" --tp 2 \
            --num-requests 256 --min-len 100 --max-len 1024 --name throughput-tp-cuda \
            && cp benchmarks/results/throughput-tp-cuda.* "$WORK/results/"
    }
    export -f e2e_tp
    step e2e-tp 200 bash -c e2e_tp
fi

# The compile grid had the whole run to finish; its own timeout bounds this wait.
if [ -n "$COMPILE_PID" ]; then
    wait "$COMPILE_PID"
    read -r crc csecs < "$WORK/logs/compile-grid.rc" 2>/dev/null || { crc=1; csecs=0; }
    case $crc in
        0) cstatus=ok ;;
        124|137) cstatus="timeout (300s)" ;;
        *) cstatus="FAIL (rc $crc)" ;;
    esac
    tail -n 3 "$WORK/logs/compile-grid.log"
    printf 'compile-grid\t%s\t%d\t%d\n' "$cstatus" "$csecs" "$crc" >> "$WORK/logs/steps.tsv"
    [ -f "$WORK/logs/compile/compile-check.md" ] && cp "$WORK/logs/compile/compile-check.md" \
        "$WORK/results/compile-check.md"
fi

# --- summary: one table --------------------------------------------------------------------
GPU_CI_SECONDS=$((SECONDS - T0)) BUDGET=$BUDGET "$PY" - <<'PYEOF'
import glob, json, math, os, re, subprocess, datetime as dt
import xml.etree.ElementTree as ET

out = os.environ["WORK"]
logs, results = os.path.join(out, "logs"), os.path.join(out, "results")
env = json.load(open(os.path.join(logs, "env.json")))


def junit(name):
    path = os.path.join(logs, f"{name}.xml")
    if not os.path.exists(path):
        return ""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return f"{n - f - e - s} passed, {f + e} failed, {s} skipped"


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def bench_headline():
    return (attention_headline() + layer_ops_headline() + sampling_headline()
            + quant_headline()).lstrip("; ")


def attention_headline():
    files = [f for f in glob.glob(os.path.join(results, "kernels-*.json"))]
    if not files:
        return ""
    rows = json.load(open(files[0]))["results"]
    parts = []
    for op in ("decode", "prefill"):
        for base in ("sdpa-flash", "sdpa-default", "flex", "flash-attn"):
            g = geomean([r.get("triton_speedup") for r in rows
                         if r["op"] == op and r["impl"] == base])
            if g:
                parts.append(f"{op} {g:.2f}x vs {base}")
    return ("Triton speedup (baseline ms / Triton ms, geomean): " + ", ".join(parts)
            if parts else "no baseline ran")


def moe_headline():
    files = [f for f in glob.glob(os.path.join(results, "moe-*.json"))
             if not os.path.basename(f).startswith("moe-sweep-")]
    if not files:
        return ""
    rows = json.load(open(files[0]))["results"]
    parts = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        at256 = [r.get("speedup_of_triton-fused") for r in mine
                 if r["tokens"] == 256 and r["impl"] == "torch-per-expert-loop"]
        bw = [r["bw_frac"] for r in mine
              if r["impl"] == "triton-fused" and r["tokens"] <= 16 and "bw_frac" in r]
        if at256 and at256[0]:
            parts.append(f"{model} {at256[0]:.1f}x vs loop at M=256"
                         + (f", weight-read bw {min(bw):.0%}-{max(bw):.0%} of copy at M<=16"
                            if bw else ""))
    return ", ".join(parts)


def fused_headline(prefix, label, describe):
    """'; <label>: <describe(row)>, ...' over the rows of <prefix>-*.json that were timed
    fused (only a GPU run times the Triton side)."""
    files = glob.glob(os.path.join(results, prefix + "-*.json"))
    if not files:
        return ""
    rows = [r for r in json.load(open(files[0]))["results"] if "speedup" in r]
    parts = [describe(r) for r in rows]
    parts = [p for p in parts if p]
    return (f"; {label}: " + ", ".join(parts)) if parts else ""


def layer_ops_headline():
    return fused_headline(
        "layer-ops", "layer elementwise chain fused vs torch",
        lambda r: (f"{r['speedup']:.1f}x at {r['tokens']} tokens ({r['bw_frac']:.0%} of "
                   "copy bw)") if r["op"] == "layer chain" else "")


def sampling_headline():
    return fused_headline("sampling", "temperature sampling fused vs torch",
                          lambda r: f"{r['speedup']:.1f}x at {r['rows']}x{r['vocab']}")


def quant_headline():
    """'; GGUF matmul (<n> types): M=1 weight-read bw a-b% of copy, M=256 x-y the speed
    of dense bf16' over the rows of bench_quant_kernels's file."""
    files = glob.glob(os.path.join(results, "quant-kernels-*.json"))
    if not files:
        return ""
    rows = json.load(open(files[0]))["results"]
    bw = [r["bw_frac"] for r in rows if r["M"] == 1]
    gemm = [r["dense_over_gguf"] for r in rows if r["M"] == 256]
    parts = []
    if bw:
        parts.append(f"M=1 weight-read bw {min(bw):.0%}-{max(bw):.0%} of copy")
    if gemm:
        parts.append(f"M=256 {min(gemm):.2f}-{max(gemm):.2f}x the speed of dense bf16")
    types = len({r["type"] for r in rows})
    return (f"; GGUF matmul ({types} types): " + ", ".join(parts)) if parts else ""


def compile_headline():
    path = os.path.join(logs, "compile", "compile-check.json")
    if not os.path.exists(path):
        return junit("compile-grid")
    data = json.load(open(path))
    rs = [r for r in data["results"] if "canary" not in r["case"]]
    regs = max((r["regs"] for r in rs), default=0)
    shared = max((r["shared"] for r in rs), default=0)
    return (f"{len(rs)} kernels (sm_80 + sm_90), {len(data['failing'])} failing cases; "
            f"max {regs} registers, max {shared} B shared; " + junit("compile-grid"))


def e2e_headline():
    parts = []
    for name, label in (("throughput-cuda", "overlap on"),
                        ("throughput-cuda-sync", "overlap off")):
        path = os.path.join(results, name + ".json")
        if os.path.exists(path):
            d = json.load(open(path))["deepinfer"]
            parts.append(f"{label}: {d['tok_per_s']:.0f} tok/s ({d['tokens']} tokens in "
                         f"{d['seconds']:.1f}s)")
    return "; ".join(parts)


def structured_headline():
    path = os.path.join(results, "structured-cuda.json")
    if not os.path.exists(path):
        return ""
    d = json.load(open(path))
    modes = d["modes"]
    base = modes["unconstrained"]["tok_s"]
    cost = 1 - modes["constrained"]["tok_s"] / base
    text = (f"batch {d['batch']}: constrained {modes['constrained']['tok_s']:.0f} vs "
            f"unconstrained {base:.0f} tok/s ({cost:+.1%} cost; target <= 10%)")
    off = modes.get("constrained, no overlap")
    if off:
        text += f"; constrained without overlap {off['tok_s']:.0f} tok/s"
    one = modes.get("constrained, 1 fill thread")
    if one:
        text += f"; with 1 mask-fill thread {one['tok_s']:.0f} tok/s"
    return text + f"; {d['valid_outputs']}/{d['batch']} valid JSON"


def sweep_headline():
    files = glob.glob(os.path.join(results, "moe-sweep-*.json"))
    if not files:
        return ""
    d = json.load(open(files[0]))
    worst = max((x for x in d["summary"] if x["rule_over_best"]),
                key=lambda x: x["rule_over_best"], default=None)
    text = f"{len(d['results'])} configurations" + ("" if d["meta"]["complete"] else " (cut)")
    if worst:
        text += (f"; rule / best at most {worst['rule_over_best']:.2f}x ({worst['model']} "
                 f"M={worst['tokens']} {worst['gemm']})")
    return text


headlines = {
    "env": f"{env['gpu']} ({env['capability']}), torch {env['torch']}, CUDA {env['cuda']}, "
           f"triton {env['triton']}, flash-attn {env['flash_attn'] or 'not installed'}",
    "compile-grid": compile_headline(),
    "kernel-tests": junit("kernel-tests"),
    "engine-tests": junit("engine-tests"),
    "moe-bench": moe_headline(),
    "kernel-bench": bench_headline(),
    "e2e-throughput": e2e_headline(),
    "structured": structured_headline(),
    "moe-sweep": sweep_headline(),
}
steps = [line.rstrip("\n").split("\t") for line in open(os.path.join(logs, "steps.tsv"))]
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=10).stdout.strip()
except Exception:
    commit = ""
if not commit:  # the device machine gets the tree without .git: gpu_prepare.sh's record
    commit = os.environ.get("GIT_COMMIT", "unknown")
date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
total = int(os.environ.get("GPU_CI_SECONDS", "0"))
lines = [f"# GPU CI: {env['gpu']}", "",
         f"commit `{commit}`, {date}, total {total} s (budget {os.environ.get('BUDGET', '?')} s)", "",
         "| step | status | seconds | result |", "|---|---|---:|---|"]
for name, status, secs, _rc in steps:
    lines.append(f"| {name} | {status} | {secs} | {headlines.get(name, '')} |")
lines += ["", "Files: " + ", ".join(sorted(os.path.basename(p)
                                        for p in glob.glob(os.path.join(results, "*"))))]
md = "\n".join(lines) + "\n"
slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
for path in (os.path.join(out, "summary.md"), os.path.join(results, f"gpu-ci-{slug}.md")):
    open(path, "w").write(md)
print("\n" + md)
PYEOF
pack

awk -F'\t' '$2 != "ok" { bad = 1 } END { exit bad }' "$WORK/logs/steps.tsv"
