"""Top-p at the exact boundary, which mutation testing (`make mutate`) showed no test
pinned: when the probabilities of the most likely tokens add up to exactly ``top_p``,
those tokens are kept and the next one is dropped ("the smallest set of tokens whose
probability reaches top_p", ``SamplingParams``; vLLM's rule, dropping the tokens whose
ascending cumulative sum is <= 1 - top_p, keeps the same set).

The probabilities are powers of two, so every softmax value and partial sum is exact in
float32 and the boundary is hit exactly (the test checks that first). The tokens sit in a
shuffled vocabulary order so that the filter's sort matters.

Every test runs with the torch ops (``deepinfer_kernels.reference``) and the CPU's C ones
(``cpu_backend``: float32 ``expf`` per token, summed in double, lands on the same exact
partial sums).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.sampling.params import SamplingParams as SP
from deepinfer.sampling.sampler import Sampler, SamplingTensors
from deepinfer_kernels import cpu_backend, reference

# Token id -> probability; by decreasing probability the ids are 3, 0, 4, then 1 and 2.
PROBS = torch.tensor([0.25, 0.0625, 0.0625, 0.5, 0.125], dtype=torch.float64)
LOGITS = PROBS.log().to(torch.float32)
V = PROBS.numel()

# top_p -> the tokens it keeps. 0.5, 0.75 and 0.875 are exact partial sums (boundaries);
# 0.6 and 0.8 fall between two of them.
SUPPORT = {
    0.5: {3},
    0.6: {3, 0},
    0.75: {3, 0},
    0.8: {3, 0, 4},
    0.875: {3, 0, 4},
    1.0: {0, 1, 2, 3, 4},
}


@pytest.fixture(params=["reference", "cpu"])
def sampler(request) -> Sampler:
    return Sampler(reference if request.param == "reference" else cpu_backend)


def run(sampler, logits, params):
    n = logits.shape[0]
    st = SamplingTensors.from_params(params, V, "cpu")
    return sampler.sample(logits, st, torch.arange(n))


def check_support(tokens: torch.Tensor, top_ps: list[float]) -> None:
    """Row i was drawn with ``top_ps[i]``: only its kept tokens appear, each of them does,
    with about its renormalized probability."""
    for top_p in sorted(set(top_ps)):
        rows = torch.tensor([p == top_p for p in top_ps])
        drawn = tokens[rows]
        freq = torch.bincount(drawn, minlength=V).double() / drawn.numel()
        kept = SUPPORT[top_p]
        assert set(drawn.unique().tolist()) == kept, f"top_p={top_p}"
        idx = torch.tensor(sorted(kept))
        want = PROBS[idx] / PROBS[idx].sum()
        assert torch.allclose(freq[idx], want, atol=0.05), f"top_p={top_p}: {freq.tolist()}"


def test_probabilities_and_partial_sums_are_exact_in_float32():
    """The premise of the boundary tests: the filter's own arithmetic (softmax of the
    sorted logits, cumulative sum minus the token's own probability) is exact here."""
    sorted_logits, order = LOGITS.unsqueeze(0).sort(dim=-1, descending=True)
    assert order.squeeze(0).tolist()[:3] == [3, 0, 4]
    probs = sorted_logits.softmax(dim=-1)
    assert probs.squeeze(0).tolist() == [0.5, 0.25, 0.125, 0.0625, 0.0625]
    before = probs.cumsum(dim=-1) - probs
    assert before.squeeze(0).tolist() == [0.0, 0.5, 0.75, 0.875, 0.9375]
    for top_p in (0.5, 0.75, 0.875):  # the boundaries, as the sampler holds them
        assert SamplingTensors.from_params([SP(top_p=top_p)], V, "cpu").top_p.item() == top_p


@pytest.mark.parametrize("top_p", [0.5, 0.75, 0.875])
def test_cumulative_probability_equal_to_top_p_keeps_exactly_that_set(sampler, top_p):
    """Unseeded draws over several torch seeds, one top_p per batch."""
    draws = 3000
    for seed in range(3):
        torch.manual_seed(seed)
        tokens, _ = run(sampler, LOGITS.expand(draws, -1).clone(), [SP(top_p=top_p)] * draws)
        check_support(tokens, [top_p] * draws)


def test_boundaries_per_row_in_one_batch(sampler):
    """Rows with different top_p in one batch, each drawn from its own uniform."""
    top_ps = [p for p in SUPPORT for _ in range(1500)]
    torch.manual_seed(7)
    tokens, _ = run(sampler, LOGITS.expand(len(top_ps), -1).clone(), [SP(top_p=p) for p in top_ps])
    check_support(tokens, top_ps)


def test_boundary_with_seeded_rows(sampler):
    """Every row seeded with its own seed (the uniform comes from the seeded stream, not
    from torch.rand): still only the kept tokens, each of them drawn."""
    top_ps = [p for p in (0.5, 0.75, 0.875, 1.0) for _ in range(1500)]
    params = [SP(top_p=p, seed=1000 + i) for i, p in enumerate(top_ps)]
    tokens, _ = run(sampler, LOGITS.expand(len(top_ps), -1).clone(), params)
    check_support(tokens, top_ps)


def test_boundary_after_top_k(sampler):
    """Top-k first, then top-p on the renormalized rest: here top_k = 4 leaves half the
    mass, [0.25, 0.125, 0.0625, 0.0625], renormalized exactly to [0.5, 0.25, 0.125,
    0.125], whose partial sum 0.75 is the boundary."""
    probs = torch.tensor([0.0625, 0.25, 0.0625, 0.125] + [1 / 32] * 16, dtype=torch.float64)
    logits = probs.log().to(torch.float32)
    v = probs.numel()
    # The premise, as the filter computes it: top-k mask on the sorted row, softmax.
    sorted_logits, order = logits.sort(descending=True)
    sorted_logits[4:] = float("-inf")
    kept = sorted_logits.softmax(dim=-1)
    assert order[:2].tolist() == [1, 3] and kept[:4].tolist() == [0.5, 0.25, 0.125, 0.125]
    assert (kept.cumsum(dim=-1) - kept)[2].item() == 0.75
    n = 3000
    torch.manual_seed(11)
    st = SamplingTensors.from_params([SP(top_p=0.75, top_k=4)] * n, v, "cpu")
    tokens, _ = sampler.sample(logits.expand(n, -1).clone(), st, torch.arange(n))
    assert set(tokens.unique().tolist()) == {1, 3}
    assert abs((tokens == 1).double().mean().item() - 2 / 3) < 0.05


def test_top_p_one_skips_the_top_p_filter(sampler):
    """A batch whose sampled rows all have top_p = 1 does not take the sorted top-p path:
    top_k alone keeps every token tied with the k-th largest (``_top_k``'s rule), where
    the sorted path would keep exactly k of them."""
    tied = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64).log().to(torch.float32)
    n = 3000
    torch.manual_seed(5)
    st = SamplingTensors.from_params([SP(top_k=2, top_p=1.0)] * n, 4, "cpu")
    assert not st.do_top_p
    tokens, _ = sampler.sample(tied.expand(n, -1).clone(), st, torch.arange(n))
    assert set(tokens.unique().tolist()) == {0, 1, 2, 3}
