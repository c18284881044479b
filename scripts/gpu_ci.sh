#!/usr/bin/env bash
# GPU CI: the one command a lent GPU runs, planned to fit one device call.
#
#   scripts/gpu_ci.sh --plan                 # the plan only (steps, caps, order); no GPU
#   OUT=/some/dir scripts/gpu_ci.sh          # or: scripts/gpu_ci.sh /some/dir
#
# On the device tool's machine nothing can be downloaded: prepare here first with
# scripts/gpu_prepare.sh (it writes .whl/ and .gpu_assets/), then in one call:
#   run(command="GPU_CI_WORK=/tmp/gpu-ci scripts/gpu_ci.sh $OUT",
#       carry=[".whl", ".gpu_assets"], timeout_s=600)
# A session has 15 minutes of device time in all, the machine's start (1-2 minutes) and
# idle waits included: the default plan (GPU_CI_BUDGET, 500 s) leaves one call's worth for
# the start, and the extra steps go in a second call if time is left, e.g.
#   GPU_CI_STEPS=moe-bench,structured,engine-slow scripts/gpu_ci.sh $OUT
#
# The plan (caps in seconds; `--plan` prints it with the total):
#   default, in this order (tests first, then the headline benchmarks):
#     kernel-tests    compiled Triton kernels vs the torch reference (tests/kernels)
#     engine-tests    CUDA engine: graphs, overlap, no host syncs in a launch, memory-sized
#                     KV cache (the @slow Qwen3 test has its own step)
#     kernel-bench    attention vs torch SDPA (flash-attn too where installed), layer ops,
#                     sampling, the GGUF matmuls against copy bandwidth and dense bf16
#     e2e-throughput  nano-vllm's workload (256 requests, 100-1024 tokens in and out) on a
#                     random-weight Qwen3-0.6B-shaped model, overlap on and off
#   extra, only when GPU_CI_STEPS names them (each takes a large share of a call):
#     moe-bench       the fused MoE layer vs a per-expert loop of torch matmuls
#     structured      JSON-schema batch of 64 vs the same unconstrained (SmolLM2's shapes and
#                     real tokenizer from .gpu_assets/)
#     engine-slow     the @slow Qwen3-0.6B-shaped engine test (20 graph buckets, 128k prefill)
#     flex-bench      attention vs FlexAttention (a torch.compile per shape: 60-100 s)
#     moe-sweep       the MoE GEMM's tiles against their neighbours
#     e2e-tp          --tp 2 vs --tp 1 (needs two GPUs)
#     compile-grid    every kernel configuration AOT-compiled for sm_80/sm_90 (CPU only, in
#                     the background; `make compile-check` runs it on any machine)
# GPU_CI_STEPS: "all", or a comma-separated list of step names (run in the order above).
#
# Every cap is cut to what is left of the budget (30 s kept for the summary). A step with
# under 10 s left is "skipped (budget)", and one stopped at a cap that the budget cut is
# "skipped (budget, cut at N s)": neither counts as a failure; a step that overruns its
# own cap does. Exit status: 0 when no step failed.
#
# Before anything runs, the setup is checked and the script stops naming what is missing:
# xgrammar, gguf and jsonschema (importable, or wheels in .whl/), and for `structured`
# SmolLM2's tokenizer in .gpu_assets/. Everything goes under $WORK (GPU_CI_WORK, default
# $OUT): logs/ (step logs, junit xml) and results/ (markdown + json for
# benchmarks/results/). With GPU_CI_WORK apart from $OUT, $OUT gets only summary.md and
# gpu-ci.tar.gz (logs/ + results/, rewritten after every step): the device tool brings
# back 8 files at most.
#
# Does not assume the repo's venv: $PYTHON, else `python` where it imports torch, else
# python3 (the GPU image has torch + triton system-wide).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif command -v python >/dev/null 2>&1 && python -c "import torch" >/dev/null 2>&1; then
    PY=python
else
    PY=python3
fi

# --- the plan --------------------------------------------------------------------------
DEFAULT_STEPS="kernel-tests:120 engine-tests:100 kernel-bench:105 e2e-throughput:130"
EXTRA_STEPS="moe-bench:90 structured:150 engine-slow:150 flex-bench:150 moe-sweep:150 e2e-tp:200 compile-grid:300"
SETUP_S=15    # wheels and the environment check (measured 5-10 s)
SUMMARY_S=30
BUDGET=${GPU_CI_BUDGET:-500}
STEPS="${GPU_CI_STEPS:-default}"

PLANNED=()
for entry in $DEFAULT_STEPS $EXTRA_STEPS; do
    name=${entry%%:*}
    case $STEPS in
        default) [[ " $DEFAULT_STEPS " == *" $entry "* ]] && PLANNED+=("$entry") ;;
        all) PLANNED+=("$entry") ;;
        *) [[ ",$STEPS," == *",$name,"* ]] && PLANNED+=("$entry") ;;
    esac
done
if [ "$STEPS" != default ] && [ "$STEPS" != all ]; then
    for name in ${STEPS//,/ }; do
        if [[ " $DEFAULT_STEPS $EXTRA_STEPS " != *" $name:"* ]]; then
            echo "gpu_ci.sh: GPU_CI_STEPS names an unknown step '$name' (steps:" \
                 "$(echo "$DEFAULT_STEPS $EXTRA_STEPS" | sed 's/:[0-9]*//g'))" >&2
            exit 2
        fi
    done
fi
planned() { [[ " ${PLANNED[*]} " == *" $1:"* ]]; }

print_plan() {
    local total=$SETUP_S i=0 entry name cap
    echo "gpu_ci.sh plan: python $PY, budget ${BUDGET}s, steps ${STEPS}"
    printf '  %-3s %-16s %6s\n' "" setup "${SETUP_S}s"
    for entry in "${PLANNED[@]}"; do
        name=${entry%%:*} cap=${entry##*:}
        i=$((i + 1))
        if [ "$name" = compile-grid ]; then
            printf '  %-3s %-16s %6s  (background, CPU only: not counted)\n' "$i." "$name" "${cap}s"
            continue
        fi
        printf '  %-3s %-16s %6s\n' "$i." "$name" "${cap}s"
        total=$((total + cap))
    done
    printf '  %-3s %-16s %6s\n' "" summary "${SUMMARY_S}s"
    total=$((total + SUMMARY_S))
    echo "planned: ${total}s of ${BUDGET}s"
    [ "$total" -gt "$BUDGET" ] && echo "over the budget by $((total - BUDGET))s: the last" \
        "steps would be skipped (budget)"
    return 0
}
if [ "${1:-}" = --plan ]; then
    print_plan
    exit 0
fi

OUT="${1:-${OUT:-}}"
if [ -z "$OUT" ]; then
    echo "gpu_ci.sh: name a results folder: OUT=/path/to/results scripts/gpu_ci.sh" \
         "(or pass it as the first argument; --plan prints the plan)" >&2
    exit 2
fi
WORK="${GPU_CI_WORK:-$OUT}"
mkdir -p "$OUT" "$WORK/logs" "$WORK/results" \
    || { echo "gpu_ci.sh: cannot create $OUT or $WORK" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
WORK=$(cd "$WORK" && pwd)
export OUT WORK
T0=$SECONDS
print_plan | tee "$WORK/logs/plan.txt"

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
fail_setup() {
    echo "$1" | tee "$WORK/logs/setup.err" >&2
    pack
    exit 1
}

# --- setup: what gpu_prepare.sh brings, checked before anything is installed or run -----
missing=()
for mod in xgrammar gguf jsonschema; do
    compgen -G "$REPO/.whl/$mod-*.whl" >/dev/null && continue
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)" \
        >/dev/null 2>&1 && continue
    missing+=("$mod (no wheel in .whl/, not importable by $PY)")
done
SMOL_TOKENIZER="$REPO/.gpu_assets/smollm2-tokenizer"
if planned structured && [ ! -f "$SMOL_TOKENIZER/tokenizer_config.json" ]; then
    missing+=(".gpu_assets/smollm2-tokenizer (SmolLM2's tokenizer, for the structured step)")
fi
if [ ${#missing[@]} -gt 0 ]; then
    fail_setup "$(printf 'gpu_ci.sh: missing setup: %s\n' "${missing[@]}")
run scripts/gpu_prepare.sh on a machine that reaches the package index, then carry .whl and .gpu_assets"
fi

# Results files stamp $GIT_COMMIT where there is no .git (the device machine): the commit
# gpu_prepare.sh recorded, marked "+changed" when this tree is no longer the one it saw.
if [ -z "${GIT_COMMIT:-}" ] && ! git rev-parse HEAD >/dev/null 2>&1; then
    GIT_COMMIT=$("$PY" scripts/tree_fingerprint.py label 2>/dev/null || echo unknown)
    export GIT_COMMIT
fi

# --- wheels carried from the developer's machine -----------------------------------------
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    SITE="${TMPDIR:-/tmp}/deepinfer-gpu-site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$REPO"/.whl/*.whl > "$WORK/logs/wheels.log" 2>&1; then
        cat "$WORK/logs/wheels.log" >&2
        fail_setup "gpu_ci.sh: the wheels in .whl/ do not install (see above)"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# --- environment: fail fast -------------------------------------------------------------
if ! "$PY" scripts/gpu_ci_env.py > "$WORK/logs/env.json" 2> "$WORK/logs/env.err"; then
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
    PYTEST_OPTS="-p no:cacheprovider"
else
    PYTEST_OPTS="-o addopts=-ra -p no:cacheprovider"
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
# Most of the kernel tests' time is Triton compiling each configuration they use: spread
# over workers (a file to a worker, so a file's configurations compile once) where
# pytest-xdist is installed (the GPU image has it).
KTEST_OPTS=""
"$PY" -c "import xdist" >/dev/null 2>&1 && KTEST_OPTS="-n $(( NCPU > 12 ? 6 : 2 )) --dist loadfile"
SMOL_DIR="${TMPDIR:-/tmp}/deepinfer-smollm2-135m-random"
MODEL_DIR="${TMPDIR:-/tmp}/deepinfer-qwen3-0.6b-random"
export PY REPO PYTEST_OPTS KTEST_OPTS SMOL_DIR SMOL_TOKENIZER MODEL_DIR

# --- the steps (each runs as `bash -c step_<name>` under its cap) --------------------------
# shellcheck disable=SC2086  # the option strings split into words on purpose
step_kernel_tests() {
    "$PY" -m pytest $PYTEST_OPTS $KTEST_OPTS tests/kernels -q --durations=10 \
        --ignore=tests/kernels/test_compile.py --junitxml="$WORK/logs/kernel-tests.xml"
}
step_engine_tests() {
    "$PY" -m pytest $PYTEST_OPTS tests/engine/test_cuda_engine.py \
        tests/engine/test_cuda_no_sync.py tests/engine/test_llm.py \
        tests/structured/test_token_mask.py -q -k "cuda or tiny" -m "not slow" \
        --junitxml="$WORK/logs/engine-tests.xml"
}
step_engine_slow() {
    "$PY" -m pytest $PYTEST_OPTS tests/engine/test_cuda_engine.py -q -m slow \
        --junitxml="$WORK/logs/engine-slow.xml"
}
step_kernel_bench() {
    DEEPINFER_BENCH_OUT="$WORK/results" DEEPINFER_BENCH_FLEX=0 "$PY" -m pytest $PYTEST_OPTS \
        benchmarks/bench_kernels.py benchmarks/bench_layer_ops.py \
        benchmarks/bench_sampling.py benchmarks/bench_quant_kernels.py -q -s
}
step_flex_bench() {
    mkdir -p "$WORK/results/flex"
    DEEPINFER_BENCH_OUT="$WORK/results/flex" DEEPINFER_BENCH_FLEX=1 "$PY" -m pytest \
        $PYTEST_OPTS benchmarks/bench_kernels.py -q -s
}
step_moe_bench() {
    DEEPINFER_BENCH_OUT="$WORK/results" "$PY" -m pytest $PYTEST_OPTS benchmarks/bench_moe.py -q -s
}
# Random weights of real models' shapes: no weights can be downloaded there, and only the
# shapes matter for speed (the masks' cost depends on the vocabulary: SmolLM2's real one).
step_structured() {
    [ -f "$SMOL_DIR/config.json" ] || "$PY" -m deepinfer.testing.random_model \
        --preset smollm2-135m --tokenizer "$SMOL_TOKENIZER" --out "$SMOL_DIR" || return 1
    # --save-to: the table is rewritten after each round, so a cut run keeps its rounds.
    "$PY" benchmarks/bench_structured.py --model "$SMOL_DIR" --batch 64 --reps 3 \
        --save-to "$WORK/results"
}
step_e2e_throughput() {
    [ -f "$MODEL_DIR/config.json" ] || "$PY" -m deepinfer.testing.random_model \
        --preset qwen3-0.6b --out "$MODEL_DIR" || return 1
    local name flags
    for name in throughput-cuda throughput-cuda-sync; do
        flags=()
        # The same with the plain loop: what overlapped scheduling buys.
        [ "$name" = throughput-cuda-sync ] && flags=(--no-async-scheduling)
        "$PY" benchmarks/bench_throughput.py --model "$MODEL_DIR" --num-requests 256 \
            --min-len 100 --max-len 1024 --no-hf "${flags[@]}" --name "$name" || return 1
        cp "benchmarks/results/$name.json" "benchmarks/results/$name.md" "$WORK/results/"
    done
}
# The sweep stops itself in time to write its files.
step_moe_sweep() {
    "$PY" benchmarks/bench_moe_sweep.py --out "$WORK/results" \
        --max-seconds $(( STEP_CAP > 60 ? STEP_CAP - 30 : 30 ))
}
# NCCL refuses two ranks on one GPU: with one GPU the TP layers run at size 1 above.
step_e2e_tp() {
    [ -f "$MODEL_DIR/config.json" ] || "$PY" -m deepinfer.testing.random_model \
        --preset qwen3-0.6b --out "$MODEL_DIR" || return 1
    "$PY" benchmarks/bench_throughput.py --model "$MODEL_DIR" --tp 2 --num-requests 256 \
        --min-len 100 --max-len 1024 --name throughput-tp-cuda \
        && cp benchmarks/results/throughput-tp-cuda.* "$WORK/results/"
}
export -f step_kernel_tests step_engine_tests step_engine_slow step_kernel_bench \
    step_flex_bench step_moe_bench step_structured step_e2e_throughput step_moe_sweep step_e2e_tp

# run_step NAME CAP: under the cap cut to what the budget leaves (SIGINT first, so pytest
# still writes its report); log to logs/NAME.log; "name status seconds rc" to steps.tsv.
run_step() {
    local name=$1 cap=$2 cut=0 t=$SECONDS rc status
    local left=$((BUDGET - (SECONDS - T0) - SUMMARY_S))
    [ "$left" -lt "$cap" ] && { cap=$left; cut=1; }
    if [ "$name" = e2e-tp ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
        echo "== $name: skipped, needs two GPUs =="
        rc=0 status="skipped (needs 2 GPUs)"
    elif [ "$cap" -lt 10 ]; then
        echo "== $name: skipped, the budget of ${BUDGET}s is spent =="
        rc=0 status="skipped (budget)"
    else
        echo "== $name (cap ${cap}s) =="
        STEP_CAP=$cap timeout -s INT -k 10 "$cap" bash -c "step_${name//-/_}" \
            > "$WORK/logs/$name.log" 2>&1
        rc=$?
        case $rc in
            0) status=ok ;;
            124|137) if [ "$cut" = 1 ]; then status="skipped (budget, cut at ${cap}s)"
                     else status="timeout (${cap}s)"; fi ;;
            *) status="FAIL (rc $rc)" ;;
        esac
        tail -n 3 "$WORK/logs/$name.log"
    fi
    printf '%s\t%s\t%d\t%d\n' "$name" "$status" $((SECONDS - t)) "$rc" >> "$WORK/logs/steps.tsv"
    pack
}

# The compile grid (CPU only) in the background, on half the cores, bounded by its cap.
COMPILE_PID=
COMPILE_CAP=0
if planned compile-grid; then
    for entry in "${PLANNED[@]}"; do [ "${entry%%:*}" = compile-grid ] && COMPILE_CAP=${entry##*:}; done
    left=$((BUDGET - (SECONDS - T0) - SUMMARY_S))
    [ "$left" -lt "$COMPILE_CAP" ] && COMPILE_CAP=$left
    COMPILE_JOBS=$(( NCPU > 4 ? NCPU / 2 : 2 ))
    echo "== compile-grid (background, $COMPILE_JOBS jobs, cap ${COMPILE_CAP}s) =="
    (
        t=$SECONDS
        DEEPINFER_COMPILE_FULL=1 DEEPINFER_COMPILE_JOBS=$COMPILE_JOBS \
        DEEPINFER_COMPILE_OUT="$WORK/logs/compile" \
            timeout -s INT -k 10 "$COMPILE_CAP" "$PY" -m pytest $PYTEST_OPTS \
            tests/kernels/test_compile.py -q --junitxml="$WORK/logs/compile-grid.xml" \
            > "$WORK/logs/compile-grid.log" 2>&1
        echo "$? $((SECONDS - t))" > "$WORK/logs/compile-grid.rc"
    ) &
    COMPILE_PID=$!
fi

for entry in "${PLANNED[@]}"; do
    [ "${entry%%:*}" = compile-grid ] && continue
    run_step "${entry%%:*}" "${entry##*:}"
done

if [ -n "$COMPILE_PID" ]; then
    wait "$COMPILE_PID"
    read -r crc csecs < "$WORK/logs/compile-grid.rc" 2>/dev/null || { crc=1; csecs=0; }
    case $crc in
        0) cstatus=ok ;;
        124|137) cstatus="timeout (${COMPILE_CAP}s)" ;;
        *) cstatus="FAIL (rc $crc)" ;;
    esac
    tail -n 3 "$WORK/logs/compile-grid.log"
    printf 'compile-grid\t%s\t%d\t%d\n' "$cstatus" "$csecs" "$crc" >> "$WORK/logs/steps.tsv"
    [ -f "$WORK/logs/compile/compile-check.md" ] && cp "$WORK/logs/compile/compile-check.md" \
        "$WORK/results/compile-check.md"
fi

GPU_CI_SECONDS=$((SECONDS - T0)) BUDGET=$BUDGET "$PY" scripts/gpu_ci_summary.py
pack

# Failures: FAIL and timeouts at a step's own cap; budget skips are not.
awk -F'\t' '$2 ~ /^(FAIL|timeout)/ { bad = 1 } END { exit bad }' "$WORK/logs/steps.tsv"
