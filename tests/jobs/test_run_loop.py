"""The one loop of every job (``deepinfer.jobs.run_loop``) on a stand-in engine: refused
and bad requests become error lines in request order, results are written as the target
hands them out, ``--show`` prints them, and the summary counts each kind."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from deepinfer.engine import EngineStats
from deepinfer.jobs.input_records import JobRequest
from deepinfer.jobs.output_records import NATIVE
from deepinfer.jobs.run_loop import RunTarget, run_requests
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling.params import SamplingParams
from deepinfer_scheduler.outputs import SchedulerStats


class StandInEngine:
    """What the loop uses of an ``LLMEngine``: ``add_request``, ``drain``, stats, the
    resident weight bytes and the tokenizer (for the output format; native lines use
    none)."""

    def __init__(self, refuse: set[str]) -> None:
        self.weight_bytes = 96_500_000
        self.sampling_defaults: dict = {}
        self.tokenizer = None
        self.stats = EngineStats()
        self.scheduler = SimpleNamespace(stats=SchedulerStats())
        self.refuse = refuse
        self.queued: list[tuple] = []

    def add_request(self, rid, prompt, prompt_token_ids, params, *, messages=None,
                    chat_template_kwargs=None, pooling=None, lora_request=None) -> None:
        if rid in self.refuse:
            raise ValueError(f"request {rid!r}: too long")
        self.queued.append((rid, prompt, messages, params))

    def drain(self, keep_going=None, on_step=None):
        for rid, *_ in self.queued:
            self.stats.generated_tokens += 2
            if on_step is not None:
                on_step()
            yield _output(rid)


def _output(rid: str) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, f"text of {rid}", [5, 6],
                                                              "length")], True)


def _requests() -> list[JobRequest]:
    sp = SamplingParams(max_tokens=2)
    return [JobRequest("a", prompt="prompt a", params=sp, shown="prompt a"),
            JobRequest("b", prompt="prompt b", params=sp, shown="prompt b"),
            JobRequest("c", error="line 3: malformed JSON"),
            JobRequest("d", messages=[{"role": "user", "content": "hi"}], params=sp,
                       shown=[{"role": "user", "content": "hi"}])]


def test_loop_writes_errors_then_results_and_counts(capsys):
    engine = StandInEngine(refuse={"b"})
    out = io.StringIO()
    summary = run_requests(RunTarget(engine), _requests(), out, show=True, progress=False)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines[:2] == [{"id": "b", "error": "request 'b': too long"},
                         {"id": "c", "error": "line 3: malformed JSON"}]
    assert [x["id"] for x in lines[2:]] == ["a", "d"]
    assert lines[2]["outputs"] == [{"text": "text of a", "token_ids": [5, 6],
                                    "finish_reason": "length"}]
    # The chat request went to the engine as messages (the engine applies the template).
    assert engine.queued[1][2] == [{"role": "user", "content": "hi"}]
    assert (summary.num_ok, summary.failed, summary.generated_tokens) == (2, 2, 4)
    assert summary.weight_bytes == 96_500_000
    assert summary.format().endswith("| weights 96.5 MB")
    shown = capsys.readouterr().out
    assert "[a] 'prompt a'\n  -> 'text of a'" in shown
    assert "[d] [{'role': 'user', 'content': 'hi'}]" in shown


class RoundsTarget(RunTarget):
    """Results from somewhere other than the engine's drain (as PD rounds hand them out),
    recording how many the loop had taken each time it asked (what DP's vote reads)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.seen: list[int] = []

    def results(self, finished, bar, top_up):
        for rid in ("d", "a"):
            self.seen.append(finished())
            yield _output(rid)
        self.seen.append(finished())


class NaNFormat:
    """A format whose result line for ``a`` holds NaN: not writable as JSON."""

    final = staticmethod(NATIVE.final)
    error = staticmethod(NATIVE.error)
    use_tokenizer = staticmethod(NATIVE.use_tokenizer)

    @staticmethod
    def result(res):
        line = NATIVE.result(res)
        if res.request_id == "a":
            line["score"] = float("nan")
        return line


def test_loop_takes_results_from_the_target_and_fails_unwritable_ones():
    target = RoundsTarget(StandInEngine(refuse=set()))
    out = io.StringIO()
    summary = run_requests(target, _requests(), out, NaNFormat(), progress=False)
    assert target.seen == [1, 2, 3]  # c's error line counts as taken
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["id"] for x in lines] == ["c", "d", "a"]
    assert "non-finite" in lines[2]["error"]  # written as an error line instead
    # a, b and d were admitted; a's result could not be written; c was bad.
    assert (summary.num_ok, summary.failed) == (2, 2)
