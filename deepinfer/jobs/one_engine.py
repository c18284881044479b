"""A job on one engine in this process: the records of ``--input`` through one
``LLMEngine`` (``run_loop``), read lazily with at most ``--max-in-flight`` in flight,
appended to ``--output`` as they finish, with resume, error records, progress bar and
summary."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.formats import warn_other_models
from deepinfer.jobs.input_index import InputIndex, pending_stream
from deepinfer.jobs.input_records import InputRecord, iter_requests, lora_requests
from deepinfer.jobs.output_records import NATIVE
from deepinfer.jobs.parts import merge_outputs
from deepinfer.jobs.resume import announce_resume, load_resume_state
from deepinfer.jobs.run_loop import RunTarget, max_in_flight, run_requests
from deepinfer.sampling.params import SamplingParams


def run_one_engine(args: argparse.Namespace, engine_args: EngineArgs,
                   default_params: SamplingParams, inputs: Iterable[InputRecord],
                   fmt=NATIVE) -> int:
    """Run ``inputs`` not yet in ``args.output``; returns the exit status (1 when a record
    failed). ``args``: ``output``, ``chat``, ``show``, ``no_progress``,
    ``max_in_flight``. ``fmt``: the output lines (``NATIVE``, or ``OpenAIFormat``: then
    the file is put in input order at the end, as DP runs are). ``inputs`` is read
    twice, lazily (``JobInput``): once to index the ids, once to run the records, at
    most ``max_in_flight`` of them in flight."""
    index = InputIndex.of(inputs)
    if fmt is not NATIVE:
        warn_other_models(index.models, args.input, engine_args.model)
    # Also puts an OpenAI output in input order: a run killed after its last record but
    # before the reorder below leaves nothing pending, and returns here.
    done = load_resume_state(args.output, index.order, fmt.final)
    pending = announce_resume(index, done, args.output)
    if not pending:
        return 0
    engine = LLMEngine(engine_args)
    with open(args.output, "a", encoding="utf-8") as out:
        requests = iter_requests(pending_stream(inputs, done), default_params, args.chat,
                                 template_kwargs=args.chat_template_kwargs, track=fmt.track,
                                 loras=lora_requests(args.lora))
        summary = run_requests(RunTarget(engine), requests, out, fmt, show=args.show,
                               progress=not args.no_progress,
                               max_in_flight=max_in_flight(args, engine), total=pending)
    if fmt is not NATIVE:
        merge_outputs(args.output, index.order, [])
    print(summary.format(), file=sys.stderr)
    return 1 if summary.failed else 0
