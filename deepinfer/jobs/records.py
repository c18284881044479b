"""Input records (``.txt`` / ``.jsonl`` lines) and output records (one JSON line each).

Input: ``.txt`` (one prompt per line, blank lines skipped; the id is the line number) or
``.jsonl`` (objects with an optional ``id``, ``prompt`` or ``messages``, and optional
sampling overrides, top level or under ``sampling_params``; structured output as
``structured_outputs`` (``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``,
``{"json": ...}``, ``{"json_object": true}``) or OpenAI's ``response_format``). A bad line
becomes a record with ``error`` set, so that it fails alone. Input files are read as
UTF-8 with an optional BOM; CRLF line ends work; a line that is not UTF-8 fails alone
(``input_lines``). Output: ``{"id", "outputs": [...]}`` (with ``logprobs`` when asked for)
or ``{"id", "error"}``, written and flushed one line at a time; a line never holds NaN or
infinity (``write_record``). Error lines are written again when a run is resumed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TextIO

from tqdm.auto import tqdm

from deepinfer.jobs.input_lines import check_input_file, load_json_line, read_lines
from deepinfer.sampling.params import SamplingParams
from deepinfer.structured import StructuredOutputsParams

SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingParams))
Messages = list[dict[str, str]]


@dataclass
class InputRecord:
    """One input line, parsed; ``error`` set when the line itself is bad."""

    id: str
    prompt: str | None = None
    messages: Messages | None = None
    overrides: dict[str, Any] | None = None
    error: str | None = None
    custom_id: str | None = None  # OpenAI batch format: the line's custom_id
    api: str | None = None  # OpenAI batch format: "chat" or "completion"
    model: str | None = None  # OpenAI batch format: the line's body.model

    @property
    def shown_prompt(self) -> str | Messages | None:
        """What ``--show`` prints as the prompt: the text, or the messages."""
        return self.prompt if self.prompt is not None else self.messages


def read_inputs(path: str) -> Iterator[InputRecord]:
    """Yield one record per non-empty line; the default id is the 1-based line number.
    Raises ``FileNotFoundError`` / ``ValueError`` naming ``--input`` for a missing file, a
    folder or an unknown extension."""
    check_input_file(path)
    is_jsonl = path.endswith((".jsonl", ".json"))
    if not is_jsonl and not path.endswith(".txt"):
        raise ValueError(f"--input {path!r}: expected a .txt or .jsonl file")
    for lineno, line, error in read_lines(path):
        if error is not None:
            yield InputRecord(id=str(lineno), error=error)
        elif not is_jsonl:
            yield InputRecord(id=str(lineno), prompt=line)
        else:
            yield parse_jsonl_line(line, lineno)


def parse_jsonl_line(line: str, lineno: int) -> InputRecord:
    """One ``.jsonl`` line -> a record (``error`` set and naming the line if it is bad).
    The id: the line's ``id`` (a string or an integer), else (absent or null) the line
    number."""
    obj, error = load_json_line(line, lineno)
    if error is not None:
        return InputRecord(id=str(lineno), error=error)
    if not isinstance(obj, dict):
        return InputRecord(id=str(lineno), error=f"line {lineno}: expected a JSON object")
    rid = obj.get("id")
    if rid is None:
        rid = lineno
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return InputRecord(id=str(lineno), error=f"line {lineno}: 'id' must be a string or "
                                                 f"an integer, got {json.dumps(rid)}")
    rid = str(rid)
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        return InputRecord(id=rid, error=f"line {lineno}: needs exactly one of "
                                         "'prompt' or 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        return InputRecord(id=rid, error=f"line {lineno}: 'prompt' must be a string")
    if messages is not None and not (
        isinstance(messages, list)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        return InputRecord(id=rid, error=f"line {lineno}: 'messages' must be a list of "
                                         "{'role', 'content'} objects")
    overrides = obj.get("sampling_params") or {}
    if not isinstance(overrides, dict):
        return InputRecord(id=rid, error=f"line {lineno}: 'sampling_params' must be an "
                                         "object")
    overrides = dict(overrides)
    overrides.update({k: v for k, v in obj.items() if k in SAMPLING_KEYS})
    unknown = set(obj) - SAMPLING_KEYS - {"id", "prompt", "messages", "sampling_params",
                                          "response_format"}
    if unknown:
        return InputRecord(id=rid, error=f"line {lineno}: unknown keys {sorted(unknown)}")
    try:
        structured_overrides(overrides, obj.get("response_format"))
    except ValueError as e:
        return InputRecord(id=rid, error=f"line {lineno}: {e}")
    return InputRecord(id=rid, prompt=prompt, messages=messages, overrides=overrides)


def structured_overrides(overrides: dict[str, Any], response_format: Any) -> None:
    """Turn a line's ``structured_outputs`` object (in ``overrides``) or its
    ``response_format`` into a ``StructuredOutputsParams`` in ``overrides``, in place.
    ``ValueError`` naming the field for a bad value or when both are given."""
    so = overrides.get("structured_outputs")
    if so is not None:
        overrides["structured_outputs"] = StructuredOutputsParams.from_dict(so)
    if response_format is not None:
        if so is not None:
            raise ValueError("give 'structured_outputs' or 'response_format', not both")
        fmt = StructuredOutputsParams.from_response_format(response_format)
        if fmt is not None:
            overrides["structured_outputs"] = fmt


def mark_duplicates(pending: list[InputRecord]) -> None:
    """Turn a repeated id of the input into an error record, so that every rank of a DP
    run agrees on which record of a repeated id runs."""
    seen: set[str] = set()
    for rec in pending:
        if rec.error is None and rec.id in seen:
            rec.error = f"duplicate id {rec.id!r} in the input"
        seen.add(rec.id)


def resolve_record(rec: InputRecord, default_params: SamplingParams, chat: bool
                   ) -> tuple[SamplingParams, str | None, Messages | None]:
    """``(params, prompt, messages)`` of a good record: its sampling overrides applied and,
    with ``chat``, a plain prompt wrapped as one user message. An OpenAI batch line is
    never wrapped: its url decides (``/v1/completions`` is a raw prompt, answered by a
    ``text_completion``). Raises ``ValueError`` for invalid sampling values."""
    sp = default_params.replace(**(rec.overrides or {}))
    if rec.messages is not None or (chat and rec.api is None):
        return sp, None, rec.messages or [{"role": "user", "content": rec.prompt}]
    return sp, rec.prompt, None


def queue_records(records: list[InputRecord], default_params: SamplingParams, chat: bool,
                  out: TextIO, accept: Callable[..., None], fmt: Any = None) -> int:
    """Resolve each record and pass it to ``accept(rec, params, prompt, messages)``; a bad
    record (its line, its sampling values, or a ``ValueError`` from ``accept``) is written
    to ``out`` as an error line of ``fmt`` (default ``NATIVE``) instead. Returns the
    number of error records."""
    fmt = fmt or NATIVE
    failed = 0
    for rec in records:
        error = rec.error
        if error is None:
            try:
                accept(rec, *resolve_record(rec, default_params, chat))
            except ValueError as e:
                error = str(e)
        if error is not None:
            failed += 1
            write_record(out, fmt.error(rec.id, error))
    return failed


def submit_records(engine, records: list[InputRecord], default_params: SamplingParams,
                   chat: bool, out: TextIO, fmt: Any = None) -> tuple[dict[str, Any], int]:
    """Queue ``records`` on ``engine`` (an ``LLMEngine``); bad ones are written to ``out``
    as error records. Returns the shown prompt of each queued request by id (for
    ``--show``) and the number of error records written."""
    prompts: dict[str, Any] = {}

    def accept(rec: InputRecord, sp: SamplingParams, prompt, msgs) -> None:
        engine.add_request(rec.id, prompt, None, sp, messages=msgs)
        prompts[rec.id] = rec.shown_prompt

    failed = queue_records(records, default_params, chat, out, accept, fmt)
    return prompts, failed


# OpenAI batch lines: the record id of a line that runs is this prefix + its custom_id;
# lines that fail by themselves get ids under another prefix, so no custom_id can take one.
OPENAI_ID_PREFIX = "batch_req_"


def openai_success(line: dict[str, Any]) -> bool:
    """Whether an output line is an OpenAI batch line with status 200 (the only kind
    resume keeps)."""
    resp = line.get("response")
    return isinstance(resp, dict) and resp.get("status_code") == 200


def line_key(line: dict[str, Any]) -> str:
    """The resume and merge key of an output line: its ``id``, except for an OpenAI batch
    line that succeeded: ``OPENAI_ID_PREFIX + custom_id``, the id of its input record
    (resume is by custom_id, and OpenAI's service or an older deepinfer wrote other
    ids)."""
    cid = line.get("custom_id")
    if isinstance(cid, str) and openai_success(line):
        return OPENAI_ID_PREFIX + cid
    return str(line["id"])


def valid_lines(path: str, skipped: list[int] | None = None
                ) -> Iterator[tuple[int, bytes, str, dict[str, Any]]]:
    """``(offset, raw_line, key, record)`` of each whole output record of ``path``, in file
    order (``key``: ``line_key``).

    The one rule for a valid output line: a whole line (it ends with a newline) holding a
    JSON object with an ``id``. A killed writer leaves at most its last line torn (no
    newline): that ends the file. A whole line that is not valid (edited by hand, or a
    torn line a later run appended to) is passed over, its 1-based number appended to
    ``skipped``: the records after it stay."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and "id" in rec:
                yield offset, raw, line_key(rec), rec
            elif skipped is not None:
                skipped.append(lineno)
            offset += len(raw)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes) -> bool:
    """Whether an output line (already known to parse) holds no NaN / Infinity."""
    if b"NaN" not in raw and b"Infinity" not in raw:
        return True  # the common case, without a second parse
    try:
        json.loads(raw, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return True


def write_record(out: TextIO, record: dict[str, Any]) -> bool:
    """One JSON line, flushed at once so that a killed run keeps every finished record.
    Returns False when ``record`` held NaN or infinity: that is a bug upstream (the
    formats drop what may legitimately be infinite), so it is reported on stderr and the
    record is written as an error line of its own format, failing alone, instead of as
    invalid JSON (``-Infinity``) or killing the job."""
    try:
        line = json.dumps(record, ensure_ascii=False, allow_nan=False)
    except ValueError as e:
        message = f"internal error: the result held a non-finite number ({e})"
        print(f"deepinfer-generate: error: record {record.get('id')!r}: {message}",
              file=sys.stderr)
        out.write(json.dumps(_failed_line(record, message), ensure_ascii=False) + "\n")
        out.flush()
        return False
    out.write(line + "\n")
    out.flush()
    return True


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
    """The output line of one finished request (a ``RequestOutput``). With logprobs
    asked for, each output also has ``logprobs``: per generated token, its top
    alternatives and the sampled token as ``{"<token id>": logprob}`` (tokens a grammar
    ruled out, at -inf, left out: JSON has no infinity)."""
    outputs = []
    for o in res.outputs:
        out = {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
        if o.stop_reason is not None:
            out["stop_reason"] = o.stop_reason
        if o.logprobs is not None:
            out["logprobs"] = [{str(t): float(lp) for t, lp in d.items()
                                if math.isfinite(lp)} for d in o.logprobs]
        outputs.append(out)
    return {"id": res.request_id, "outputs": outputs}


class NativeFormat:
    """Output lines of deepinfer's own format (``result_record`` / ``error_record``);
    results are final (kept on resume), error lines are written again (a repeated id's
    error line must not stand for the record that runs, and a rerun's exit status counts
    every failed record). ``OpenAIFormat`` has the same methods."""

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


def show_result(record_id: str, prompt: Any, text: str, prefix: str = "") -> None:
    """``--show``: one finished record, printed above the progress bar."""
    tqdm.write(f"{prefix}[{record_id}] {prompt!r}\n  -> {text!r}", file=sys.stdout)
