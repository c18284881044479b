"""Disaggregated prefill/decode (``--pd 1:1``) over real gloo processes: greedy outputs
equal a NORMAL single-engine run; a decode side with few blocks/slots applies
back-pressure and everything still completes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch.distributed as dist
from transformers import AutoTokenizer

from deepinfer.distributed.pd import PDOptions, assign_offers, parse_pd
from deepinfer.distributed.ranks import RankFailedError
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.input_records import JobRequest
from deepinfer.jobs.pd_job import run_disaggregated
from deepinfer.request_state import AdmissionLimits
from deepinfer.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

_BASE = "the quick brown fox jumps over the lazy dog"
PROMPTS = [
    "hello world",  # shorter than one block
    _BASE + " and " + _BASE,  # several blocks
    _BASE + " and " + _BASE + ", hello engine",  # shares full blocks with the previous one
    "paged attention stores keys and values in blocks",
    "a b c d e f g h i j k",
    "once upon a time",
]


def _args(path: str, **kw) -> EngineArgs:
    kw.setdefault("kv_cache_memory", 1 << 20)
    kw.setdefault("max_num_seqs", 4)
    return EngineArgs(model=path, device="cpu", dtype="float32", max_model_len=128,
                      block_size=8, **kw)


def _requests(max_tokens: int) -> list[JobRequest]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [JobRequest(str(i), prompt=p, params=sp) for i, p in enumerate(PROMPTS)]
    # Ends at its first token: answered by the PROMPT rank itself.
    reqs.append(JobRequest("one", prompt="hello world",
                          params=dataclasses.replace(sp, max_tokens=1)))
    return reqs


def _normal(path: str, reqs: list[JobRequest], **kw) -> dict[str, list[int]]:
    from deepinfer.engine import LLMEngine

    eng = LLMEngine(_args(path, **kw))
    for r in reqs:
        eng.add_request(r.request_id, r.prompt, None, r.params)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for res in eng.step():
            out[res.request_id] = res.outputs[0].token_ids
    return out


def _read(path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in recs}) == len(recs)
    return {r["id"]: r for r in recs}


@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> str:  # noqa: F811
    return tiny_checkpoints["llama_tied"].path


def test_pd_1_1_matches_normal(llama, tmp_path):
    reqs = _requests(10)
    want = _normal(llama, reqs)
    out = tmp_path / "out.jsonl"
    # A small prefill budget puts prompts 1 and 2 in different prompt steps, so prompt 2
    # hits the prefix cache on the PROMPT rank.
    stats = run_disaggregated(_args(llama, max_num_batched_tokens=32), reqs, str(out), 1, 1)
    got = _read(out)
    assert list(got) == [r.request_id for r in reqs]  # merged in input order
    for rid, toks in want.items():
        assert got[rid]["outputs"][0]["token_ids"] == toks, rid
        assert got[rid]["outputs"][0]["finish_reason"] == "length"
    p, d = stats
    assert p["role"] == "prompt" and p["prefix_cache_hits"] > 0
    assert p["handed_off"] == d["received"] == len(PROMPTS)
    assert p["generated_tokens"] + d["generated_tokens"] == sum(map(len, want.values()))


def test_pd_hands_off_an_int8_kv_cache(tiny_checkpoints, tmp_path):  # noqa: F811
    """``kv_cache_dtype="int8"`` on both sides: the hand-off moves the blocks' codes and
    scales as bytes, so the pair decodes what one engine with an int8 cache does."""
    qwen3 = tiny_checkpoints["qwen3"].path  # head_dim 32: one scale a row
    reqs = _requests(8)
    want = _normal(qwen3, reqs, kv_cache_dtype="int8")
    out = tmp_path / "out.jsonl"
    stats = run_disaggregated(_args(qwen3, kv_cache_dtype="int8"), reqs, str(out), 1, 1)
    got = {k: v["outputs"][0]["token_ids"] for k, v in _read(out).items()}
    assert got == want
    assert stats[0]["handed_off"] == stats[1]["received"] == len(PROMPTS)


def test_pd_hands_off_token_steering(llama, tmp_path):
    """The decode side steers as the prompt side did: the params travel, the steering is
    resolved again there (bias and allowed ids on the device, bad words on the host)."""
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = [JobRequest("bias", prompt=PROMPTS[0], params=sp.replace(logit_bias={7: 100})),
            JobRequest("allowed", prompt=PROMPTS[1],
                       params=sp.replace(allowed_token_ids=[9, 10])),
            JobRequest("plain", prompt=PROMPTS[3], params=sp)]
    plain = _normal(llama, reqs[2:])["plain"]
    pair = plain[2:4]  # a two-token bad word the plain output holds
    reqs.append(JobRequest("bad", prompt=PROMPTS[3], params=sp.replace(
        bad_words=[AutoTokenizer.from_pretrained(llama).decode(pair)])))
    want = _normal(llama, reqs)
    out = tmp_path / "out.jsonl"
    run_disaggregated(_args(llama), reqs, str(out), 1, 1)
    got = {k: v["outputs"][0]["token_ids"] for k, v in _read(out).items()}
    assert got == want
    assert got["bias"] == [7] * 8 and set(got["allowed"]) <= {9, 10}
    assert got["plain"] == plain and got["bad"] != plain
    assert all(got["bad"][i:i + 2] != pair for i in range(7))


def test_pd_back_pressure(llama, tmp_path):
    reqs = _requests(12)
    want = _normal(llama, reqs)
    out = tmp_path / "out.jsonl"
    # Decode side: 2 slots and 12 blocks (96 tokens): one long prompt (~70 tokens + 12)
    # at a time, two short ones.
    block = 2 * 2 * 8 * 2 * 16 * 4  # layers * K/V * block_size * Hkv * D * fp32
    decode = _args(llama, max_num_seqs=2, kv_cache_memory=12 * block)
    stats = run_disaggregated(_args(llama, max_num_seqs=2), reqs, str(out), 1, 1,
                              decode_args=decode, options=PDOptions(max_pending=2))
    got = _read(out)
    assert all("outputs" in r for r in got.values()), got
    assert {rid: r["outputs"][0]["token_ids"] for rid, r in got.items()} == want
    p, d = stats
    # Prefill stops at 2 pending hand-offs; one step adds at most max_num_seqs=2.
    assert 1 <= p["max_pending"] <= 3
    assert p["credit_waits"] > 0  # the decode side did push back
    assert d["preemptions"] == 0 and d["received"] == len(PROMPTS)


def test_pd_ranks_with_different_kv_dtypes_fail_clearly(llama, tmp_path):
    """KV moves as bytes, so a PROMPT rank in fp32 and a COMPLETION rank in bf16 (as
    dtype "auto" gives on two CPUs, one with native bf16) must stop at setup, naming the
    option, not exchange garbage."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(RankFailedError, match="different dtypes.*--dtype"):
        run_disaggregated(_args(llama), _requests(3), str(out), 1, 1,
                          decode_args=dataclasses.replace(_args(llama), dtype="bfloat16"))


def test_assign_offers_least_loaded_and_fifo():
    def row(work=1, slots=0, blocks=0, needs=()):
        return [work, slots, blocks, len(needs), *needs] + [0] * (4 - len(needs))

    rows = [row(needs=(3, 3, 9)), row(needs=(2,)), row(slots=2, blocks=10),
            row(slots=3, blocks=4)]
    # p0#0 -> d2 (most blocks), p1#0 -> d2, p0#1 -> d2 (5 left), p0#2 (9) fits nowhere.
    assert assign_offers(rows, 2) == [(0, 0, 2), (1, 0, 2), (0, 1, 3)]
    assert assign_offers([row(needs=(1,)), row(slots=0, blocks=99)], 1) == []


def test_parse_pd():
    assert parse_pd("2:3") == (2, 3)
    for bad in ("1", "0:1", "a:b"):
        with pytest.raises(ValueError):
            parse_pd(bad)


def test_admission_fits_a_prompt_rank_to_the_decode_side():
    """A PROMPT engine's admission (``LLMEngine.add_request``) also cuts max_tokens at the
    decode side's model length and refuses a request no decode rank has the blocks for."""
    limits = AdmissionLimits(max_model_len=100)
    sp = SamplingParams(max_tokens=90)
    assert limits.fit("a", 20, sp).max_tokens == 80
    blocks = []
    limits.hand_off(50, 7, lambda n, m: blocks.append((n, m)) or -(-(n + m) // 8))
    assert limits.fit("a", 20, sp).max_tokens == 30  # the shorter decode side
    assert blocks == [(20, 30)]
    with pytest.raises(ValueError, match=r"'b': prompt \(60 tokens\).*max_model_len=50"):
        limits.fit("b", 60, sp)
    limits.hand_off(50, 6, lambda n, m: -(-(n + m) // 8))
    with pytest.raises(ValueError, match=r"'c': .*needs 7 KV blocks.*\(6 blocks\)"):
        limits.fit("c", 20, sp)
