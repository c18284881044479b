"""Token steering in batch files (issue 28, part 4): ``logit_bias`` (OpenAI's string
keys), ``allowed_token_ids`` and ``bad_words`` per line in both formats; a bad value
fails that line naming the field, a line whose steering leaves nothing to sample fails
while running, and the other lines run."""

from __future__ import annotations

import json

from deepinfer.generate import main
from deepinfer.jobs.openai_batch import parse_openai_line

CHOICE = {"choice": ["yes", "no"]}


def _native(rid: str, **kw) -> str:
    return json.dumps({"id": rid, "prompt": "hello world", "max_tokens": 4, **kw})


def _openai(cid: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "hello world", "max_tokens": 4, "temperature": 0,
                                **body}})


def _run(tmp_path, model: str, lines: list[str], name: str) -> tuple[int, dict]:
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    rc = main(["--input", str(inp), "--output", str(out), "--model", model,
               "--device", "cpu", "--kv-cache-memory", str(8 << 20), "--no-progress"])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    return rc, {r.get("id") if "id" in r and "custom_id" not in r else r["custom_id"]: r
                for r in recs}


def test_native_lines(tmp_path, tiny_checkpoints):
    model = tiny_checkpoints["llama3"].path
    rc, recs = _run(tmp_path, model, [
        _native("forced", logit_bias={"7": 100}),
        _native("allowed", temperature=1.0, seed=1, allowed_token_ids=[9, 10, 11]),
        _native("under_grammar", structured_outputs=CHOICE, allowed_token_ids=[7]),
        _native("bias_range", logit_bias={"7": 150}),
        _native("bias_key", logit_bias={"seven": 1}),
        _native("vocab", allowed_token_ids=[5, 10_000]),
        _native("plain"),
    ], "native")
    assert rc == 1
    assert recs["forced"]["outputs"][0]["token_ids"] == [7] * 4
    assert set(recs["allowed"]["outputs"][0]["token_ids"]) <= {9, 10, 11}
    assert "nothing left to sample" in recs["under_grammar"]["error"]
    assert "logit_bias[7]=150" in recs["bias_range"]["error"]
    assert "logit_bias: key 'seven'" in recs["bias_key"]["error"]
    assert "allowed_token_ids: token ids [10000] outside the vocabulary" in recs["vocab"]["error"]
    assert len(recs["plain"]["outputs"][0]["token_ids"]) >= 1


def test_openai_lines(tmp_path, tiny_checkpoints):
    model = tiny_checkpoints["llama3"].path
    rc, recs = _run(tmp_path, model, [
        _openai("forced", logit_bias={"7": 100}),
        _openai("banned", logit_bias={"7": -100}, allowed_token_ids=[7, 8]),
        _openai("bad_words", bad_words=["hello"]),
        _openai("bias_range", logit_bias={"7": -101}),
        _openai("plain"),
    ], "openai")
    assert rc == 1
    body = recs["forced"]["response"]["body"]
    assert body["usage"]["completion_tokens"] == 4
    assert recs["banned"]["response"]["status_code"] == 200
    assert recs["bad_words"]["response"]["status_code"] == 200
    err = recs["bias_range"]["error"]
    assert err["code"] == "invalid_request" and "logit_bias[7]=-101" in err["message"]
    assert recs["plain"]["response"]["status_code"] == 200
    # The fields are taken under their own names; an empty logit_bias asks for nothing.
    rec = parse_openai_line(_openai("x", logit_bias={"3": 2}, bad_words=["a b"],
                                    allowed_token_ids=[1, 2]), 1)
    assert rec.error is None
    assert {k: rec.overrides[k] for k in ("logit_bias", "bad_words", "allowed_token_ids")
            } == {"logit_bias": {"3": 2}, "bad_words": ["a b"], "allowed_token_ids": [1, 2]}
    assert "logit_bias" not in parse_openai_line(_openai("y", logit_bias={}), 1).overrides
