"""Sampler edges that mutation testing (`make mutate`) showed no test pinned: logprobs
with k = 0 / 1 / more than the batch, per-row min-p, min_p = 1, greedy rows' top_k not
limiting sampled rows, bf16 logits, row-count mismatches, out-of-vocab bans."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepinfer.sampling.params import SamplingParams as SP
from deepinfer.sampling.sampler import Sampler, SamplingTensors, argmax_rows

V = 16


def run(logits, params, banned=None):
    n = logits.shape[0]
    st = SamplingTensors.from_params(params, logits.shape[-1], "cpu", banned)
    return Sampler().sample(logits, st, torch.arange(n))


def test_logprobs_zero_only_returns_the_sampled_token():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    tokens, lps = run(logits, [SP(temperature=0.0, logprobs=0)] * 2)
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        (t, v), = lps[i].items()
        assert t == int(tokens[i]) and math.isclose(v, float(ref[i, t]), abs_tol=1e-5)


def test_logprobs_top_one_and_more_than_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    top = logits[0].topk(3).indices.tolist()
    # The argmax banned: the sampled token is the second one, plus the top 1 = 2 entries.
    _, lps = run(logits, [SP(temperature=0.0, logprobs=1)], banned=[[top[0]]])
    assert set(lps[0]) == {top[0], top[1]}
    # k = 3 with a single row: three entries (k is not capped by the batch size).
    _, lps = run(logits, [SP(temperature=0.0, logprobs=3)])
    assert set(lps[0]) == set(top)


def test_min_p_threshold_is_per_row():
    """Row A is peaked, row B flat: B's threshold comes from B's own top probability."""
    torch.manual_seed(2)
    peaked = torch.zeros(V)
    peaked[3] = 20.0
    rows = torch.stack([peaked if i % 2 == 0 else torch.zeros(V) for i in range(400)])
    tokens, _ = run(rows, [SP(temperature=1.0, min_p=0.5)] * 400)
    assert set(tokens[0::2].tolist()) == {3}
    assert len(set(tokens[1::2].tolist())) > V // 2  # flat row: every token survives


def test_min_p_one_keeps_only_the_top_token():
    torch.manual_seed(3)
    logits = torch.randn(50, V)
    tokens, _ = run(logits, [SP(temperature=1.0, min_p=1.0)] * 50)
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_top_k_does_not_limit_sampled_rows():
    torch.manual_seed(4)
    logits = torch.randn(1, V).expand(300, V).clone()
    top4 = set(logits[0].topk(4).indices.tolist())
    params = [SP(temperature=0.0, top_k=1) if i % 3 == 0 else SP(temperature=1.0, top_k=4)
              for i in range(300)]
    tokens, _ = run(logits * 0.1, params)  # flat-ish: all four tokens show up
    sampled = {t for i, t in enumerate(tokens.tolist()) if i % 3}
    assert sampled == top4


def test_bf16_logits_are_upcast():
    torch.manual_seed(5)
    logits = (torch.randn(3, V) * 4).to(torch.bfloat16)
    tokens, lps = run(logits, [SP(temperature=0.0, logprobs=2)] * 3)
    assert tokens.dtype == torch.int64
    ref = torch.log_softmax(logits.float(), -1)
    for i in range(3):
        for t, v in lps[i].items():
            assert math.isclose(v, float(ref[i, t]), abs_tol=1e-5)


def test_row_count_mismatch_and_empty_batch():
    st = SamplingTensors.from_params([SP()] * 3, V, "cpu")
    with pytest.raises(ValueError, match="2 logit rows"):
        Sampler().sample(torch.randn(2, V), st, torch.arange(2))
    empty, lps = run(torch.zeros(0, V), [])
    assert empty.shape == (0,) and empty.dtype == torch.int64 and lps is None


def test_out_of_vocab_banned_ids_are_ignored():
    logits = torch.randn(1, V)
    tokens, _ = run(logits, [SP(temperature=0.0)], banned=[[V, -1, V + 5]])
    assert int(tokens[0]) == int(logits.argmax())


def _seeded_draws(steps=None, sample_indices=None, rows=64):
    """Tokens of ``rows`` identical seeded rows over a flat distribution: one seeded
    uniform each (the inverse CDF picks the token the uniform falls in)."""
    logits = torch.zeros(rows, V)
    params = [SP(temperature=1.0, seed=1234)] * rows
    st = SamplingTensors.from_params(params, V, "cpu", steps=steps,
                                     sample_indices=sample_indices)
    tokens, _ = Sampler().sample(logits, st, torch.arange(rows))
    return tokens.tolist()


def test_seeded_draw_depends_on_the_step_and_nothing_else():
    """Same seed, same step: the same token whatever the row; another step (the output
    index) gives another draw. A sampler that ignored ``steps`` would repeat one token."""
    same = _seeded_draws(steps=[5] * 64)
    assert len(set(same)) == 1
    per_step = _seeded_draws(steps=list(range(64)))
    assert len(set(per_step)) > 8  # 64 draws over 16 equally likely tokens
    assert per_step[5] == same[0]
    assert _seeded_draws(steps=list(range(64))) == per_step  # reproducible


def test_seeded_samples_of_one_request_draw_apart():
    """n > 1 with a seed: each sample (``sample_indices``) has its own stream, so samples
    at the same step differ; the same index repeats."""
    apart = _seeded_draws(steps=[3] * 64, sample_indices=list(range(64)))
    assert len(set(apart)) > 8
    again = _seeded_draws(steps=[3] * 64, sample_indices=list(range(64)))
    assert again == apart
    assert _seeded_draws(steps=[3] * 64, sample_indices=[0] * 64) == [apart[0]] * 64


def test_argmax_rows_follows_torch_rules():
    """The numpy fast path (contiguous fp32 CPU) and the torch path agree with
    torch.argmax: first index on ties, NaN counts as the maximum, inf beats finite."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 300, generator=g)
    x[1, 3] = float("nan")
    x[2, :] = 1.5  # all tied: index 0
    x[3, 10] = x[3, 20] = float("inf")
    x[4, 1] = x[4, 6] = float("nan")
    x[5, 299] = 1e30
    x[6, :] = float("-inf")
    want = x.argmax(dim=-1)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[1] == 3 and got[2] == 0 and got[3] == 10 and got[4] == 1 and got[5] == 299
    # Other layouts and dtypes take torch's own argmax.
    assert torch.equal(argmax_rows(x.t().contiguous().t()), want)
    assert torch.equal(argmax_rows(x.double()), want)
    with torch.inference_mode():  # the engine samples under inference_mode
        y = torch.randn(8, 50, generator=g)
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1))


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_top_k_keeps_ties_at_the_kth_value_with_and_without_top_p(top_p):
    """A three-way tie for first place with top_k = 2: every tied token stays drawable,
    whether top-k runs alone or in the sorted top-k + top-p path."""
    logits = torch.full((1, V), -5.0)
    logits[0, [3, 7, 11]] = 4.0
    seen = set()
    for seed in range(200):
        sp = SP(temperature=1.0, top_k=2, top_p=top_p, seed=seed)
        tokens, _ = run(logits.clone(), [sp])
        seen.add(int(tokens[0]))
    assert seen == {3, 7, 11}


def test_min_tokens_ban_holds_for_exactly_min_tokens_outputs():
    """The stop ids are banned while sampling outputs 1..min_tokens and allowed from
    output min_tokens + 1 on (vLLM's rule; the scheduler stops on nout > min_tokens)."""
    from deepinfer.sampling.table import SamplingTable

    table = SamplingTable(4, 32)
    table.write(2, SP(max_tokens=8, min_tokens=3), 0, prompt_len=10, stop_token_ids=(7, 9))
    table.write(1, SP(max_tokens=8), 0, prompt_len=5, stop_token_ids=(7,))
    # Output k (1-based) is sampled from the token at position prompt_len + k - 2.
    for k in range(1, 6):
        pos = 10 + k - 2
        _, steps, banned = table.gather(np.array([1, 2]), np.array([5 + k - 2, pos]))
        assert steps.tolist() == [k - 1, k - 1]
        if k <= 3:
            assert banned == [(), (7, 9)], k
        else:
            assert banned is None, k
