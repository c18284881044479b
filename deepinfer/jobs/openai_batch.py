"""The OpenAI batch file format: input lines ``{"custom_id", "method", "url", "body"}``
(``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings``:
``openai_embeddings``), output lines ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``.

A line becomes the same ``InputRecord`` the native format makes: its internal id is
``batch_req_<custom_id>`` (the output line's ``id``), or ``batch_line_<N>`` for a line that
fails by itself (malformed, an unknown ``url``, ``stream``, a field the engine does not
have, a repeated ``custom_id``): the two prefixes differ, so no custom_id can make an id
that a failed line has. Such a line gets an error line. Resume and merge key a status-200
line by its ``custom_id`` (``resume_keys.line_key``), whatever its ``id``; error lines are
dropped and rewritten when a run is resumed, so every input line has exactly one output
line. A body field given as ``null`` is taken as absent (its default), as OpenAI's API
does. ``body.model`` is not checked against the loaded model beyond a warning (as vLLM
does): one engine serves every line.

Logprobs are OpenAI's: each token by its text and its UTF-8 ``bytes`` (its true bytes:
a token holding part of a character shows as U+FFFD and keeps its own bytes;
``deepinfer.token_bytes``), read from the engine's tokenizer (``use_tokenizer``); a
completion's also give each token's ``text_offset``. With ``token_ids=True``
(``--return-tokens-as-token-ids``, vLLM's flag) tokens are named ``"token_id:<id>"``
instead, which round-trips where text does not. A completion's
``top_logprobs`` holds the top ``k`` and the sampled token (the legacy API's shape), a
chat completion's exactly the top ``top_logprobs`` (none without it), both less the
alternatives a grammar ruled out (logprob ``-inf``: not valid JSON, and not real
alternatives). ``k`` is at most :data:`MAX_LOGPROBS` (vLLM's default cap).
"""

from __future__ import annotations

import codecs
import math
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from deepinfer.jobs.input_lines import check_input_file, load_json_line, read_lines
from deepinfer.jobs.input_records import SAMPLING_KEYS, InputRecord, structured_overrides
from deepinfer.jobs.openai_embeddings import (
    EMBEDDINGS_URL,
    embedding_body_fields,
    embedding_response_body,
)
from deepinfer.jobs.resume_keys import OPENAI_ID_PREFIX, openai_success
from deepinfer.sampling.params import MAX_LOGPROBS
from deepinfer.token_bytes import TokenBytes
from deepinfer.tokenizer import check_template_kwargs

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
# Body fields taken as sampling overrides under their own name (OpenAI's and vLLM's).
_SAME_NAME = {"temperature", "top_p", "n", "seed", "stop", "presence_penalty",
              "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
              "ignore_eos", "stop_token_ids", "skip_special_tokens",
              "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
              "bad_words"} & SAMPLING_KEYS
# Accepted and without effect on one offline engine.
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options",
            "parallel_tool_calls"}
# OpenAI fields this engine does not implement: a line using one fails, naming it...
_UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "best_of",
                "suffix", "audio", "modalities", "prediction"}
# ... unless it holds the value that asks for nothing (what SDKs fill in by default).
_NO_OP_VALUES = {"tools": [], "functions": [], "logit_bias": {}, "echo": False,
                 "best_of": 1, "suffix": "", "tool_choice": "none", "function_call": "none",
                 "modalities": ["text"]}


def is_openai_batch(path: str) -> bool:
    """Whether the first line of ``path`` that parses is an object with ``custom_id``
    and ``body`` (the OpenAI batch format): a malformed first line fails alone, in the
    format of the lines around it."""
    if not os.path.isfile(path):
        return False
    for lineno, line, error in read_lines(path):
        obj, error = (None, error) if error else load_json_line(line, lineno)
        if error is None:
            return isinstance(obj, dict) and "custom_id" in obj and "body" in obj
    return False


def read_openai_inputs(path: str) -> Iterator[InputRecord]:
    """One record per non-empty line of an OpenAI batch file, read lazily; a bad line, or
    a repeated ``custom_id`` after its first line, is an error record naming the line."""
    check_input_file(path)
    seen: set[str] = set()  # custom_ids of earlier lines, good or bad
    for lineno, line, error in read_lines(path):
        if error is not None:
            yield InputRecord(id=line_record_id(lineno), error=error)
            continue
        rec = parse_openai_line(line, lineno)
        rec.source = (lineno, line)
        if rec.error is None and rec.custom_id in seen:
            rec.id = line_record_id(lineno)
            rec.error = f"line {lineno}: duplicate custom_id {rec.custom_id!r}"
        if rec.custom_id is not None:
            seen.add(rec.custom_id)
        yield rec


def line_record_id(lineno: int) -> str:
    """The id of input line ``lineno`` when it fails by itself: not under
    ``OPENAI_ID_PREFIX``, so that no custom_id (``"line2"``, ...) can collide with it."""
    return f"batch_line_{lineno}"


def parse_openai_line(line: str, lineno: int) -> InputRecord:
    """One input line -> an ``InputRecord`` (``api``: ``"chat"``, ``"completion"`` or
    ``"embedding"``; ``error`` set, naming the line and the field, when the line is
    bad)."""
    line_id = line_record_id(lineno)
    obj, error = load_json_line(line, lineno)
    if error is not None:
        return InputRecord(id=line_id, error=error)
    if not isinstance(obj, dict):
        return InputRecord(id=line_id, error=f"line {lineno}: expected a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return InputRecord(id=line_id, error=f"line {lineno}: 'custom_id' must be a "
                                             "non-empty string")

    def bad(msg: str) -> InputRecord:
        return InputRecord(id=line_id, custom_id=cid, error=f"line {lineno}: {msg}")

    if obj.get("method", "POST") != "POST":
        return bad(f"method {obj.get('method')!r}: only POST")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL):
        return bad(f"url {url!r}: expected {CHAT_URL!r}, {COMPLETIONS_URL!r} or "
                   f"{EMBEDDINGS_URL!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("'body' must be an object")
    model = body.get("model")
    model = model if isinstance(model, str) and model else None
    if url == EMBEDDINGS_URL:
        try:
            prompt, ids, pooling, encoding = embedding_body_fields(body)
        except ValueError as e:
            return bad(str(e))
        return InputRecord(id=OPENAI_ID_PREFIX + cid, prompt=prompt, prompt_token_ids=ids,
                           custom_id=cid, api="embedding", model=model, pooling=pooling,
                           encoding_format=encoding)
    try:
        prompt, messages, overrides = _body_fields(body, url == CHAT_URL)
        kwargs = check_template_kwargs(body.get("chat_template_kwargs"),
                                       "body.chat_template_kwargs")
    except ValueError as e:
        return bad(str(e))
    return InputRecord(id=OPENAI_ID_PREFIX + cid, prompt=prompt, messages=messages,
                       overrides=overrides, custom_id=cid,
                       api="chat" if url == CHAT_URL else "completion", model=model,
                       echo=body.get("echo") is True, chat_template_kwargs=kwargs or None)


def _body_fields(body: dict[str, Any], chat: bool
                 ) -> tuple[str | None, list[dict[str, str]] | None, dict[str, Any]]:
    """``(prompt, messages, sampling overrides)`` of a request body; ``ValueError`` naming
    the field when it is missing, malformed or not supported."""
    # OpenAI documents most fields as nullable, null meaning the default: drop them here
    # so that no check below (or SamplingParams) sees a None.
    body = {k: v for k, v in body.items()
            if v is not None and not (k in _NO_OP_VALUES and v == _NO_OP_VALUES[k]
                                      and type(v) is type(_NO_OP_VALUES[k]))}
    if body.get("stream"):
        raise ValueError("body.stream: streaming is not available in a batch")
    used = set(body) - _IGNORED - {"stream"}
    unsupported = sorted(used & _UNSUPPORTED)
    if unsupported:
        raise ValueError(f"body.{unsupported[0]}: not supported by this engine")
    prompt = messages = None
    if chat:
        messages = _messages(body.get("messages"))
        used.discard("messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("body.prompt: must be a string (one prompt per line)")
        used.discard("prompt")
    overrides: dict[str, Any] = {k: body[k] for k in used & _SAME_NAME}
    used -= _SAME_NAME
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body:
            overrides["max_tokens"] = body[key]
            used.discard(key)
    echo = body.get("echo")
    used.discard("echo")
    if "chat_template_kwargs" in body and not chat:  # vLLM's extension of a chat body
        raise ValueError("body.chat_template_kwargs: only for /v1/chat/completions")
    used.discard("chat_template_kwargs")
    if echo is not None and (chat or not isinstance(echo, bool)):
        raise ValueError("body.echo: only true or false, and only for /v1/completions "
                         "(a chat completion does not echo its messages)")
    if overrides.get("max_tokens") == 0 and not echo:
        raise ValueError("body.max_tokens: 0 only with echo: true (the prompt scored, "
                         "nothing generated)")
    logprobs = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if logprobs not in (None, True, False):
            raise ValueError("body.logprobs: must be true or false for chat completions")
        if top is not None and not logprobs:
            raise ValueError("body.top_logprobs: needs logprobs: true")
        if logprobs:
            overrides["logprobs"] = 0 if top is None else _top_count("top_logprobs", top)
    elif logprobs is not None:
        overrides["logprobs"] = _top_count("logprobs", logprobs)
    if echo and (logprobs is not None or overrides.get("max_tokens") == 0):
        # The echoed prompt's logprobs, as the legacy API gives them: its tokens first.
        overrides["prompt_logprobs"] = overrides.get("logprobs", 0)
    used -= {"logprobs", "top_logprobs", "response_format"}
    if used:
        raise ValueError(f"body.{sorted(used)[0]}: unknown field")
    structured_overrides(overrides, body.get("response_format"))
    return prompt, messages, overrides


def _top_count(field: str, value: Any) -> Any:
    """``value`` if it is at most :data:`MAX_LOGPROBS` (its type and sign are checked by
    ``SamplingParams``), else ``ValueError`` naming ``body.<field>``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LOGPROBS:
        raise ValueError(f"body.{field}: {value} is over the limit of {MAX_LOGPROBS}")
    return value


def _messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages with string content (a list of text parts is joined)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("body.messages: must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"body.messages[{i}]: must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"body.messages[{i}].content: only text parts")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ValueError(f"body.messages[{i}].content: must be a string")
        out.append({"role": m["role"], "content": content})
    return out


class OpenAIFormat:
    """Output lines of the OpenAI batch format for the records of one input file.
    ``model``: the name written in each response body; ``token_ids``: logprob tokens as
    ``"token_id:<id>"`` rather than text. A record's line needs the record (its
    custom_id, api, echo): ``records`` and ``track`` hand them in, and each is let go
    once its line is made, so a streamed job holds only the records in flight."""

    def __init__(self, records: Iterable[InputRecord], model: str,
                 token_ids: bool = False) -> None:
        self.model = model
        self.token_ids = token_ids
        self._records = {r.id: r for r in records}
        self._bytes: TokenBytes | None = None

    def track(self, rec: InputRecord) -> None:
        """Keep ``rec`` until its result or error line is made."""
        self._records[rec.id] = rec

    def release(self, record_id: str) -> InputRecord | None:
        """Let go of a record whose line another process makes (a PD hand-off): it is
        returned, for that process's ``track``."""
        return self._records.pop(record_id, None)

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Read logprob tokens' text and bytes from ``tokenizer`` (the engine's)."""
        self._bytes = TokenBytes(tokenizer)

    def result(self, res) -> dict[str, Any]:
        """The line of a finished request (a ``RequestOutput``, or an
        ``EmbeddingRequestOutput``): status 200, a ``chat.completion``,
        ``text_completion`` or embeddings ``list`` body with usage."""
        rec = self._records.pop(res.request_id)
        body = (embedding_response_body(res, self.model, rec.encoding_format)
                if rec.api == "embedding" else self._completion_body(rec, res))
        return {"id": rec.id, "custom_id": rec.custom_id,
                "response": {"status_code": 200, "request_id": rec.id, "body": body},
                "error": None}

    def _completion_body(self, rec: InputRecord, res) -> dict[str, Any]:
        """A ``chat.completion`` or ``text_completion`` body with usage."""
        chat = rec.api == "chat"
        choices = []
        top = (rec.overrides or {}).get("logprobs")
        for o in res.outputs:
            choice: dict[str, Any] = {"index": o.index, "finish_reason": o.finish_reason,
                                      "stop_reason": o.stop_reason,
                                      "logprobs": self._logprobs(
                                          o, chat, top or 0, res if rec.echo else None)}
            if chat:
                choice["message"] = {"role": "assistant", "content": o.text}
                if o.reasoning is not None:  # vLLM's run-batch field
                    choice["message"]["reasoning"] = o.reasoning
            else:
                choice["text"] = (rec.prompt or "") + o.text if rec.echo else o.text
            choices.append(choice)
        completion = sum(len(o.token_ids) for o in res.outputs)
        prompt = len(res.prompt_token_ids or ())
        suffix = rec.custom_id
        return {"id": ("chatcmpl-" if chat else "cmpl-") + suffix,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    def error(self, record_id: str, message: str) -> dict[str, Any]:
        """The line of a record that failed (``custom_id`` null for an unreadable line)."""
        rec = self._records.pop(record_id, None)
        return {"id": record_id, "custom_id": rec.custom_id if rec else None,
                "response": None, "error": {"code": "invalid_request", "message": message}}

    @staticmethod
    def final(line: dict[str, Any]) -> bool:
        """Whether an output line is kept on resume: only successful ones."""
        return openai_success(line)


    def _logprobs(self, o, chat: bool, top_k: int, echo: Any = None) -> dict[str, Any] | None:
        """OpenAI-shaped logprobs of one completion; a chat completion's
        ``top_logprobs`` keep the ``top_k`` most likely only. ``echo``: the
        ``RequestOutput`` whose prompt tokens lead a completion's lists (the first with
        null logprobs: nothing precedes it)."""
        if o.logprobs is None:
            return None
        if self._bytes is None:
            raise RuntimeError("OpenAIFormat: use_tokenizer() before writing logprobs")
        token_bytes = self._bytes
        name = (lambda t: f"token_id:{t}") if self.token_ids else token_bytes.text
        sampled, tops = [], []
        prompt = [] if echo is None else list(zip(echo.prompt_token_ids, echo.prompt_logprobs))
        for tok, d in prompt + list(zip(o.token_ids, o.logprobs)):
            if d is None:  # the echoed prompt's first token
                sampled.append((tok, None))
                tops.append(None)
                continue
            sampled.append((tok, float(d.get(tok, float("nan")))))
            # A grammar's masked tokens can fill the top k with -inf: drop them (OpenAI
            # lists only real alternatives, and JSON has no infinity). The sampled token's
            # own logprob is not filtered: a non-finite one is a bug that write_record
            # reports. Most likely first, as OpenAI lists them (the engine's dict has the
            # sampled token first).
            tops.append(sorted(((int(t), float(lp)) for t, lp in d.items()
                                if math.isfinite(lp)), key=lambda kv: -kv[1]))
        if chat:
            def entry(t: int, lp: float) -> dict[str, Any]:
                return {"token": name(t), "logprob": lp, "bytes": list(token_bytes(t))}

            return {"content": [{**entry(t, lp), "top_logprobs": [entry(*kv) for kv in
                                                                   top[:top_k]]}
                                for (t, lp), top in zip(sampled, tops)],
                    "refusal": None}
        # Two ids with one text share a key: the likelier stays (the list is sorted).
        top_dicts = [None if top is None else {} for top in tops]
        for dst, top in zip(top_dicts, tops):
            for t, lp in top or ():
                dst.setdefault(name(t), lp)
        return {"tokens": [name(t) for t, _ in sampled],
                "token_logprobs": [lp for _, lp in sampled],
                "top_logprobs": top_dicts,
                "text_offset": text_offsets([token_bytes(t) for t, _ in sampled])}


def text_offsets(pieces: list[bytes], start: int = 0) -> list[int]:
    """The character offset at which each of ``pieces`` (the bytes of consecutive
    tokens) starts in their decoded text, from ``start``: a piece that continues a
    character counts from that character's start, as its bytes join it there."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets = []
    pos = start
    for b in pieces:
        offsets.append(pos)
        pos += len(decoder.decode(b))
    return offsets
