"""The engine behind a Ray replica, without Ray: ``EngineThread`` takes requests from
several threads at once into one engine (each gets its own output; a refused one fails
alone), and ``EngineStage`` turns a batch of input lines into rows holding the lines a
one-engine run writes (its fields as columns, in both formats, logprob maps included),
bad rows as error rows."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.generate import main
from deepinfer.jobs.engine_thread import EngineThread, result_of
from deepinfer.jobs.input_records import JobRequest
from deepinfer.jobs.ray_stage import COLUMNS, EngineStage, record_of_row
from deepinfer.sampling.params import SamplingParams

ARGS = {"device": "cpu", "kv_cache_memory": 8 << 20, "max_model_len": 64}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama_tied"].path


def test_requests_from_many_threads_share_one_engine(tiny):
    engine = LLMEngine(EngineArgs(model=tiny, **ARGS))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    want = {}
    for i in range(12):  # what each prompt gives alone
        engine.add_request(str(i), f"hello {i}", None, params)
        while engine.has_unfinished():
            for res in engine.step():
                want[res.request_id] = res.outputs[0].token_ids
    loop = EngineThread(engine)

    def ask(i: int):
        # The same id from two threads: the thread keeps them apart.
        return result_of(loop.submit(JobRequest("same", prompt=f"hello {i}", params=params)))

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(ask, range(12)))
    assert [o.outputs[0].token_ids for o in outs] == [want[str(i)] for i in range(12)]
    assert {o.request_id for o in outs} == {"same"}
    refused = result_of(loop.submit(JobRequest("long", prompt="hello " * 200,
                                               params=params)))
    assert isinstance(refused, ValueError) and "'long'" in str(refused)
    again = result_of(loop.submit(JobRequest("x", prompt="hello 3", params=params)))
    assert again.outputs[0].token_ids == want["3"]  # the engine goes on


def test_stage_rows_hold_the_lines_of_a_one_engine_run(tmp_path, tiny):
    lines = [json.dumps({"id": "a", "prompt": "hello world", "max_tokens": 3}),
             "{broken",
             json.dumps({"id": "b", "prompt": "x", "top_p": 7}),
             json.dumps({"id": "c", "prompt": "once upon", "max_tokens": 2, "logprobs": 2})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    one = tmp_path / "one.jsonl"
    assert main(["--input", str(inp), "--output", str(one), "--model", tiny, "--device",
                 "cpu", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
                 "--no-progress"]) == 1
    want = {json.loads(x)["id"]: x for x in one.read_text().splitlines()}
    stage = EngineStage({"model": tiny, **ARGS}, "jsonl",
                        SamplingParams.defaults(temperature=0.0, max_tokens=128))
    rows = stage({"lineno": [1, 2, 3, 4], "line": lines})
    assert tuple(rows) == COLUMNS["native"]
    assert rows["id"] == ["a", "2", "b", "c"]
    assert [e is not None for e in rows["error"]] == [False, True, True, False]
    assert "top_p=7" in rows["error"][2]
    assert [o is not None for o in rows["outputs"]] == [True, False, False, True]
    got = [record_of_row({c: rows[c][i] for c in rows}) for i in range(4)]
    assert {r["id"]: json.dumps(r, ensure_ascii=False) for r in got} == want
    with pytest.raises(ValueError, match="kind='csv'"):
        EngineStage({"model": tiny, **ARGS}, "csv", SamplingParams())


def test_stage_rows_of_openai_lines_with_logprobs(tmp_path, tiny):
    """OpenAI batch lines, logprobs (maps keyed by token text) and an error line: each
    row's columns give back, through ``record_of_row``, the line the CLI writes (less the
    ``created`` time stamp)."""
    def body(i: int) -> dict:
        return {"model": "m", "prompt": f"count {i}", "max_tokens": 3, "logprobs": 2,
                "temperature": 0}

    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": body(i)}) for i in range(3)]
    lines.insert(1, json.dumps({"custom_id": "bad", "method": "POST",
                                "url": "/v1/nothing", "body": body(9)}))
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    one = tmp_path / "one.jsonl"
    assert main(["--input", str(inp), "--output", str(one), "--model", tiny, "--device",
                 "cpu", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
                 "--no-progress"]) == 1

    def stamped(line: dict) -> dict:
        if line["response"] is not None:
            line["response"]["body"]["created"] = 0
        return line

    want = {r["custom_id"]: stamped(r) for r in map(json.loads,
                                                    one.read_text().splitlines())}
    stage = EngineStage({"model": tiny, **ARGS}, "openai",
                        SamplingParams.defaults(temperature=0.0, max_tokens=16))
    rows = stage({"lineno": [1, 2, 3, 4], "line": lines})
    assert tuple(rows) == COLUMNS["openai"]
    assert all(isinstance(v, str) for v in rows["response"] if v is not None)
    got = [stamped(record_of_row({c: rows[c][i] for c in rows})) for i in range(4)]
    assert {r["custom_id"]: r for r in got} == want
    assert [r["error"] is None for r in got] == [True, False, True, True]
    assert got[0]["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"][0]
