#!/usr/bin/env bash
# Mutation testing (`make mutate`): mutmut plants small bugs, one at a time, in scheduler/
# and deepinfer/sampling/sampler.py and runs the unit tests that reach each mutated
# function; a mutant no test catches ("survived") is a test gap or an equivalent change.
# Config: [tool.mutmut] in pyproject.toml. Not part of `make test`: minutes, not seconds.
#
#   scripts/mutate.sh                  # fresh run, then the score per target
#   MUTATE_JOBS=8 scripts/mutate.sh    # parallel mutants (default: all cores)
#   MUTATE_RESUME=1 scripts/mutate.sh  # keep mutants/ and re-test only what changed
#
# Output: mutants/ (mutmut's work tree and results; `mutmut results` / `mutmut show NAME`
# from the repo root browse them) and mutants/survivors.txt (every survivor's diff).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
MUTMUT="$VENV/bin/mutmut"
[ -x "$MUTMUT" ] || { echo "mutate.sh: $MUTMUT missing: run make mutate" >&2; exit 2; }

# One intra-op thread per mutant: the mutants already run in parallel, and OpenMP pools
# don't survive mutmut's fork.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[ "${MUTATE_RESUME:-0}" = 1 ] || rm -rf mutants
start=$(date +%s)
# The same hypothesis examples every run (tests/conftest.py: CI profile), so a mutant's
# verdict does not depend on the draw.
export CI="${CI:-1}"
if [ -t 1 ]; then
    "$MUTMUT" run --max-children "${MUTATE_JOBS:-$(nproc)}"
else
    # Not a terminal (make mutate > log, CI): drop the spinner frames, keep the last one.
    "$MUTMUT" run --max-children "${MUTATE_JOBS:-$(nproc)}" 2>&1 | tr '\r' '\n' |
        LC_ALL=C awk '/^\xe2[\xa0-\xa3]/ { last = $0; next } NF { print } END { print last }'
fi
echo "mutmut run: $(( $(date +%s) - start )) s"
"$VENV/bin/python" scripts/mutate_report.py
