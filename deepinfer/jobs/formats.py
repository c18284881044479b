"""Which input format a job reads and which output lines it writes: deepinfer's own
(``.txt`` / ``.jsonl``; ``input_records``, ``output_records``) or the OpenAI batch file
format (``openai_batch``), detected from the first line or chosen with ``--format``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from deepinfer.jobs.input_records import InputRecord, read_inputs
from deepinfer.jobs.openai_batch import OpenAIFormat, is_openai_batch, read_openai_inputs
from deepinfer.jobs.output_records import NATIVE
from deepinfer.pooling import PoolingParams

__all__ = ["FORMATS", "NATIVE", "JobInput", "job_format", "model_name", "open_job",
           "warn_other_models"]

FORMATS = ("auto", "native", "openai")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(model: str | None) -> str:
    """The name written in OpenAI response bodies: the model path's last component."""
    if not model:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


class JobInput:
    """The records of an input file, read again, lazily, each time it is iterated: a
    job never holds all of them (``jobs.input_index`` indexes their ids in one pass)."""

    def __init__(self, path: str, openai: bool, pooling: PoolingParams | None = None
                 ) -> None:
        self.path, self.openai, self.pooling = path, openai, pooling
        # Checked now: a missing file or a bad extension is the command line's error.
        next(iter(self), None)

    def __iter__(self) -> Iterator[InputRecord]:
        if self.openai:
            return read_openai_inputs(self.path)
        if self.pooling is None:
            return read_inputs(self.path)
        return self._embedding_records()

    def _embedding_records(self) -> Iterator[InputRecord]:
        """``--embed``: every native record an embedding request."""
        for rec in read_inputs(self.path):
            rec.pooling = self.pooling
            yield rec

    @property
    def kind(self) -> str:
        """``"openai"``, ``"txt"`` or ``"jsonl"``: how each line is parsed."""
        return "openai" if self.openai else ("txt" if self.path.endswith(".txt")
                                             else "jsonl")


def open_job(path: str, fmt: str = "auto", model: str | None = None,
             token_ids: bool = False, pooling: PoolingParams | None = None
             ) -> tuple[JobInput, Any]:
    """The input records of ``path`` (a ``JobInput``) and the output format their lines
    are written in (``NATIVE`` or an ``OpenAIFormat``; ``token_ids``: its logprob tokens
    as ``"token_id:<id>"``). ``pooling`` (``--embed``): every record of a native file is
    embedded with it. Raises ``ValueError`` naming ``--format`` / ``--input`` /
    ``--embed`` when the choice does not fit the file."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    openai = fmt == "openai" or (fmt == "auto" and is_openai_batch(path))
    if openai and pooling is not None:
        raise ValueError(f"--embed: {path!r} is an OpenAI batch file, whose lines say "
                         "what they are (url /v1/embeddings for an embedding)")
    if not openai:
        return JobInput(path, False, pooling), NATIVE
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input {path!r}: no such file")
    return JobInput(path, True), OpenAIFormat((), model_name(model), token_ids)


def job_format(args: Any, model: str | None) -> tuple[JobInput, Any]:
    """``open_job`` with the CLI's parsed ``args`` (``--input``, ``--format``,
    ``--return-tokens-as-token-ids``, ``--embed`` and ``--dimensions``)."""
    pooling = (PoolingParams(dimensions=getattr(args, "dimensions", None))
               if getattr(args, "embed", False) else None)
    return open_job(args.input, getattr(args, "format", "auto"), model,
                    getattr(args, "return_tokens_as_token_ids", False), pooling)


def warn_other_models(models: Iterable[str], path: str, model: str | None) -> None:
    """One warning when lines of an OpenAI batch file name another ``body.model``
    (``models``: the names the lines give): the loaded model serves them all (as vLLM's
    run-batch does)."""
    name = model_name(model)
    # A hub id names the model by its last part, as the loaded path does.
    others = sorted({m for m in models if m and model_name(m) != name})
    if others:
        print(f"deepinfer-generate: warning: {path} names model(s) {others[:3]}; "
              f"every line runs on the loaded model {name!r}", file=sys.stderr)
