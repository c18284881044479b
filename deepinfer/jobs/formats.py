"""Which input format a job reads and which output lines it writes: deepinfer's own
(``.txt`` / ``.jsonl``; ``input_records``, ``output_records``) or the OpenAI batch file
format (``openai_batch``), detected from the first line or chosen with ``--format``."""

from __future__ import annotations

import os
import sys
from typing import Any

from deepinfer.jobs.input_records import InputRecord, read_inputs
from deepinfer.jobs.openai_batch import OpenAIFormat, is_openai_batch, read_openai_inputs
from deepinfer.jobs.output_records import NATIVE

__all__ = ["FORMATS", "NATIVE", "job_format", "model_name", "open_job", "warn_other_models"]

FORMATS = ("auto", "native", "openai")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(model: str | None) -> str:
    """The name written in OpenAI response bodies: the model path's last component."""
    if not model:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def open_job(path: str, fmt: str = "auto", model: str | None = None,
             token_ids: bool = False) -> tuple[list[InputRecord], Any]:
    """The input records of ``path`` and the output format their lines are written in
    (``NATIVE`` or an ``OpenAIFormat``; ``token_ids``: its logprob tokens as
    ``"token_id:<id>"``). Raises ``ValueError`` naming ``--format`` / ``--input`` when
    the choice does not fit the file."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    openai = fmt == "openai" or (fmt == "auto" and is_openai_batch(path))
    if not openai:
        return list(read_inputs(path)), NATIVE
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input {path!r}: no such file")
    records = read_openai_inputs(path)
    return records, OpenAIFormat(records, model_name(model), token_ids)


def job_format(args: Any, model: str | None) -> tuple[list[InputRecord], Any]:
    """``open_job`` with the CLI's parsed ``args`` (``--input``, ``--format``,
    ``--return-tokens-as-token-ids``)."""
    return open_job(args.input, getattr(args, "format", "auto"), model,
                    getattr(args, "return_tokens_as_token_ids", False))


def warn_other_models(records: list[InputRecord], path: str, model: str | None) -> None:
    """One warning when lines of an OpenAI batch file name another ``body.model``: the
    loaded model serves them all (as vLLM's run-batch does)."""
    name = model_name(model)
    # A hub id names the model by its last part, as the loaded path does.
    others = sorted({r.model for r in records if r.model and model_name(r.model) != name})
    if others:
        print(f"deepinfer-generate: warning: {path} names model(s) {others[:3]}; "
              f"every line runs on the loaded model {name!r}", file=sys.stderr)
