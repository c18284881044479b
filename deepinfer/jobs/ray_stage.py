"""deepinfer as a Ray Data stage (``pip install deepinfer[ray]``).

``EngineStage`` is a callable class for ``ds.map_batches(EngineStage, concurrency=N,
fn_constructor_kwargs=...)``: each of the N replicas (Ray actors) builds its engine once,
from ``EngineArgs`` fields, and answers batches of rows with columns ``lineno`` and
``line``: the lines of an input file as ``deepinfer-generate`` reads them (``.txt``
prompts, deepinfer's ``.jsonl`` records or OpenAI batch lines, parsed by the same code).
A batch's output rows have ``id``, ``error`` (the message, or null) and ``record``: the
line the CLI writes for that record, as JSON text (logprob dictionaries have keys that
differ from row to row, which an Arrow column cannot hold; the text keeps them exact).
A bad row becomes an error row; the batch goes on.

Replicas run with ``max_concurrency`` > 1: several batches are answered at once, their
requests submitted to one engine driven by a thread of its own (``engine_thread``), so
its batch stays full across Ray batches and no batch waits for another's slowest row.

``ray_pipeline`` builds the whole job: read the rows, map them through the stage, write
JSON files (``ray_job`` runs it from the command line).
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.engine_thread import EngineThread, result_of
from deepinfer.jobs.formats import model_name
from deepinfer.jobs.input_records import InputRecord, iter_requests, parse_jsonl_line
from deepinfer.jobs.openai_batch import OpenAIFormat, parse_openai_line
from deepinfer.jobs.output_records import NATIVE, record_text
from deepinfer.sampling.params import SamplingParams

#: ``EngineStage``'s input kinds: a ``.txt`` file, deepinfer's ``.jsonl`` records, or an
#: OpenAI batch file.
INPUT_KINDS = ("txt", "jsonl", "openai")


def parse_line(kind: str, line: str, lineno: int) -> InputRecord:
    """One input line of ``kind`` as the CLI parses it."""
    if kind == "txt":
        return InputRecord(id=str(lineno), prompt=line)
    return parse_openai_line(line, lineno) if kind == "openai" else parse_jsonl_line(
        line, lineno)


class EngineStage:
    """One Ray Data replica: an engine and the output format of its records.

    ``engine_args``: ``EngineArgs`` fields; ``kind``: one of ``INPUT_KINDS``;
    ``default_params``: the sampling a line leaves out (the CLI's defaults of the
    format); ``chat`` / ``template_kwargs``: as ``--chat`` / ``--chat-template-kwargs``;
    ``token_ids``: ``--return-tokens-as-token-ids``."""

    def __init__(self, engine_args: dict[str, Any], kind: str,
                 default_params: SamplingParams, chat: bool = False,
                 template_kwargs: dict[str, Any] | None = None,
                 token_ids: bool = False) -> None:
        if kind not in INPUT_KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {', '.join(INPUT_KINDS)}")
        args = EngineArgs(**engine_args)
        self.kind, self.params = kind, default_params
        self.chat, self.template_kwargs = chat, template_kwargs
        self.engine = EngineThread(LLMEngine(args))
        self.fmt: Any = NATIVE
        if kind == "openai":
            self.fmt = OpenAIFormat((), model_name(args.model), token_ids)
        self.fmt.use_tokenizer(self.engine.engine.tokenizer)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        """Rows ``lineno`` (int) and ``line`` (str) -> rows ``id``, ``error``,
        ``record`` (see the module docstring), in the same order."""
        records = [parse_line(self.kind, str(line), int(n))
                   for n, line in zip(batch["lineno"], batch["line"])]
        pending = []
        for req in iter_requests(records, self.params, self.chat, track=self.fmt.track,
                                 template_kwargs=self.template_kwargs):
            pending.append((req.request_id, req.error if req.error is not None
                            else self.engine.submit(req)))
        out: dict[str, list] = {"id": [], "error": [], "record": []}
        for rid, waiting in pending:
            error = waiting if isinstance(waiting, str) else None
            if error is None:
                res = result_of(waiting)
                error = str(res) if isinstance(res, ValueError) else res.error
            line = self.fmt.error(rid, error) if error is not None else self.fmt.result(res)
            text, ok = record_text(line)
            out["id"].append(rid)
            out["error"].append(error if ok else json.loads(text)["error"])
            out["record"].append(text)
        return out


def ray_pipeline(rows_path: str, output_dir: str, stage_kwargs: dict[str, Any], *,
                 replicas: int = 1, cpus_per_replica: float = 1.0,
                 gpus_per_replica: int = 0, batch_size: int = 16,
                 concurrent_batches: int = 4, stage: type = EngineStage) -> None:
    """Read ``rows_path`` (JSON lines ``{"lineno", "line"}``), map the rows through
    ``replicas`` ``EngineStage`` replicas (``stage_kwargs``: its constructor's), write
    the output rows as JSON files into ``output_dir``.

    Each replica reserves ``cpus_per_replica`` of Ray's CPUs (its engine's threads are
    its own business; leave Ray a CPU for reading and writing) and, on CUDA,
    ``gpus_per_replica`` GPUs: its ``tensor_parallel_size``, held by the one actor
    process, so on one node, where its TP ranks see them. ``concurrent_batches``
    batches are answered at once by each replica, all into its one engine. A replica
    that dies is restarted and its batches run again (Ray Data's actor retries): each
    input row is written once. ``stage``: ``EngineStage`` or a subclass."""
    import ray.data

    ds = ray.data.read_json(rows_path)
    ds = ds.map_batches(
        stage, fn_constructor_kwargs=stage_kwargs, batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(
            size=replicas, max_tasks_in_flight_per_actor=concurrent_batches,
            max_concurrent_calls_per_actor=concurrent_batches,
            enable_true_multi_threading=True),
        num_cpus=cpus_per_replica, num_gpus=gpus_per_replica or None)
    ds.write_json(output_dir)
