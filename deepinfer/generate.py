"""``deepinfer-generate``: offline batch generation from a .txt or .jsonl file.

Input: ``.txt`` (one prompt per line) or ``.jsonl`` (objects with optional ``id``,
``prompt`` or ``messages``, and optional sampling overrides, top level or under
``sampling_params``). Output: ``.jsonl``, one record per input with ``id`` and either
``outputs`` or ``error``, appended as requests finish. Rerunning with the same output
file resumes: ids already there are skipped.

Three ways to run: one engine (default), data parallel (``--dp N`` or torchrun; see
``deepinfer.dp``) and disaggregated prefill/decode (``--pd P:D``; see ``deepinfer.disagg``).
They share the record handling below: parsing, error records, resume, summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TextIO

from tqdm.auto import tqdm

from deepinfer.engine_args import EngineArgs
from deepinfer.sampling_params import SamplingParams

_SAMPLING_KEYS = {f.name for f in fields(SamplingParams)}


@dataclass
class InputRecord:
    """One input line, parsed; ``error`` set when the line itself is bad."""

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    overrides: dict[str, Any] | None = None
    error: str | None = None


def read_inputs(path: str) -> Iterator[InputRecord]:
    """Yield one record per non-empty line; the default id is the 1-based line number."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input {path!r}: no such file")
    is_jsonl = path.endswith((".jsonl", ".json"))
    if not is_jsonl and not path.endswith(".txt"):
        raise ValueError(f"--input {path!r}: expected a .txt or .jsonl file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if not is_jsonl:
                yield InputRecord(id=str(lineno), prompt=line)
                continue
            yield _parse_jsonl_line(line, lineno)


def _parse_jsonl_line(line: str, lineno: int) -> InputRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return InputRecord(id=str(lineno), error=f"line {lineno}: malformed JSON ({e.msg})")
    if not isinstance(obj, dict):
        return InputRecord(id=str(lineno), error=f"line {lineno}: expected a JSON object")
    rid = str(obj.get("id", lineno))
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
    overrides = dict(obj.get("sampling_params") or {})
    overrides.update({k: v for k, v in obj.items() if k in _SAMPLING_KEYS})
    unknown = set(obj) - _SAMPLING_KEYS - {"id", "prompt", "messages", "sampling_params"}
    if unknown:
        return InputRecord(id=rid, error=f"line {lineno}: unknown keys {sorted(unknown)}")
    return InputRecord(id=rid, prompt=prompt, messages=messages, overrides=overrides)


def load_done_ids(path: str) -> set[str]:
    """Ids already in the output file; a torn last line (killed run) is cut off."""
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    with open(path, "rb") as f:
        data = f.read()
    good_end = 0
    pos = 0
    for raw in data.splitlines(keepends=True):
        pos += len(raw)
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break  # everything after a torn record is dropped
        if not raw.endswith(b"\n") or not isinstance(rec, dict) or "id" not in rec:
            break
        done.add(str(rec["id"]))
        good_end = pos
    if good_end != len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def write_record(out: TextIO, record: dict[str, Any]) -> None:
    """One JSON line, flushed at once so that a killed run keeps every finished record."""
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer-generate", description="Offline batch generation with deepinfer."
    )
    p.add_argument("--input", required=True, help=".txt (one prompt per line) or .jsonl")
    p.add_argument("--output", required=True, help=".jsonl; appended to, and resumed from")
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes (CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--chat", action="store_true", help="apply the chat template to prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--show", action="store_true", help="print each result when done")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel ranks on this machine (one GPU each on CUDA; "
                        "ignored under torchrun, which sets the ranks)")
    p.add_argument("--dp-timeout", type=float, default=120.0,
                   help="seconds a rank waits on the others before giving up (DP and PD "
                        "runs)")
    p.add_argument("--pd", default=None, metavar="P:D",
                   help="disaggregated prefill/decode: P prompt + D completion engines, "
                        "spawned on this machine (one GPU each on CUDA), or under torchrun "
                        "with WORLD_SIZE = P + D; n = 1 only")
    return p


def default_sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The CLI's default sampling; per-record overrides are applied on top."""
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, n=args.n,
    )


def engine_args(args: argparse.Namespace, device: str | None = None) -> EngineArgs:
    """``EngineArgs`` from the CLI flags; ``device`` overrides ``--device`` (DP ranks)."""
    return EngineArgs(
        model=args.model, dtype=args.dtype, device=device or args.device,
        attention_backend=args.attention_backend, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
    )


def mark_duplicates(pending: list[InputRecord]) -> None:
    """Turn a repeated id of the input into an error record, so that every rank of a DP
    run agrees on which record of a repeated id runs."""
    seen: set[str] = set()
    for rec in pending:
        if rec.error is None and rec.id in seen:
            rec.error = f"duplicate id {rec.id!r} in the input"
        seen.add(rec.id)


def load_resume_state(output: str, inputs: list[InputRecord]) -> set[str]:
    """Prepare ``output`` for a run and return the ids already done: create its folder,
    fold in part files left by a killed DP/PD run (they hold finished records), cut a
    torn last line. Only one process of a run may call this (it rewrites the file)."""
    from deepinfer.dp import fold_part_files

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fold_part_files(output, inputs)
    return load_done_ids(output)


def pending_records(inputs: list[InputRecord], done: set[str], output: str,
                    announce: bool = True) -> list[InputRecord]:
    """The records still to run, repeated ids turned into error records; ``announce``
    prints the resume line (one process of a run)."""
    pending = [r for r in inputs if r.id not in done]
    if announce and done:
        print(f"resuming: {len(inputs) - len(pending)} of {len(inputs)} records already in "
              f"{output}", file=sys.stderr)
    mark_duplicates(pending)
    return pending


def resolve_record(rec: InputRecord, default_params: SamplingParams, chat: bool
                   ) -> tuple[SamplingParams, str | None, list[dict[str, str]] | None]:
    """``(params, prompt, messages)`` of a good record: its sampling overrides applied and,
    with ``chat``, a plain prompt wrapped as one user message. Raises ``ValueError`` for
    invalid sampling values."""
    sp = default_params.replace(**(rec.overrides or {}))
    if rec.messages is not None or chat:
        return sp, None, rec.messages or [{"role": "user", "content": rec.prompt}]
    return sp, rec.prompt, None


def queue_records(records: list[InputRecord], default_params: SamplingParams, chat: bool,
                  out: TextIO, accept: Callable[..., None]) -> int:
    """Resolve each record and pass it to ``accept(rec, params, prompt, messages)``; a bad
    record (its line, its sampling values, or a ``ValueError`` from ``accept``) is written
    to ``out`` as an error record instead. Returns the number of error records."""
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
            write_record(out, {"id": rec.id, "error": error})
    return failed


def submit(engine, records: list[InputRecord], default_params: SamplingParams,
           chat: bool, out: TextIO) -> tuple[dict[str, Any], int]:
    """Queue ``records`` on ``engine``; bad ones are written to ``out`` as error records.

    Returns the prompts of the queued requests by id (for ``--show``) and the number of
    error records written.
    """
    from deepinfer.tokenizer import apply_chat_template

    prompts: dict[str, Any] = {}

    def accept(rec: InputRecord, sp: SamplingParams, prompt, msgs) -> None:
        if msgs is not None:
            engine.add_request(rec.id, None, apply_chat_template(engine.tokenizer, msgs), sp)
        else:
            engine.add_request(rec.id, prompt, None, sp)
        prompts[rec.id] = rec.prompt if rec.prompt is not None else rec.messages

    failed = queue_records(records, default_params, chat, out, accept)
    return prompts, failed


def result_record(res) -> dict[str, Any]:
    """The output line of one finished request."""
    return {"id": res.request_id, "outputs": [
        {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
        for o in res.outputs
    ]}


def show_result(res, prompts: dict[str, Any], prefix: str = "") -> None:
    tqdm.write(f"{prefix}[{res.request_id}] {prompts[res.request_id]!r}\n"
               f"  -> {res.outputs[0].text!r}", file=sys.stdout)


def summary_line(num_ok: int, failed: int, prompt_tokens: int, generated_tokens: int,
                 elapsed: float, preemptions: int, hits: int, queries: int) -> str:
    """The end-of-run summary (one rank, or the sums over a DP group)."""
    elapsed = max(elapsed, 1e-9)
    return (
        f"done: {num_ok} requests ok, {failed} failed | prompt {prompt_tokens} tok, "
        f"generated {generated_tokens} tok in {elapsed:.1f}s "
        f"({generated_tokens / elapsed:.1f} tok/s out, "
        f"{(prompt_tokens + generated_tokens) / elapsed:.1f} tok/s total) | "
        f"preemptions {preemptions} | prefix-cache hit rate {hits / max(queries, 1):.1%}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        default_params = default_sampling_params(args)
        inputs = list(read_inputs(args.input))
        if args.dp < 1:
            raise ValueError(f"--dp {args.dp}: expected a positive number of ranks")
        if args.dp_timeout <= 0:
            raise ValueError(f"--dp-timeout {args.dp_timeout}: expected seconds > 0")
        if args.pd is not None:
            from deepinfer.disagg import parse_pd

            parse_pd(args.pd)
            if args.dp > 1:
                # Each PD process is one engine of one role; a DP group of PD groups
                # would need a second level of process groups. Not implemented.
                raise ValueError(f"--pd {args.pd} and --dp {args.dp} cannot be combined: "
                                 "use --pd alone (more P or D ranks) or --dp alone")
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer-generate: {e}", file=sys.stderr)
        return 2
    from deepinfer import dp

    if args.pd is not None:
        from deepinfer.disagg import generate_pd

        return generate_pd(args, inputs)
    if args.dp > 1 or dp.torchrun_world_size() > 1:
        return dp.generate_dp(args)
    done = load_resume_state(args.output, inputs)
    pending = pending_records(inputs, done, args.output)
    if not pending:
        return 0

    from deepinfer.engine import LLMEngine

    engine = LLMEngine(engine_args(args))
    t_start = time.perf_counter()
    with open(args.output, "a", encoding="utf-8") as out:
        prompts, failed = submit(engine, pending, default_params, args.chat, out)
        num_ok = len(prompts)
        bar = tqdm(total=num_ok, desc="generate", unit="req", disable=args.no_progress,
                   dynamic_ncols=True, file=sys.stderr)
        st = engine.stats
        while engine.has_unfinished():
            for res in engine.step():
                write_record(out, result_record(res))
                bar.update(1)
                if args.show:
                    show_result(res, prompts)
            elapsed = max(time.perf_counter() - t_start, 1e-9)
            bar.set_postfix_str(f"in {st.prompt_tokens / elapsed:.0f} tok/s, "
                                f"out {st.generated_tokens / elapsed:.0f} tok/s", refresh=False)
        bar.close()
    sst = engine.scheduler.stats
    print(summary_line(num_ok, failed, st.prompt_tokens, st.generated_tokens,
                       time.perf_counter() - t_start, sst.num_preemptions,
                       sst.prefix_cache_hits, sst.prefix_cache_queries), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
