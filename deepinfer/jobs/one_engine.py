"""A job on one engine in this process: the records of ``--input`` through one
``LLMEngine`` (``run_loop``), appended to ``--output`` as they finish, with resume, error
records, progress bar and summary."""

from __future__ import annotations

import argparse
import sys

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.input_records import InputRecord, to_requests
from deepinfer.jobs.output_records import NATIVE
from deepinfer.jobs.parts import input_order, merge_outputs
from deepinfer.jobs.resume import load_resume_state, pending_records
from deepinfer.jobs.run_loop import RunTarget, run_requests
from deepinfer.sampling.params import SamplingParams


def run_one_engine(args: argparse.Namespace, engine_args: EngineArgs,
                   default_params: SamplingParams, inputs: list[InputRecord],
                   fmt=NATIVE) -> int:
    """Run ``inputs`` not yet in ``args.output``; returns the exit status (1 when a record
    failed). ``args``: ``output``, ``chat``, ``show``, ``no_progress``. ``fmt``: the output
    lines (``NATIVE``, or ``OpenAIFormat``: then the file is put in input order at the
    end, as DP runs are)."""
    # Also puts an OpenAI output in input order: a run killed after its last record but
    # before the reorder below leaves nothing pending, and returns here.
    done = load_resume_state(args.output, inputs, fmt.final)
    pending = pending_records(inputs, done, args.output)
    if not pending:
        return 0
    engine = LLMEngine(engine_args)
    with open(args.output, "a", encoding="utf-8") as out:
        summary = run_requests(RunTarget(engine),
                               to_requests(pending, default_params, args.chat,
                                           template_kwargs=args.chat_template_kwargs), out, fmt,
                               show=args.show, progress=not args.no_progress)
    if fmt is not NATIVE:
        merge_outputs(args.output, input_order(r.id for r in inputs), [])
    print(summary.format(), file=sys.stderr)
    return 1 if summary.failed else 0
