"""A job on one engine in this process: the records of ``--input`` through one
``LLMEngine``, appended to ``--output`` as they finish, with resume, error records,
progress bar and summary."""

from __future__ import annotations

import argparse
import sys

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.parts import input_order, merge_outputs
from deepinfer.jobs.progress import RunProgress
from deepinfer.jobs.records import (
    NATIVE,
    InputRecord,
    show_result,
    submit_records,
    write_record,
)
from deepinfer.jobs.resume import load_resume_state, pending_records
from deepinfer.jobs.summary import RunSummary
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
        prompts, failed = submit_records(engine, pending, default_params, args.chat, out,
                                         fmt)
        bar = RunProgress(len(prompts), disable=args.no_progress)
        st = engine.stats
        finished = 0

        def progress() -> None:
            bar.update(finished, st.prompt_tokens, st.generated_tokens)

        unwritable = 0
        for res in engine.drain(on_step=progress):
            if not write_record(out, fmt.result(res)):
                unwritable += 1  # written as an error line instead (see write_record)
            finished += 1
            if args.show:
                show_result(res.request_id, prompts[res.request_id], res.outputs[0].text)
        bar.close()
    if fmt is not NATIVE:
        merge_outputs(args.output, input_order(r.id for r in inputs), [])
    failed += unwritable
    summary = RunSummary.of_engine(engine, len(prompts) - unwritable, failed, bar.elapsed())
    print(summary.format(), file=sys.stderr)
    return 1 if failed else 0
