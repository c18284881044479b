"""``prompt_logprobs`` through ``deepinfer-generate`` over real gloo ranks: ``--tp 2``
(each chunk of scored rows gathered across the vocabulary shards), ``--dp 2`` and
``--pd 1:1`` (the logprobs scored on the prompt rank travel with the hand-off) give
transformers' ``log_softmax`` over the same prompt within 1e-4, as one rank does;
``max_tokens: 0`` lines (scored, nothing generated) finish on the prompt rank."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from deepinfer.generate import main
from tests.distributed.run_files import read_lines
from tests.models.test_models import hf_logits

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello world",
           "once upon a time there was a paged attention kernel", "a b c d e f g"]


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoints):
    # Tied embeddings: the vocabulary-parallel embedding is the LM head under --tp.
    return tiny_checkpoints["qwen2"]


@pytest.fixture
def lines_file(tmp_path):
    inp = tmp_path / "in.jsonl"
    recs = [{"id": f"r{i}", "prompt": p, "prompt_logprobs": 2, "temperature": 0,
             "max_tokens": 0 if i == 3 else 4} for i, p in enumerate(PROMPTS)]
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return inp


def _run(tmp_path, name: str, inp, ck, extra: list[str]) -> dict[str, dict]:
    out = tmp_path / name
    rc = main(["--input", str(inp), "--output", str(out), "--model", ck.path,
               "--device", "cpu", "--kv-cache-memory", str(8 << 20), "--max-model-len",
               "64", "--max-num-batched-tokens", "8", "--no-progress", *extra])
    assert rc == 0
    return {r["id"]: r for r in map(json.loads, read_lines(out))}


def _check(recs: dict[str, dict], ck) -> None:
    tok = AutoTokenizer.from_pretrained(ck.path)
    for i, prompt in enumerate(PROMPTS):
        rec = recs[f"r{i}"]
        ids = tok.encode(prompt, add_special_tokens=True)
        want = torch.log_softmax(hf_logits(ck.hf_model, ids), dim=-1)
        got = rec["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for p in range(1, len(ids)):
            entry = {int(t): lp for t, lp in got[p].items()}
            assert abs(entry[ids[p]] - want[p - 1, ids[p]].item()) <= 1e-4
            assert set(entry) == {ids[p], *want[p - 1].topk(2).indices.tolist()}
        n_out = len(rec["outputs"][0]["token_ids"])
        assert n_out == (0 if i == 3 else 4) or rec["outputs"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("mode", [[], ["--tp", "2"], ["--dp", "2"], ["--pd", "1:1"]],
                         ids=["one-rank", "tp2", "dp2", "pd1:1"])
def test_prompt_logprobs_under_each_parallel_mode(tmp_path, lines_file, qwen2, mode):
    _check(_run(tmp_path, "out.jsonl", lines_file, qwen2, mode), qwen2)
