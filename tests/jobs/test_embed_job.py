"""Embeddings from ``deepinfer-generate``: ``--embed`` over .txt/.jsonl records (``{"id",
"embedding"}`` lines), OpenAI batch ``/v1/embeddings`` lines (float or base64, beside
completion lines of the same file), resume, DP, and bad lines or flags named: a bad line
fails alone, a bad flag exits 2."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from deepinfer import LLM, PoolingParams
from deepinfer.generate import main

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Hello"]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoints) -> str:
    return tiny_checkpoints["qwen3"].path


def _args(model_path: str) -> list[str]:
    return ["--model", model_path, "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(8 << 20), "--max-model-len", "64", "--no-progress"]


@pytest.fixture(scope="module")
def want(model_path) -> dict[str, list[float]]:
    """``LLM.embed``'s vectors of ``TEXTS`` (full and cut to 8), the reference."""
    llm = LLM(model_path, device="cpu", dtype="float32", kv_cache_memory=8 << 20,
              max_model_len=64)
    full = llm.embed(TEXTS, use_tqdm=False)
    cut = llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    return {**{t: o.outputs.embedding for t, o in zip(TEXTS, full)},
            **{f"{t}/8": o.outputs.embedding for t, o in zip(TEXTS, cut)}}


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dp", [1, 2])
def test_embed_flag_writes_one_vector_per_record_and_resumes(tmp_path, model_path, want,
                                                             dp):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out.jsonl"
    extra = ["--dp", "2"] if dp == 2 else []
    assert main(["--input", str(inp), "--output", str(out), "--embed", *extra,
                 *_args(model_path)]) == 0
    recs = sorted(_read(out), key=lambda r: r["id"])
    assert [r["id"] for r in recs] == ["1", "2", "3"] and all(set(r) == {"id", "embedding"}
                                                              for r in recs)
    for r, text in zip(recs, TEXTS):
        _close(r["embedding"], want[text])
    if dp == 2:
        return
    # Resume: a killed run left the first line only; the rerun writes the other two.
    out.write_text(json.dumps(recs[0]) + "\n")
    assert main(["--input", str(inp), "--output", str(out), "--embed",
                 *_args(model_path)]) == 0
    assert sorted(r["id"] for r in _read(out)) == ["1", "2", "3"]

    # --dimensions, on .jsonl records (their sampling keys are not used).
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": t, "temperature": 0.5})
                               for i, t in enumerate(TEXTS)) + "\n")
    cut = tmp_path / "cut.jsonl"
    assert main(["--input", str(jsonl), "--output", str(cut), "--embed", "--dimensions",
                 "8", *_args(model_path)]) == 0
    for r, text in zip(_read(cut), TEXTS):
        _close(r["embedding"], want[f"{text}/8"])


def _line(cid: str, url: str = "/v1/embeddings", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_openai_embedding_lines(tmp_path, model_path, want, tiny_checkpoints):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_path)(TEXTS[1])["input_ids"]
    lines = [
        _line("f", model="m", input=TEXTS[0]),
        _line("b64", input=[TEXTS[1]], encoding_format="base64", dimensions=8),
        _line("ids", input=ids),
        _line("done", url="/v1/completions", prompt="Hi", max_tokens=2, temperature=0),
        _line("two", input=["a", "b"]),
        _line("wide", input="x", dimensions=65),
        _line("enc", input="x", encoding_format="int8"),
        _line("extra", input="x", temperature=0.5),
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *_args(model_path)]) == 1
    recs = {r["custom_id"]: r for r in _read(out)}
    assert list(recs) == ["f", "b64", "ids", "done", "two", "wide", "enc", "extra"]
    body = recs["f"]["response"]["body"]
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    _close(body["data"][0]["embedding"], want[TEXTS[0]])
    raw = base64.b64decode(recs["b64"]["response"]["body"]["data"][0]["embedding"])
    _close(list(struct.unpack("<8f", raw)), want[f"{TEXTS[1]}/8"])
    _close(recs["ids"]["response"]["body"]["data"][0]["embedding"], want[TEXTS[1]])
    assert recs["done"]["response"]["body"]["object"] == "text_completion"
    errors = {c: r["error"]["message"] for c, r in recs.items() if r["error"] is not None}
    assert set(errors) == {"two", "wide", "enc", "extra"}
    assert "body.input: must be a non-empty string or list of token ids" in errors["two"]
    assert "dimensions=65: the model's embeddings have 64" in errors["wide"]
    assert "body.encoding_format: 'int8'" in errors["enc"]
    assert "body.temperature: unknown field" in errors["extra"]


@pytest.mark.parametrize("flags, message", [
    (["--dimensions", "8"], "--dimensions 8: only with --embed"),
    (["--embed", "--dimensions", "0"], "--dimensions=0: must be a positive integer"),
    (["--embed", "--dimensions", "65"], "--dimensions=65: the model's embeddings have 64"),
    (["--embed", "--n", "2"], "--embed and --n cannot be combined"),
    (["--embed", "--pd", "1:1"], "--embed and --pd cannot be combined"),
])
def test_bad_embed_flags_exit_2(tmp_path, model_path, capsys, flags, message):
    inp = tmp_path / "in.txt"
    inp.write_text("hello\n")
    assert main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), *flags,
                 *_args(model_path)]) == 2
    assert message in capsys.readouterr().err


def test_embed_flag_on_an_openai_file_is_named(tmp_path, model_path, capsys):
    inp = tmp_path / "batch.jsonl"
    inp.write_text(_line("a", input="x") + "\n")
    assert main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--embed",
                 *_args(model_path)]) == 2
    assert "--embed: " in capsys.readouterr().err


def test_ray_stage_rows_of_embedding_lines(tmp_path, model_path):
    """The engine behind a Ray replica (``EngineStage``, without Ray): OpenAI embedding
    lines give back, through ``record_of_row``, the lines a one-engine run writes."""
    from deepinfer.jobs.ray_stage import EngineStage, record_of_row
    from deepinfer.sampling.params import SamplingParams

    lines = [_line("a", input=TEXTS[0]), _line("b", input=TEXTS[2], dimensions=4),
             _line("bad", input=[])]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    one = tmp_path / "one.jsonl"
    assert main(["--input", str(inp), "--output", str(one), *_args(model_path)]) == 1
    stage = EngineStage({"model": model_path, "device": "cpu", "dtype": "float32",
                         "kv_cache_memory": 8 << 20, "max_model_len": 64}, "openai",
                        SamplingParams())
    rows = stage({"lineno": [1, 2, 3], "line": lines})
    got = [record_of_row({c: rows[c][i] for c in rows}) for i in range(3)]
    want = _read(one)
    assert [r["custom_id"] for r in got] == ["a", "b", "bad"]
    for g, w in zip(got, want):
        assert (g["error"] is None) == (w["error"] is None)
        if w["error"] is None:
            _close(g["response"]["body"]["data"][0]["embedding"],
                   w["response"]["body"]["data"][0]["embedding"])
    assert len(got[1]["response"]["body"]["data"][0]["embedding"]) == 4
