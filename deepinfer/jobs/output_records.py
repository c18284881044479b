"""Output records: one JSON line per finished or failed record, written and flushed one
line at a time.

deepinfer's own format: ``{"id", "outputs": [...]}`` (with ``logprobs`` when asked for)
or ``{"id", "error"}`` (``NATIVE``); the OpenAI batch format has the same methods
(``openai_batch.OpenAIFormat``). A line never holds NaN or infinity (``write_record``).
Error lines are written again when a run is resumed. ``show_result`` is ``--show``'s
view of a finished record.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

from deepinfer.outputs import EmbeddingRequestOutput


def record_text(record: dict[str, Any]) -> tuple[str, bool]:
    """``(JSON text, True)`` of an output record; ``(error line, False)`` when ``record``
    held NaN or infinity: that is a bug upstream (the formats drop what may legitimately
    be infinite), so it is reported on stderr and the record becomes an error line of its
    own format, failing alone, instead of invalid JSON (``-Infinity``) or a dead job."""
    try:
        return json.dumps(record, ensure_ascii=False, allow_nan=False), True
    except ValueError as e:
        message = f"internal error: the result held a non-finite number ({e})"
        print(f"deepinfer-generate: error: record {record.get('id')!r}: {message}",
              file=sys.stderr)
        return json.dumps(_failed_line(record, message), ensure_ascii=False), False


def write_record(out: TextIO, record: dict[str, Any]) -> bool:
    """One JSON line (``record_text``), flushed at once so that a killed run keeps every
    finished record. Returns False when the record had to be written as an error line."""
    line, ok = record_text(record)
    out.write(line + "\n")
    out.flush()
    return ok


def _failed_line(record: dict[str, Any], message: str) -> dict[str, Any]:
    """The error line that replaces an unwritable ``record``, in its format (an OpenAI
    batch line carries ``custom_id``)."""
    if "custom_id" in record:
        return {"id": record.get("id"), "custom_id": record.get("custom_id"),
                "response": None, "error": {"code": "internal_error", "message": message}}
    return error_record(record.get("id"), message)


def error_record(record_id: str, error: str) -> dict[str, Any]:
    """The output line of a record that failed."""
    return {"id": record_id, "error": error}


def result_record(res) -> dict[str, Any]:
    """The output line of one finished request: ``{"id", "embedding"}`` for an
    ``EmbeddingRequestOutput``; for a ``RequestOutput``, ``{"id", "outputs"}``. With logprobs
    asked for, each output also has ``logprobs``: per generated token, its top
    alternatives and the sampled token as ``{"<token id>": logprob}`` (tokens a grammar
    ruled out, at -inf, left out: JSON has no infinity). With ``prompt_logprobs``, the
    record has ``prompt_logprobs``: null for the first prompt token, then per prompt
    token ``{"<token id>": logprob}`` of that token and the top alternatives there."""
    if isinstance(res, EmbeddingRequestOutput):
        return {"id": res.request_id, "embedding": res.outputs.embedding}
    outputs = []
    for o in res.outputs:
        out = {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
        if o.stop_reason is not None:
            out["stop_reason"] = o.stop_reason
        if o.reasoning is not None:
            out["reasoning"] = o.reasoning
        if o.logprobs is not None:
            out["logprobs"] = [_json_logprobs(d) for d in o.logprobs]
        outputs.append(out)
    record = {"id": res.request_id, "outputs": outputs}
    if res.prompt_logprobs is not None:
        record["prompt_logprobs"] = [None if d is None else _json_logprobs(d)
                                     for d in res.prompt_logprobs]
    return record


def _json_logprobs(d: dict[int, float]) -> dict[str, float]:
    return {str(t): float(lp) for t, lp in d.items() if math.isfinite(lp)}


class NativeFormat:
    """Output lines of deepinfer's own format (``result_record`` / ``error_record``);
    results are final (kept on resume), error lines are written again (a repeated id's
    error line must not stand for the record that runs, and a rerun's exit status counts
    every failed record). ``OpenAIFormat`` has the same methods."""

    @staticmethod
    def use_tokenizer(tokenizer: Any) -> None:
        """Nothing to read: native records name tokens by id."""

    @staticmethod
    def track(rec: Any) -> None:
        """Nothing to keep: a native line needs only the result."""

    @staticmethod
    def release(record_id: str) -> None:
        """Nothing kept (``OpenAIFormat.release``)."""

    @staticmethod
    def result(res) -> dict[str, Any]:
        return result_record(res)

    @staticmethod
    def error(record_id: str, message: str) -> dict[str, Any]:
        return error_record(record_id, message)

    @staticmethod
    def final(line: dict[str, Any]) -> bool:
        return "error" not in line


NATIVE = NativeFormat()


def result_text(res: Any) -> str:
    """What ``--show`` prints of a finished request: its first output's text (a
    ``RequestOutput``), or the length and first values of an embedding."""
    if isinstance(res, EmbeddingRequestOutput):
        vec = res.outputs.embedding
        return f"embedding of {len(vec)}: [{', '.join(f'{v:.4f}' for v in vec[:4])}, ...]"
    return res.outputs[0].text


def show_result(record_id: str, prompt: Any, text: str, prefix: str = "") -> None:
    """``--show``: one finished record, printed above the progress bar."""
    tqdm.write(f"{prefix}[{record_id}] {prompt!r}\n  -> {text!r}", file=sys.stdout)
