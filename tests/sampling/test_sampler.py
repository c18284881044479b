"""Sampler: penalties, filters, seeded streams, logprobs and the per-slot state."""

import math

import pytest
import torch

from deepinfer.sampling.params import SamplingParams as SP
from deepinfer.sampling.sampler import Sampler, SamplingTensors

V = 16


def run(logits, params, slots=None, states=None, banned=None, steps=None):
    n = logits.shape[0]
    slots = torch.arange(n) if slots is None else slots
    st = SamplingTensors.from_params(params, logits.shape[-1], "cpu", banned, steps)
    return Sampler().sample(logits, st, slots, states)


def frequencies(logits_row: torch.Tensor, p: SP, draws: int = 6000) -> torch.Tensor:
    """Empirical distribution of ``draws`` samples of one row (one batched call)."""
    torch.manual_seed(1234)
    tokens, _ = run(logits_row.expand(draws, -1).clone(), [p] * draws)
    return torch.bincount(tokens, minlength=logits_row.numel()).float() / draws


# --------------------------------------------------------------------------- greedy
def test_greedy_is_argmax_alone_and_mixed():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    tokens, lp = run(logits, [SP(temperature=0.0)] * 6)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert lp is None
    # Mixed with sampled rows (the non-fast path) and with filters set on the greedy rows.
    params = [SP(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3) if i % 2 == 0
              else SP(temperature=1.0) for i in range(6)]
    tokens, _ = run(logits, params)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_logits_are_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    before = logits.clone()
    states = Sampler.make_state(3, V, "cpu")
    states[1][:, :4] = True
    run(logits, [SP(temperature=0.7, top_k=3, top_p=0.8, repetition_penalty=1.5)] * 3,
        states=states, banned=[[0], [], [1]])
    assert torch.equal(logits, before)


def test_fast_path_flags_come_from_params():
    st = SamplingTensors.from_params([SP(temperature=0.0, top_k=5), SP(temperature=0.0)],
                                     V, "cpu")
    assert st.all_greedy and not st.do_top_k and not st.do_top_p  # filters skipped for greedy
    assert not st.do_repetition and not st.do_presence_frequency and st.max_logprobs == -1
    st = SamplingTensors.from_params(
        [SP(top_k=5, top_p=0.9), SP(min_p=0.1, frequency_penalty=0.5, logprobs=3)], V, "cpu")
    assert not st.all_greedy and st.do_top_k and st.do_top_p and st.do_min_p
    assert st.do_presence_frequency and not st.do_repetition and st.max_logprobs == 3
    assert st.top_k.tolist() == [5, V]  # off -> whole vocabulary
    assert SamplingTensors.from_params([SP(top_k=0)], V, "cpu").top_k.tolist() == [V]


# --------------------------------------------------------------------------- distribution
def test_random_sampling_matches_softmax_and_temperature_changes_it():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    for t in (1.0, 0.5, 2.0):
        freq = frequencies(logits, SP(temperature=t))
        want = torch.softmax(logits / t, -1)
        assert torch.allclose(freq, want, atol=0.025), (t, freq, want)
    cold, hot = frequencies(logits, SP(temperature=0.5)), frequencies(logits, SP(temperature=2.0))
    assert cold[2] > 0.7 > hot[2]


def test_top_k_restricts_support_per_row():
    torch.manual_seed(0)
    row = torch.randn(V)
    top3 = set(row.topk(3).indices.tolist())
    freq = frequencies(row, SP(temperature=5.0, top_k=3), draws=3000)
    assert set(freq.nonzero().flatten().tolist()) == top3
    # Renormalized over the kept tokens.
    want = torch.zeros(V)
    idx = torch.tensor(sorted(top3))
    want[idx] = torch.softmax(row[idx] / 5.0, -1)
    assert torch.allclose(freq, want, atol=0.03)
    # Rows with different k in one batch (k=1, k off).
    torch.manual_seed(1)
    tokens, _ = run(row.expand(400, -1).clone(),
                    [SP(temperature=5.0, top_k=1), SP(temperature=5.0, top_k=-1)] * 200)
    assert set(tokens[0::2].tolist()) == {int(row.argmax())}
    assert len(set(tokens[1::2].tolist())) > 3


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("top_p, support", [(0.7, {0, 1}), (0.85, {0, 1, 2}), (0.4, {0}),
                                            (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, support):
    freq = frequencies(PROBS.log(), SP(top_p=top_p), draws=4000)
    assert set(freq.nonzero().flatten().tolist()) == support
    kept = torch.tensor(sorted(support))
    assert torch.allclose(freq[kept], PROBS[kept] / PROBS[kept].sum(), atol=0.03)


def test_top_k_and_top_p_together():
    # top_k=2 leaves {0: .625, 1: .375}; top_p=0.6 then keeps only token 0.
    freq = frequencies(PROBS.log(), SP(top_k=2, top_p=0.6), draws=500)
    assert freq[0] == 1.0
    freq = frequencies(PROBS.log(), SP(top_k=3, top_p=0.9), draws=2000)
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2}


@pytest.mark.parametrize("min_p, support", [(0.2, {0, 1, 2}), (0.5, {0, 1}), (0.0, {0, 1, 2, 3}),
                                            (1.0, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, support):
    freq = frequencies(PROBS.log(), SP(min_p=min_p), draws=4000)
    assert set(freq.nonzero().flatten().tolist()) == support


# --------------------------------------------------------------------------- seeds
def _seeded_stream(seed_rows, batch_params, steps=6, vocab=64):
    """Tokens of the seeded rows over ``steps`` steps of one batch; logits differ per step."""
    params = [p if s is None else p.replace(seed=s) for p, s in zip(batch_params, seed_rows)]
    out = []
    for step in range(steps):
        logits = torch.linspace(-1, 1, vocab).sin().mul(step + 1).expand(len(params), -1)
        tokens, _ = run(logits.clone(), params, steps=[step] * len(params))
        out.append([int(t) for t, s in zip(tokens, seed_rows) if s is not None])
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    p = SP(temperature=1.5)
    torch.manual_seed(0)
    alone = [row[0] for row in _seeded_stream([7], [p])]
    torch.manual_seed(99)  # the global RNG must not matter for seeded rows
    mixed = _seeded_stream([None, 11, 7, None, 3],
                           [SP(temperature=0.8), p, p, SP(temperature=0.0), SP(top_k=4)])
    assert [row[1] for row in mixed] == alone
    # A different seed gives a different stream (64 tokens, 6 steps: collision ~ 0).
    assert [row[0] for row in mixed] != alone
    # And repeated unseeded draws differ: the shared batched draw really is random.
    torch.manual_seed(5)
    a = run(torch.zeros(8, 64), [SP()] * 8)[0]
    b = run(torch.zeros(8, 64), [SP()] * 8)[0]
    assert not torch.equal(a, b)


# --------------------------------------------------------------------------- penalties
def _state_with(prompt=(), outputs=(), slot=1, num_slots=3):
    states = Sampler.make_state(num_slots, 4, "cpu")
    if prompt:
        Sampler.record_prompt_tokens(states, torch.tensor(prompt),
                                     torch.full((len(prompt),), slot))
    if outputs:
        Sampler.record_output_tokens(states, torch.tensor(outputs),
                                     torch.full((len(outputs),), slot))
    return states


def _greedy_pick(logits, states, slot=1, **kw):
    tokens, _ = run(torch.tensor([logits]), [SP(temperature=0.0, **kw)],
                    slots=torch.tensor([slot]), states=states)
    return int(tokens[0])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    # Token 0 in the prompt: 2.0 / 2 = 1.0 < 1.5.
    pos = [2.0, 1.5, -1.0, -1.2]
    assert _greedy_pick(pos, _state_with(prompt=[0])) == 0
    assert _greedy_pick(pos, _state_with(prompt=[0]), repetition_penalty=2.0) == 1
    # Generated tokens count too.
    assert _greedy_pick(pos, _state_with(outputs=[0]), repetition_penalty=2.0) == 1
    # Negative: -1.0 * 2 = -2.0 < -1.5 (dividing would have raised it to -0.5).
    neg = [-1.0, -1.5, -3.0, -4.0]
    assert _greedy_pick(neg, _state_with(prompt=[0]), repetition_penalty=2.0) == 1
    # < 1 rewards repetition: token 1 (seen) -1.5 * 0.5 = -0.75 beats -1.0.
    assert _greedy_pick(neg, _state_with(outputs=[1]), repetition_penalty=0.5) == 1
    # Only the row's own slot counts.
    assert _greedy_pick(pos, _state_with(prompt=[0], slot=2), repetition_penalty=2.0) == 0


def test_frequency_penalty_scales_with_the_count():
    logits = [3.0, 2.5, 0.0, 0.0]
    twice = _state_with(outputs=[0, 0])  # duplicates in one call accumulate
    assert _greedy_pick(logits, twice, frequency_penalty=0.2) == 0  # 3 - 0.4 = 2.6
    assert _greedy_pick(logits, twice, frequency_penalty=0.3) == 1  # 3 - 0.6 = 2.4
    # Negative values encourage repetition.
    assert _greedy_pick([2.5, 3.0, 0, 0], twice, frequency_penalty=-0.5) == 0


def test_presence_penalty_counts_once_and_ignores_the_prompt():
    logits = [3.0, 2.5, 0.0, 0.0]
    many = _state_with(outputs=[0] * 5)
    assert _greedy_pick(logits, many, presence_penalty=0.4) == 0  # 3 - 0.4 = 2.6
    assert _greedy_pick(logits, many, presence_penalty=0.6) == 1  # 3 - 0.6 = 2.4
    # OpenAI semantics: prompt tokens are not "present".
    assert _greedy_pick(logits, _state_with(prompt=[0]), presence_penalty=2.0,
                        frequency_penalty=2.0) == 0


def test_penalties_apply_per_row():
    states = _state_with(outputs=[0], slot=0)
    Sampler.record_output_tokens(states, torch.tensor([0]), torch.tensor([1]))
    logits = torch.tensor([[3.0, 2.5, 0, 0]] * 2)
    tokens, _ = run(logits, [SP(temperature=0.0, presence_penalty=1.0), SP(temperature=0.0)],
                    slots=torch.tensor([0, 1]), states=states)
    assert tokens.tolist() == [1, 0]


def test_penalties_without_state_is_an_error():
    with pytest.raises(ValueError, match="state"):
        run(torch.zeros(1, V), [SP(presence_penalty=1.0)])


# --------------------------------------------------------------------------- min_tokens
def test_banned_ids_are_never_sampled():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 3)
    tokens, _ = run(logits, [SP(temperature=0.0)] * 3, banned=[[0], [], [0, 1]])
    assert tokens.tolist() == [1, 0, 2]
    torch.manual_seed(0)
    tokens, _ = run(torch.zeros(500, 4), [SP()] * 500, banned=[[2, 3]] * 500)
    assert set(tokens.tolist()) == {0, 1}


def test_a_ban_never_empties_a_row():
    """A row whose only drawable ids are banned (a grammar mask that allows the stop
    tokens alone, under min_tokens) draws one of them instead of index 0 of an all -inf
    row; the other rows keep their bans, greedy and sampled alike."""
    ninf = float("-inf")
    torch.manual_seed(1)
    for temperature in (0.0, 1.0):
        logits = torch.randn(4, V)
        logits[1] = ninf
        logits[1, [5, 9]] = torch.tensor([0.3, 1.2])  # masked: stops 5 and 9 only
        logits[3, :] = ninf
        logits[3, 7] = 2.0  # masked to one id, which is not banned
        banned = [[int(logits[0].argmax())], [5, 9], [], [5, 9]]
        want0 = logits[0].clone()
        want0[banned[0]] = ninf
        tokens, _ = run(logits.clone(), [SP(temperature=temperature, seed=3)] * 4,
                        banned=banned)
        assert tokens[1].item() in (5, 9) and tokens[3].item() == 7
        assert tokens[0].item() not in banned[0]
        if temperature == 0.0:
            assert tokens[1].item() == 9 and tokens[0].item() == int(want0.argmax())


# --------------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_top_k_plus_sampled():
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    states = Sampler.make_state(4, V, "cpu")
    params = [SP(temperature=0.0, logprobs=1, repetition_penalty=1.3),
              SP(temperature=0.0),
              SP(temperature=0.9, logprobs=0),
              SP(temperature=0.0, logprobs=2)]
    states[1][0, logits[0].argmax()] = True  # penalty moves row 0's pick
    banned = [[], [], [], [int(logits[3].argmax())]]
    tokens, lps = run(logits, params, states=states, banned=banned)
    ref = torch.log_softmax(logits, -1)
    assert lps[1] is None
    for i, k in [(0, 1), (2, 0), (3, 2)]:
        want_ids = set(ref[i].topk(k).indices.tolist()) | {int(tokens[i])}
        assert set(lps[i]) == want_ids
        for t, v in lps[i].items():
            assert math.isclose(v, float(ref[i, t]), abs_tol=1e-5)
    # Row 0's sampled token is not its raw argmax, so it is the extra entry.
    assert int(tokens[0]) != int(logits[0].argmax())
    assert len(lps[0]) == 2 and len(lps[2]) == 1
    # Row 3: argmax banned -> sampled token is in the top 2 already.
    assert len(lps[3]) == 2


# --------------------------------------------------------------------------- state
def test_state_record_zero_and_clone():
    states = Sampler.make_state(4, V, "cpu")
    counts, mask = states
    assert counts.shape == (4, V) and counts.dtype == torch.int32
    assert mask.shape == (4, V) and mask.dtype == torch.bool
    Sampler.record_prompt_tokens(states, torch.tensor([3, 5, 3, 7]), torch.tensor([1, 1, 1, 2]))
    assert mask[1].nonzero().flatten().tolist() == [3, 5]
    assert mask[2].nonzero().flatten().tolist() == [7]
    Sampler.record_output_tokens(states, torch.tensor([4, 4, 9]), torch.tensor([1, 1, 2]))
    Sampler.record_output_tokens(states, torch.tensor([4]), torch.tensor([1]))
    assert counts[1, 4] == 3 and counts[2, 9] == 1 and counts.sum() == 4
    # The engine's clone_states / zero_states: plain row copies.
    counts[3], mask[3] = counts[1], mask[1]  # fork slot 1 -> 3
    counts[1], mask[1] = 0, False  # slot 1 freed and reused
    assert counts[1].sum() == 0 and not mask[1].any()
    logits = torch.zeros(2, V)
    logits[:, 4] = 1.0
    logits[:, 6] = 0.9
    tokens, _ = run(logits, [SP(temperature=0.0, frequency_penalty=0.1)] * 2,
                    slots=torch.tensor([3, 1]), states=states)
    assert tokens.tolist() == [6, 4]  # the fork inherited the counts, the reused slot did not
    logits = torch.zeros(2, V)
    logits[:, 3] = 1.0
    logits[:, 8] = 0.5
    tokens, _ = run(logits, [SP(temperature=0.0, repetition_penalty=5.0)] * 2,
                    slots=torch.tensor([3, 1]), states=states)
    assert tokens.tolist() == [8, 3]  # prompt tokens of slot 1 went to the fork


def test_empty_batch():
    tokens, lps = run(torch.zeros(0, V), [])
    assert tokens.shape == (0,) and lps is None
