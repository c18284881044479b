"""deepinfer as a Ray Data stage (``pip install deepinfer[ray]``).

``EngineStage`` is a callable class for ``ds.map_batches(EngineStage, concurrency=N,
fn_constructor_kwargs=...)``: each of the N replicas (Ray actors) builds its engine once,
from ``EngineArgs`` fields, and answers batches of rows with columns ``lineno`` and
``line``: the lines of an input file as ``deepinfer-generate`` reads them (``.txt``
prompts, deepinfer's ``.jsonl`` records or OpenAI batch lines, parsed by the same code).
A batch's output columns are the fields of the line the CLI writes for each row
(``COLUMNS``: native ``id``, ``outputs``, ``prompt_logprobs``, ``error``; OpenAI ``id``,
``custom_id``, ``response``, ``error``), null where a line lacks the field. A field that
holds an object or a list is its JSON text: logprobs are maps keyed by token id or text,
different in every row, which an Arrow struct cannot hold (its inference would give every
row every other row's keys); the text keeps them exact, and ``record_of_row`` gives the
CLI's line back. A bad row becomes an error row (``error`` set); the batch goes on.

Replicas run with ``max_concurrency`` > 1: several batches are answered at once, their
requests submitted to one engine driven by a thread of its own (``engine_thread``), so
its batch stays full across Ray batches and no batch waits for another's slowest row.

``ray_pipeline`` builds the whole job: read the rows, map them through the stage, write
JSON files (``ray_job`` runs it from the command line).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.engine_thread import EngineThread, result_of
from deepinfer.jobs.formats import model_name
from deepinfer.jobs.input_records import InputRecord, iter_requests, parse_jsonl_line
from deepinfer.jobs.openai_batch import OpenAIFormat, parse_openai_line
from deepinfer.jobs.output_records import NATIVE, record_text
from deepinfer.sampling.params import SamplingParams

#: The output columns of each format: the fields of its output lines, in their order.
COLUMNS = {"native": ("id", "outputs", "prompt_logprobs", "error"),
           "openai": ("id", "custom_id", "response", "error")}

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
        self.fmt_name = "openai" if kind == "openai" else "native"
        if kind == "openai":
            self.fmt = OpenAIFormat((), model_name(args.model), token_ids)
        self.fmt.use_tokenizer(self.engine.engine.tokenizer)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        """Rows ``lineno`` (int) and ``line`` (str) -> rows with the format's
        ``COLUMNS`` (see the module docstring), in the same order."""
        records = [parse_line(self.kind, str(line), int(n))
                   for n, line in zip(batch["lineno"], batch["line"])]
        pending = []
        for req in iter_requests(records, self.params, self.chat, track=self.fmt.track,
                                 template_kwargs=self.template_kwargs):
            pending.append((req.request_id, req.error if req.error is not None
                            else self.engine.submit(req)))
        columns = COLUMNS[self.fmt_name]
        out: dict[str, list] = {c: [] for c in columns}
        for rid, waiting in pending:
            error = waiting if isinstance(waiting, str) else None
            if error is None:
                res = result_of(waiting)
                error = str(res) if isinstance(res, ValueError) else res.error
            line = self.fmt.error(rid, error) if error is not None else self.fmt.result(res)
            text, ok = record_text(line)
            if not ok:  # written as an error line instead (see record_text)
                line = json.loads(text)
            for c in columns:
                value = line.get(c)
                out[c].append(json.dumps(value, ensure_ascii=False)
                              if isinstance(value, (dict, list)) else value)
        return out


def record_of_row(row: dict[str, Any]) -> dict[str, Any]:
    """The CLI's output line of one output row of ``EngineStage``: its columns in order,
    JSON text parsed back; a native line leaves out the fields it lacks (an OpenAI line
    has all four, null or not)."""
    openai = "custom_id" in row
    record = {}
    for c in COLUMNS["openai" if openai else "native"]:
        value = row.get(c)
        if value is None and not openai:
            continue
        nested = c in ("outputs", "prompt_logprobs", "response") or (openai and c == "error")
        record[c] = json.loads(value) if nested and value is not None else value
    return record


def replica_placement(replicas: int, cpus: float, gpus: int = 0,
                      timeout_s: float = 600.0) -> Any:
    """One placement group for the stage's replicas: ``replicas`` bundles of ``cpus``
    CPUs and ``gpus`` GPUs (a replica's ``tensor_parallel_size``; a bundle is always on
    one node, where the replica's TP ranks, processes of the actor, see its GPUs),
    spread over the nodes where they fit. Reserved at once, for the whole job: a cluster
    that cannot hold them all is a ``RuntimeError`` after ``timeout_s``, not a job that
    waits forever for its last replica. Each replica takes whichever bundle is free, so
    a replica restarted after a failure takes the bundle its predecessor left."""
    import ray
    from ray.util import placement_group, remove_placement_group

    bundle: dict[str, float] = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    group = placement_group([dict(bundle) for _ in range(replicas)], strategy="SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"ray: the cluster cannot hold {replicas} replica(s) of "
                           f"{bundle} each (cluster: {ray.cluster_resources()})")
    return group


def ray_pipeline(rows_path: str, output_dir: str, stage_kwargs: dict[str, Any], *,
                 replicas: int = 1, cpus_per_replica: float = 1.0,
                 gpus_per_replica: int = 0, batch_size: int = 16,
                 concurrent_batches: int = 4, num_rows: int | None = None,
                 stage: type = EngineStage) -> list[dict]:
    """Read ``rows_path`` (JSON lines ``{"lineno", "line"}``), map the rows through
    ``replicas`` ``EngineStage`` replicas (``stage_kwargs``: its constructor's), write
    the output rows as JSON files into ``output_dir``.

    Each replica runs in a bundle of one placement group (``replica_placement``):
    ``cpus_per_replica`` of Ray's CPUs (its engine's threads are its own business; leave
    Ray a CPU for reading and writing) and, on CUDA, ``gpus_per_replica`` GPUs (its
    ``tensor_parallel_size``) on one node. ``concurrent_batches`` batches are answered
    at once by each replica, all into its one engine. A replica that dies is restarted
    and its batches run again (Ray Data's actor retries): each input row is written
    once. ``num_rows``: how many rows the file holds, when known: its rows are then read
    as blocks of ``batch_size`` (a block is what a replica's call takes, so a file read
    as one block would go to one replica, one batch at a time, and be written at the
    end). ``stage``: ``EngineStage`` or a subclass. Returns the placement group's
    bundles (removed when the job ends)."""
    import ray.data
    from ray.util import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = replica_placement(replicas, cpus_per_replica, gpus_per_replica)
    blocks = None if num_rows is None else max(1, -(-num_rows // batch_size))
    ds = ray.data.read_json(rows_path, override_num_blocks=blocks)
    with warnings.catch_warnings():
        # A scheduling strategy has no named parameter in map_batches: it goes through
        # ray_remote_args, which Ray 2.64 removes (the extra pins ray below it).
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        ds = ds.map_batches(
            stage, fn_constructor_kwargs=stage_kwargs, batch_size=batch_size,
            compute=ray.data.ActorPoolStrategy(
                size=replicas, max_tasks_in_flight_per_actor=concurrent_batches,
                max_concurrent_calls_per_actor=concurrent_batches,
                enable_true_multi_threading=True),
            num_cpus=cpus_per_replica, num_gpus=gpus_per_replica or None,
            # Any free bundle (-1): a restarted replica takes the one its predecessor
            # left.
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=-1,
                placement_group_capture_child_tasks=True))
    try:
        ds.write_json(output_dir)
    finally:
        bundles = list(group.bundle_specs)
        remove_placement_group(group)
    return bundles
