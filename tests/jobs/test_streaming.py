"""Bounded streaming (issue 29, part 1): a job reads its input lazily and keeps at most
``--max-in-flight`` requests submitted; its output equals an unbounded run, record for
record; a run killed mid-file resumes where it stopped; bad bounds exit 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.generate import main
from deepinfer.jobs.input_index import InputIndex, pending_stream
from deepinfer.jobs.input_records import InputRecord, iter_requests, read_inputs
from deepinfer.jobs.run_loop import RunTarget, run_requests
from deepinfer.sampling.params import SamplingParams
from tests.distributed.run_files import ENV, ROOT, read_lines


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama_tied"].path


def _args(tiny: str) -> list[str]:
    return ["--model", tiny, "--device", "cpu", "--max-tokens", "3", "--kv-cache-memory",
            str(8 << 20), "--max-model-len", "64", "--no-progress", "--max-num-seqs", "4"]


class CountingTarget(RunTarget):
    """A one-engine target that checks, at each admission, how many requests the engine
    holds and how many records the loop has read."""

    def __init__(self, engine: LLMEngine, pulled: list[int]) -> None:
        super().__init__(engine)
        self.pulled = pulled
        self.peak_engine = 0
        self.peak_read_ahead = 0
        self.finished = 0

    def admit(self, req) -> None:
        super().admit(req)
        self.peak_engine = max(self.peak_engine, len(self.engine.requests))

    def results(self, finished, bar, top_up):
        for res in super().results(finished, bar, top_up):
            self.finished += 1
            self.peak_read_ahead = max(self.peak_read_ahead, self.pulled[0] - self.finished)
            yield res


def test_in_flight_never_exceeds_the_bound(tmp_path, tiny):
    engine = LLMEngine(EngineArgs(model=tiny, device="cpu", kv_cache_memory=8 << 20,
                                  max_model_len=64, max_num_seqs=4))
    pulled = [0]

    def records():
        for i in range(40):
            pulled[0] += 1
            yield InputRecord(id=str(i), prompt=f"hello {i} world",
                              overrides={"max_tokens": 1 + i % 3})

    target = CountingTarget(engine, pulled)
    params = SamplingParams(temperature=0.0)
    with open(tmp_path / "out.jsonl", "w") as out:
        summary = run_requests(target, iter_requests(records(), params, False), out,
                               max_in_flight=5, total=40, progress=False)
    assert summary.num_ok == 40 and summary.failed == 0
    assert target.peak_engine == 5  # full, never over
    # Read ahead of what finished: at most the bound (plus the one read when a slot frees).
    assert target.peak_read_ahead <= 6
    ids = [json.loads(x)["id"] for x in read_lines(tmp_path / "out.jsonl")]
    assert sorted(ids, key=int) == [str(i) for i in range(40)]


def _lines(n: int) -> list[str]:
    lines = []
    for i in range(n):
        if i == 7:
            lines.append("{not json")
        elif i == 11:
            lines.append(json.dumps({"id": "r3", "prompt": "a repeated id"}))
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"tell me about {i}",
                                     "max_tokens": 1 + i % 4}))
    return lines


def test_a_streamed_run_equals_an_unbounded_one(tmp_path, tiny):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(_lines(30)) + "\n")
    outs = {}
    for bound in ("1", "3", "1000"):
        out = tmp_path / f"out{bound}.jsonl"
        assert main(["--input", str(inp), "--output", str(out), *_args(tiny),
                     "--max-in-flight", bound]) == 1  # the bad line and the repeated id
        outs[bound] = sorted(read_lines(out))
    assert outs["1"] == outs["3"] == outs["1000"]
    assert len(outs["1"]) == 30


def test_index_and_pending_stream_are_lazy_and_agree(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(_lines(20)) + "\n")
    index = InputIndex.of(read_inputs(str(inp)))
    assert index.records == 20 and index.order["r3"] == 3 and "8" in index.failing
    done = {"r0", "r1", "r3", "8"}  # "8" is the bad line's id: it runs again
    pending = list(pending_stream(read_inputs(str(inp)), done))
    assert len(pending) == index.pending_count(done) == 17
    assert [r.id for r in pending if r.error] == ["8", "r3"]  # the repeat of r3 fails


def test_bad_bounds_exit_2(tmp_path, tiny, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(_lines(1)[0] + "\n")
    for bad in ("0", "-3"):
        rc = main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                   *_args(tiny), "--max-in-flight", bad])
        assert rc == 2 and f"--max-in-flight {bad}" in capsys.readouterr().err


def test_a_killed_streamed_run_resumes(tmp_path, tiny):
    n = 400
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": f"number {i}",
                                         "max_tokens": 6, "ignore_eos": True})
                             for i in range(n)) + "\n")
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output",
            str(out), *_args(tiny), "--max-in-flight", "4"]
    proc = subprocess.Popen(argv, env=ENV, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not (out.exists() and out.read_text().count("\n") >= 10):
            assert proc.poll() is None, "the run ended before the kill"
            assert time.monotonic() - t0 < 120, "no records"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    kept = read_lines(out)
    assert 10 <= len(kept) < n
    assert main(["--input", str(inp), "--output", str(out), *_args(tiny),
                 "--max-in-flight", "4"]) == 0
    lines = read_lines(out)
    ids = [json.loads(x)["id"] for x in lines]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # each once
    assert lines[:len(kept) - 1] == kept[:-1]  # kept as written (the last may be torn)
