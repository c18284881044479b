#!/usr/bin/env bash
# GPU CI: compiled Triton kernel tests, kernel benchmarks (saved), the engine's CUDA path
# (graphs, memory sizing) and end-to-end throughput at nano-vllm scale.
#
#   scripts/gpu_ci.sh            # from anywhere; uses $PYTHON or `python` from PATH
#   OUT=/some/dir scripts/gpu_ci.sh   # also put results (json/md, junit xml) into $OUT
#
# Does not assume the repo's venv: the GPU machine has torch + triton system-wide.
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

"$PY" - <<'PYEOF' || exit 1
import sys, torch, triton
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  triton {triton.__version__}")
if not torch.cuda.is_available():
    sys.exit("gpu_ci.sh: CUDA is not available on this machine")
print("device:", torch.cuda.get_device_name())
PYEOF

# The repo's pytest config passes --benchmark-disable; without the plugin that flag would
# be an error, so fall back to plain options.
if "$PY" -c "import pytest_benchmark" >/dev/null 2>&1; then
    BASE_OPTS=()
else
    BASE_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
fi
unset TRITON_INTERPRET  # compiled kernels, never the interpreter

status=0
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
echo "== kernel tests (compiled) =="
"$PY" -m pytest "${BASE_OPTS[@]}" tests/kernels -q --durations=10 \
    --junitxml="${OUT:-${TMPDIR:-/tmp}}/kernels-tests-junit.xml" || status=$?

echo "== kernel benchmarks =="
DEEPINFER_BENCH_SAVE=1 "$PY" -m pytest "${BASE_OPTS[@]}" benchmarks/bench_kernels.py -q \
    || status=$?

echo "== engine on CUDA (compiled kernels, CUDA graphs, memory-sized KV cache) =="
"$PY" -m pytest "${BASE_OPTS[@]}" tests/engine/test_cuda_engine.py tests/engine/test_llm.py -q \
    -k "cuda or tiny" || status=$?

# nano-vllm's workload scale on a random-weight model of Qwen3-0.6B's shapes (weights
# cannot be downloaded there; only the shapes matter for speed).
echo "== end-to-end throughput =="
MODEL_DIR="${TMPDIR:-/tmp}/deepinfer-qwen3-0.6b-random"
[ -d "$MODEL_DIR" ] || "$PY" -m deepinfer.random_model --preset qwen3-0.6b --out "$MODEL_DIR" \
    || status=$?
"$PY" benchmarks/bench_throughput.py --model "$MODEL_DIR" --num-requests 256 --min-len 100 \
    --max-len 1024 --no-hf --name throughput-cuda || status=$?

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp benchmarks/results/kernels-* benchmarks/results/throughput-cuda* "$OUT"/ 2>/dev/null || true
fi

echo "== summary =="
for md in benchmarks/results/kernels-*.md benchmarks/results/throughput-cuda.md; do
    [ -e "$md" ] || continue
    case "$md" in *cpu.md) continue ;; esac
    cat "$md"
done
exit "$status"
