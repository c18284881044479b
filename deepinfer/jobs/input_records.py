"""Input records (``.txt`` / ``.jsonl`` lines) and the requests they become.

Input: ``.txt`` (one prompt per line, blank lines skipped; the id is the line number) or
``.jsonl`` (objects with an optional ``id``, ``prompt`` or ``messages``, and optional
sampling overrides, top level or under ``sampling_params``; structured output as
``structured_outputs`` (``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``,
``{"json": ...}``, ``{"json_object": true}``) or OpenAI's ``response_format``). A bad line
becomes a record with ``error`` set, so that it fails alone. Input files are read as
UTF-8 with an optional BOM; CRLF line ends work; a line that is not UTF-8 fails alone
(``input_lines``). The OpenAI batch format makes the same ``InputRecord`` s
(``openai_batch``).

A record becomes a ``JobRequest`` (``to_requests``): its sampling resolved, ready for an
engine's ``add_request``, or carrying the error that its output line reports. A record
with ``pooling`` (``--embed``, or an OpenAI ``/v1/embeddings`` line) is an embedding
request: its sampling values are not used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from deepinfer.jobs.input_lines import check_input_file, load_json_line, read_lines
from deepinfer.lora.request import LoRARequest
from deepinfer.pooling import PoolingParams
from deepinfer.sampling.params import SamplingParams
from deepinfer.structured import StructuredOutputsParams
from deepinfer.tokenizer import check_template_kwargs

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
    echo: bool = False  # OpenAI completions: the prompt leads the text and the logprobs
    chat_template_kwargs: dict[str, Any] | None = None  # the line's template variables
    source: tuple[int, str] | None = None  # (line number, text) of a line that parsed
    prompt_token_ids: list[int] | None = None  # OpenAI embeddings: an input of token ids
    pooling: PoolingParams | None = None  # an embedding request (--embed, /v1/embeddings)
    encoding_format: str = "float"  # OpenAI embeddings: "float" or "base64"
    lora: str | None = None  # the name of the --lora adapter the line runs with

    @property
    def shown_prompt(self) -> str | Messages | list[int] | None:
        """What ``--show`` prints as the prompt: the text, the messages or the ids."""
        for shown in (self.prompt, self.messages, self.prompt_token_ids):
            if shown is not None:
                return shown
        return None


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
            continue
        rec = parse_jsonl_line(line, lineno) if is_jsonl else InputRecord(id=str(lineno),
                                                                           prompt=line)
        rec.source = (lineno, line)
        yield rec


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
                                          "response_format", "chat_template_kwargs", "lora"}
    if unknown:
        return InputRecord(id=rid, error=f"line {lineno}: unknown keys {sorted(unknown)}")
    lora = obj.get("lora")
    if lora is not None and (not isinstance(lora, str) or not lora):
        return InputRecord(id=rid, error=f"line {lineno}: 'lora' must be the name of a "
                                         f"--lora adapter, got {json.dumps(lora)}")
    try:
        structured_overrides(overrides, obj.get("response_format"))
        kwargs = check_template_kwargs(obj.get("chat_template_kwargs"))
    except ValueError as e:
        return InputRecord(id=rid, error=f"line {lineno}: {e}")
    return InputRecord(id=rid, prompt=prompt, messages=messages, overrides=overrides,
                       chat_template_kwargs=kwargs or None, lora=lora)


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


def mark_duplicates(records: Iterable[InputRecord]) -> Iterator[InputRecord]:
    """``records`` (lazily), a repeated id turned into an error record, so that every
    rank of a DP run agrees on which record of a repeated id runs: its first."""
    seen: set[str] = set()
    for rec in records:
        if rec.error is None and rec.id in seen:
            rec.error = f"duplicate id {rec.id!r} in the input"
        seen.add(rec.id)
        yield rec


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


@dataclass
class JobRequest:
    """One request of a job, as an engine takes it (``LLMEngine.add_request``): exactly
    one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat: the engine
    applies the template). ``error``: why it cannot run (its output line says so; the
    other fields are then unset). ``shown``: what ``--show`` prints as its prompt."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: Messages | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    error: str | None = None
    shown: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    pooling: PoolingParams | None = None  # an embedding request
    lora_request: LoRARequest | None = None  # its adapter (a line's "lora")


def iter_requests(records: Iterable[InputRecord], default_params: SamplingParams, chat: bool,
                  check: Callable[[str, SamplingParams], None] | None = None,
                  template_kwargs: dict[str, Any] | None = None,
                  track: Callable[[InputRecord], None] | None = None,
                  loras: dict[str, LoRARequest] | None = None
                  ) -> Iterator[JobRequest]:
    """One ``JobRequest`` per record, in order and lazily (``resolve_record``); a bad
    line, invalid sampling values or a ``ValueError`` from ``check(id, params)`` (what a
    run mode cannot serve) give a request with ``error`` set. ``template_kwargs``: the
    chat template variables of every chat record (``--chat-template-kwargs``), a
    record's own taking precedence key by key. ``track(record)``: called for each record
    as it becomes a request (an OpenAI output format keeps it until its line is
    written). ``loras``: the ``--lora`` adapters by name, which a line's ``lora`` names
    (any other name is that line's error)."""
    for rec in records:
        if track is not None:
            track(rec)
        if rec.error is not None:
            yield JobRequest(rec.id, error=rec.error)
            continue
        try:
            params, prompt, messages = resolve_record(rec, default_params, chat)
            if check is not None:
                check(rec.id, params)
            lora = _lora_of(rec, loras)
        except ValueError as e:
            yield JobRequest(rec.id, error=str(e))
            continue
        kwargs = {**(template_kwargs or {}), **(rec.chat_template_kwargs or {})}
        yield JobRequest(rec.id, prompt=prompt, prompt_token_ids=rec.prompt_token_ids,
                         messages=messages, params=params, shown=rec.shown_prompt,
                         chat_template_kwargs=kwargs if messages else None,
                         pooling=rec.pooling, lora_request=lora)


def _lora_of(rec: InputRecord, loras: dict[str, LoRARequest] | None) -> LoRARequest | None:
    if rec.lora is None:
        return None
    if not loras:
        raise ValueError(f"lora {rec.lora!r}: no adapters were given (--lora NAME=PATH)")
    if rec.lora not in loras:
        raise ValueError(f"lora {rec.lora!r} is not one of the --lora names "
                         f"({', '.join(loras)})")
    return loras[rec.lora]


def lora_requests(specs: list[str] | None) -> dict[str, LoRARequest]:
    """``--lora NAME=PATH`` values -> the adapters by name, numbered in the order given
    (the same ids on every rank). ``ValueError`` naming the flag for a malformed or
    repeated name."""
    out: dict[str, LoRARequest] = {}
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH (an adapter folder)")
        if name in out:
            raise ValueError(f"--lora {spec!r}: the name {name!r} is given twice")
        out[name] = LoRARequest(name, len(out) + 1, path)
    return out


def to_requests(records: Iterable[InputRecord], default_params: SamplingParams, chat: bool,
                **kw: Any) -> list[JobRequest]:
    """``iter_requests`` as a list."""
    return list(iter_requests(records, default_params, chat, **kw))
