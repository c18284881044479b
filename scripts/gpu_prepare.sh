#!/usr/bin/env bash
# Prepare, on a machine that reaches PyPI, what scripts/gpu_ci.sh needs on a GPU machine
# that reaches nothing (its image has torch, triton, transformers, pytest, but not
# xgrammar, gguf or jsonschema, and no model weights):
#
#   .whl/          wheels for CPython 3.12 on x86-64 Linux, at the versions this venv has:
#                  xgrammar and what it needs that the image lacks, gguf, jsonschema
#   .gpu_assets/   smollm2-tokenizer/: the default model's tokenizer (SmolLM2's 49k vocabulary,
#                  read from the installed GGUF) for the structured-output benchmark's
#                  random-weight model; commit: the commit under test (no .git travels)
#
# Both folders are git-ignored. Then run scripts/gpu_ci.sh with the device tool as its
# header says (carry=[".whl", ".gpu_assets"]; one call, tests then benchmarks) and unpack
# $OUT/gpu-ci.tar.gz (logs/, results/): results/* go to benchmarks/results/.
#
#   scripts/gpu_prepare.sh            # PYTHON=... to use another interpreter than the venv's
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

# What the GPU image lacks (KINDS.md of the device tool lists what it has). typing-extensions
# too: pydantic needs a newer one than the image may hold.
PACKAGES=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
          typing-extensions gguf jsonschema jsonschema-specifications referencing rpds-py)
PINS=$("$PY" - "${PACKAGES[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

pins = []
for name in sys.argv[1:]:
    try:
        pins.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"gpu_prepare.sh: {name} is not installed here; run `make install` first")
print(" ".join(pins))
PYEOF
)
rm -rf .whl
mkdir -p .whl
# shellcheck disable=SC2086  # one word per pin
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $PINS
echo "wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1) in .whl/"

mkdir -p .gpu_assets
"$PY" - <<'PYEOF'
from deepinfer.loading.loader import default_model_path
from deepinfer.tokenizer import load_tokenizer

path = ".gpu_assets/smollm2-tokenizer"
load_tokenizer(default_model_path()).save_pretrained(path)
print(f"tokenizer: {path}")
PYEOF
# The commit, the tracked files and a digest of them: gpu_ci.sh checks the device's tree
# against it (no .git travels), so results are never stamped with a commit they missed.
commit=$("$PY" scripts/tree_fingerprint.py record) || exit 1
echo "commit: $commit"
echo "carry: $(du -shc .whl .gpu_assets | tail -1 | cut -f1) (the device tool carries 64 MiB" \
     "with the working tree)"
