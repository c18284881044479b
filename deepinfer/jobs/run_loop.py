"""The one loop of every job: submit its requests to an engine, drain it, and write, show
and count each finished request; the rank's ``RunSummary`` at the end.

A one-engine run, each DP replica's leader and each rank of a PD run all go through
``run_requests``. What differs between them is the ``RunTarget`` they pass: the engine
the requests go to, where finished requests come from (the engine's ``drain``, a drain
whose end the DP group votes on, the PD rounds), what the progress bar counts, and how a
shown result is labelled. Combining the ranks' summaries and merging part files is the
caller's (``one_engine``, ``dp_job``, ``pd_job``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from deepinfer.engine import LLMEngine
from deepinfer.jobs.input_records import JobRequest
from deepinfer.jobs.output_records import NATIVE, show_result, write_record
from deepinfer.jobs.progress import RunProgress
from deepinfer.jobs.summary import RunSummary
from deepinfer.outputs import RequestOutput


class RunTarget:
    """Where the loop runs its requests: one engine in this process, on its own (a
    one-engine run). ``dp_job`` and ``pd_job`` subclass it."""

    bar_title = "generate"
    show_prefix = ""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def admit(self, req: JobRequest) -> None:
        """Queue ``req`` on the engine (the engine's admission: chat template, length
        fit); ``ValueError`` when it can never run."""
        self.engine.add_request(req.request_id, req.prompt, req.prompt_token_ids,
                                req.params, messages=req.messages,
                                chat_template_kwargs=req.chat_template_kwargs)

    def total(self, queued: int) -> int:
        """The progress bar's total when this process queued ``queued`` requests."""
        return queued

    def results(self, finished: Callable[[], int], bar: RunProgress
                ) -> Iterator[RequestOutput]:
        """The finished requests, as they finish. ``finished()``: how many the loop took
        so far (for ``bar``)."""
        st = self.engine.stats
        return self.engine.drain(
            on_step=lambda: bar.update(finished(), st.prompt_tokens, st.generated_tokens))


def submit_requests(admit: Callable[[JobRequest], None], requests: Iterable[JobRequest],
                    out: TextIO, fmt: Any = NATIVE) -> tuple[dict[str, Any], int]:
    """Pass each good request to ``admit``; a request with ``error`` set, or one that
    ``admit`` refuses (``ValueError``), is written to ``out`` as an error line of ``fmt``
    instead, in request order. Returns the shown prompt of each admitted request by id
    (for ``--show``) and the number of error lines written."""
    prompts: dict[str, Any] = {}
    failed = 0
    for req in requests:
        error = req.error
        if error is None:
            try:
                admit(req)
                prompts[req.request_id] = req.shown
            except ValueError as e:
                error = str(e)
        if error is not None:
            failed += 1
            write_record(out, fmt.error(req.request_id, error))
    return prompts, failed


def run_requests(target: RunTarget, requests: Iterable[JobRequest], out: TextIO,
                 fmt: Any = NATIVE, *, show: bool = False, progress: bool = True
                 ) -> RunSummary:
    """Submit ``requests`` to ``target``, then write each finished one to ``out`` as a
    line of ``fmt`` (``NATIVE`` or an ``OpenAIFormat``) as it finishes; ``show`` prints
    it too (``--show``), ``progress`` shows the bar. Returns this process's counters:
    a request that failed while running (``RequestOutput.error``) or a result that could
    not be written (``write_record``) counts as failed."""
    fmt.use_tokenizer(target.engine.tokenizer)
    prompts, failed = submit_requests(target.admit, requests, out, fmt)
    bar = RunProgress(target.total(len(prompts)), target.bar_title, disable=not progress)
    finished = [0]  # read by the target as the loop goes (progress, DP's vote)
    unwritable = 0
    for res in target.results(lambda: finished[0], bar):
        if res.error is not None:  # failed while running: fails alone, as a bad line
            write_record(out, fmt.error(res.request_id, res.error))
            unwritable += 1
        elif not write_record(out, fmt.result(res)):
            unwritable += 1  # written as an error line instead (see write_record)
        finished[0] += 1
        if show:
            show_result(res.request_id, prompts[res.request_id], res.outputs[0].text,
                        prefix=target.show_prefix)
    bar.close()
    return RunSummary.of_engine(target.engine, len(prompts) - unwritable,
                                failed + unwritable, bar.elapsed())
