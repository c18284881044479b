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
from deepinfer.jobs.output_records import NATIVE, result_text, show_result, write_record
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
                                chat_template_kwargs=req.chat_template_kwargs,
                                pooling=req.pooling, lora_request=req.lora_request)

    def total(self, queued: int) -> int:
        """The progress bar's total when this process has ``queued`` records to run."""
        return queued

    def results(self, finished: Callable[[], int], bar: RunProgress,
                feed: RequestFeed) -> Iterator[RequestOutput]:
        """The finished requests, as they finish. ``finished()``: how many records the
        loop took so far (for ``bar``); ``feed.top_up()`` admits more requests, called
        between steps (a streamed job keeps the engine's batch full)."""
        st = self.engine.stats

        def on_step() -> None:
            feed.top_up()
            bar.update(finished(), st.prompt_tokens, st.generated_tokens)

        return self.engine.drain(on_step=on_step)


#: ``--max-in-flight``'s default, in multiples of the engine's ``max_num_seqs``: the
#: waiting queue then holds three batches beyond the running one, so every step is
#: full and the requests that finish in a step are replaced before the next.
IN_FLIGHT_PER_BATCH = 4


def max_in_flight(args: Any, engine: LLMEngine) -> int:
    """The bound on requests in flight: ``--max-in-flight``, else
    ``IN_FLIGHT_PER_BATCH`` times the engine's ``max_num_seqs``."""
    given = getattr(args, "max_in_flight", None)
    return given if given is not None else (IN_FLIGHT_PER_BATCH
                                            * engine.scheduler.config.max_num_seqs)


class RequestFeed:
    """A job's requests handed to ``admit`` a few at a time: at most ``max_in_flight``
    admitted and not finished yet (None: all at once). A request with ``error`` set, or
    one ``admit`` refuses (``ValueError``), is written to ``out`` as an error line of
    ``fmt`` instead, in request order. Reads ``requests`` lazily: a job of any size holds
    only the requests in flight."""

    def __init__(self, requests: Iterable[JobRequest], admit: Callable[[JobRequest], None],
                 out: TextIO, fmt: Any = NATIVE, max_in_flight: int | None = None) -> None:
        self._requests = iter(requests)
        self._admit, self._out, self._fmt = admit, out, fmt
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # admitted, not finished
        self.admitted = 0
        self.peak_in_flight = 0
        self.failed = 0  # error lines written
        self.exhausted = False
        self.prompts: dict[str, Any] = {}  # shown prompt of each request in flight

    def top_up(self) -> None:
        """Admit requests until ``max_in_flight`` are in flight or none is left."""
        while not self.exhausted and (self.max_in_flight is None
                                      or self.in_flight < self.max_in_flight):
            req = next(self._requests, None)
            if req is None:
                self.exhausted = True
                break
            error = req.error
            if error is None:
                try:
                    self._admit(req)
                    self.prompts[req.request_id] = req.shown
                    self.in_flight += 1
                    self.admitted += 1
                except ValueError as e:
                    error = str(e)
            if error is not None:
                self.failed += 1
                write_record(self._out, self._fmt.error(req.request_id, error))
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def finished(self, request_id: str) -> Any:
        """A request in flight finished; returns its shown prompt."""
        self.in_flight -= 1
        return self.prompts.pop(request_id, None)

    def send_off(self, request_id: str) -> Any:
        """An admitted request leaves this process unfinished (a PD PROMPT rank hands it
        to a decode rank, which writes its line): no longer in flight here. Returns what
        its line needs from this process, for the receiver's ``arrived``."""
        self.finished(request_id)
        return self._fmt.release(request_id)

    def arrived(self, request_id: str, record: Any) -> None:
        """A request handed to this process by another (``send_off`` there)."""
        if record is not None:
            self._fmt.track(record)


def submit_requests(admit: Callable[[JobRequest], None], requests: Iterable[JobRequest],
                    out: TextIO, fmt: Any = NATIVE) -> tuple[dict[str, Any], int]:
    """Pass every good request to ``admit`` at once (``RequestFeed`` without a bound);
    returns the shown prompt of each admitted request by id (for ``--show``) and the
    number of error lines written."""
    feed = RequestFeed(requests, admit, out, fmt)
    feed.top_up()
    return feed.prompts, feed.failed


def run_requests(target: RunTarget, requests: Iterable[JobRequest], out: TextIO,
                 fmt: Any = NATIVE, *, show: bool = False, progress: bool = True,
                 max_in_flight: int | None = None, total: int | None = None
                 ) -> RunSummary:
    """Submit ``requests`` to ``target``, at most ``max_in_flight`` in flight at a time
    (None: all at once), and write each finished one to ``out`` as a line of ``fmt``
    (``NATIVE`` or an ``OpenAIFormat``) as it finishes; ``show`` prints it too
    (``--show``), ``progress`` shows the bar (``total``: how many records this process
    runs, when ``requests`` is a stream). Returns this process's counters: a request
    that failed while running (``RequestOutput.error``) or a result that could not be
    written (``write_record``) counts as failed."""
    fmt.use_tokenizer(target.engine.tokenizer)
    feed = RequestFeed(requests, target.admit, out, fmt, max_in_flight)
    feed.top_up()
    if total is None and feed.exhausted:
        total = feed.in_flight + feed.failed
    bar = RunProgress(target.total(total or 0), target.bar_title, disable=not progress)
    results = [0]  # read by the target as the loop goes (progress, DP's vote)
    unwritable = 0
    for res in target.results(lambda: results[0] + feed.failed, bar, feed):
        shown = feed.finished(res.request_id)
        if res.error is not None:  # failed while running: fails alone, as a bad line
            write_record(out, fmt.error(res.request_id, res.error))
            unwritable += 1
        elif not write_record(out, fmt.result(res)):
            unwritable += 1  # written as an error line instead (see write_record)
        results[0] += 1
        if show:
            show_result(res.request_id, shown, result_text(res),
                        prefix=target.show_prefix)
    bar.close()
    return RunSummary.of_engine(target.engine, feed.admitted - unwritable,
                                feed.failed + unwritable, bar.elapsed())
