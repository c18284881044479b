#!/usr/bin/env bash
# GPU CI for the kernels: compiled Triton tests, then the kernel benchmarks (saved).
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

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp benchmarks/results/kernels-* "$OUT"/ 2>/dev/null || true
fi

echo "== summary =="
for md in benchmarks/results/kernels-*.md; do
    [ -e "$md" ] || continue
    case "$md" in *cpu.md) continue ;; esac
    cat "$md"
done
exit "$status"
