"""``deepinfer-generate --ray [ADDRESS] --replicas N``: a batch file through the Ray Data
pipeline (``ray_stage``), on a local Ray cluster or the one at ``ADDRESS``.

The driver reads the input once, lazily: lines that fail by themselves (not UTF-8,
malformed, a repeated id) are written as error records at once, lines already in the
output are skipped (resume), and the others go to a rows file next to the output, which
Ray reads (a cluster's nodes need that folder, as ``--dp`` across nodes does). Ray's
output files are then appended to the output, and the output is put in input order.
Each replica is an independent engine: a slow or lost one holds up no other, and Ray
restarts a lost one and runs its batches again.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.formats import JobInput, warn_other_models
from deepinfer.jobs.input_index import InputIndex, pending_stream
from deepinfer.jobs.output_records import NATIVE, write_record
from deepinfer.jobs.parts import merge_outputs
from deepinfer.jobs.ray_stage import ray_pipeline, record_of_row
from deepinfer.jobs.resume import announce_resume, load_resume_state
from deepinfer.jobs.run_loop import IN_FLIGHT_PER_BATCH
from deepinfer.sampling.params import SamplingParams


def replica_cpus(cluster_cpus: float, replicas: int) -> float:
    """Ray CPUs each replica reserves: one, or less where the cluster has fewer than one
    each plus one for Ray's reads and writes (an engine uses the cores it finds)."""
    return max(0.1, min(1.0, (cluster_cpus - 1) / replicas))


def replica_batches(args: argparse.Namespace, engine_args: EngineArgs) -> tuple[int, int]:
    """(rows a Ray batch, batches a replica answers at once): together the requests a
    replica keeps in flight, ``--max-in-flight`` or its default (``IN_FLIGHT_PER_BATCH``
    engine batches), so that its engine's batch stays full as Ray batches come and go.
    Batches of 16 to 64 rows: smaller ones cost Ray a task each, larger ones hold their
    first records back longer."""
    seqs = engine_args.num_seqs()
    in_flight = getattr(args, "max_in_flight", None) or IN_FLIGHT_PER_BATCH * seqs
    batch = max(16, min(64, in_flight // 16))
    return batch, max(1, -(-in_flight // batch))


def write_rows(inputs: JobInput, done: set[str], rows_path: str, out: Any, fmt: Any
               ) -> tuple[int, int]:
    """The pending good lines of ``inputs`` as rows ``{"lineno", "line"}`` in
    ``rows_path``; the lines that fail by themselves written to ``out`` as error records
    at once. Returns (rows written, error records written)."""
    rows = failed = 0
    with open(rows_path, "w", encoding="utf-8") as f:
        for rec in pending_stream(inputs, done):
            if rec.error is not None:
                fmt.track(rec)
                write_record(out, fmt.error(rec.id, rec.error))
                failed += 1
            else:
                lineno, text = rec.source
                f.write(json.dumps({"lineno": lineno, "line": text}, ensure_ascii=False)
                        + "\n")
                rows += 1
    return rows, failed


def run_ray_job(args: argparse.Namespace, engine_args: EngineArgs,
                default_params: SamplingParams, inputs: JobInput, fmt: Any = NATIVE) -> int:
    """Run the records of ``inputs`` not yet in ``args.output`` on Ray (``args.ray``:
    ``"local"`` or a cluster address; ``args.replicas``); returns the exit status (1
    when a record failed)."""
    import ray

    index = InputIndex.of(inputs)
    if fmt is not NATIVE:
        warn_other_models(index.models, args.input, engine_args.model)
    done = load_resume_state(args.output, index.order, fmt.final)
    if not announce_resume(index, done, args.output):
        return 0
    work = tempfile.mkdtemp(prefix=".deepinfer-ray-",
                            dir=os.path.dirname(os.path.abspath(args.output)))
    t0 = time.perf_counter()
    try:
        with open(args.output, "a", encoding="utf-8") as out:
            rows, failed = write_rows(inputs, done, os.path.join(work, "rows.jsonl"), out,
                                      fmt)
        ok = 0
        if rows:
            started = not ray.is_initialized()
            ray.init(address=None if args.ray == "local" else args.ray,
                     include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True, logging_level=logging.WARNING)
            quiet_ray_data(not args.no_progress)
            cpus = replica_cpus(ray.cluster_resources().get("CPU", 1.0), args.replicas)
            on_cuda = str(engine_args.device).startswith("cuda")
            stage = {"engine_args": dataclasses.asdict(engine_args), "kind": inputs.kind,
                     "default_params": default_params, "chat": args.chat,
                     "template_kwargs": args.chat_template_kwargs,
                     "token_ids": getattr(args, "return_tokens_as_token_ids", False)}
            batch, calls = replica_batches(args, engine_args)
            ray_pipeline(os.path.join(work, "rows.jsonl"), os.path.join(work, "out"),
                         stage, replicas=args.replicas, cpus_per_replica=cpus,
                         gpus_per_replica=engine_args.tensor_parallel_size if on_cuda else 0,
                         batch_size=batch, concurrent_batches=calls, num_rows=rows)
            ok, errors = append_ray_output(os.path.join(work, "out"), args.output)
            failed += errors
            if started and args.ray == "local":
                ray.shutdown()  # the cluster this run started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    merge_outputs(args.output, index.order, [])
    print(f"done: {ok} requests ok, {failed} failed | ray: {args.replicas} replica(s) in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 1 if failed else 0


def quiet_ray_data(progress: bool) -> None:
    """Ray Data's progress bars only when a bar is wanted, and its INFO log lines off
    the terminal (they go to Ray's log files)."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ctx.print_on_execution_start = False


def append_ray_output(folder: str, output: str) -> tuple[int, int]:
    """Append the line of every row of Ray's output files in ``folder`` to ``output``
    (``ray_stage.record_of_row``); returns (records ok, error records)."""
    ok = failed = 0
    with open(output, "a", encoding="utf-8") as out:
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    out.write(json.dumps(record_of_row(row), ensure_ascii=False) + "\n")
                    if row.get("error") is None:
                        ok += 1
                    else:
                        failed += 1
        out.flush()
    return ok, failed
