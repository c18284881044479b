#!/usr/bin/env bash
# Mutation testing (`make mutate`): mutmut plants small bugs, one at a time, in scheduler/
# and deepinfer/sampling/sampler.py and runs the unit tests that reach each mutated
# function; a mutant no test catches ("survived") is a test gap or an equivalent change.
# Config: [tool.mutmut] in pyproject.toml. Not part of `make test`: minutes, not seconds.
#
#   scripts/mutate.sh                  # fresh run, then the score per target
#   MUTATE_JOBS=8 scripts/mutate.sh    # parallel mutants (default: all cores)
#   MUTATE_RESUME=1 scripts/mutate.sh  # keep mutants/ and re-test only what changed
#   scripts/mutate.sh 'deepinfer_scheduler.state_manager.*'   # only the mutants named
#
# Output: build/mutate/mutants/ (mutmut's work tree and results; `mutmut results` /
# `mutmut show NAME` run from build/mutate browse them) and
# build/mutate/mutants/survivors.txt (every survivor's diff).
#
# mutmut names a mutant by its file's path (scheduler/x.py -> scheduler.x) and matches it
# to the module the tests import (deepinfer_scheduler.x). So it runs in a staging folder,
# build/mutate, where each source folder is laid out under its import name; with mutmut's
# mutants/ first on sys.path, the tests import the mutated copies, not the editable
# install's originals.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
VENV="$(cd "${VENV:-.venv}" && pwd)"
MUTMUT="$VENV/bin/mutmut"
[ -x "$MUTMUT" ] || { echo "mutate.sh: $MUTMUT missing: run make mutate" >&2; exit 2; }
STAGE="$ROOT/build/mutate"

# One intra-op thread per mutant: the mutants already run in parallel, and OpenMP pools
# don't survive mutmut's fork.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[ "${MUTATE_RESUME:-0}" = 1 ] || rm -rf "$STAGE/mutants"
mkdir -p "$STAGE"
rm -rf "$STAGE/deepinfer" "$STAGE/deepinfer_scheduler" "$STAGE/deepinfer_kernels" "$STAGE/tests"
cp -r deepinfer tests pyproject.toml "$STAGE/"
cp -r scheduler "$STAGE/deepinfer_scheduler"
cp -r kernels "$STAGE/deepinfer_kernels"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
cd "$STAGE"
start=$(date +%s)
# The same hypothesis examples every run (tests/conftest.py: CI profile), so a mutant's
# verdict does not depend on the draw.
export CI="${CI:-1}"
if [ -t 1 ]; then
    "$MUTMUT" run --max-children "${MUTATE_JOBS:-$(nproc)}" "$@"
else
    # Not a terminal (make mutate > log, CI): drop the spinner frames, keep the last one.
    "$MUTMUT" run --max-children "${MUTATE_JOBS:-$(nproc)}" "$@" 2>&1 | tr '\r' '\n' |
        LC_ALL=C awk '/^\xe2[\xa0-\xa3]/ { last = $0; next } NF { print } END { print last }'
fi
echo "mutmut run: $(( $(date +%s) - start )) s"
"$VENV/bin/python" "$ROOT/scripts/mutate_report.py"
