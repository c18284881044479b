"""The CPU's C draws (``cpu_sampling.sample_tokens`` / ``sample_tokens_filtered``,
``kernels/csrc/sampling_cpu.c``) against the torch reference on random logits.

The C kernel sums in float64 in another order than torch's float32 cumsum, so a target
within rounding of a CDF boundary may pick the neighbouring token: every draw must be a
valid inverse-CDF answer of the reference's filtered logits (``inverse_cdf_draw_ok``,
float64, 1e-5 of the total), and at most one row in 100 may differ from the reference.
The filters' kept sets are compared exactly: on random logits no partial sum lands within
rounding of a ``top_p``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import cpu_sampling, reference
from deepinfer_kernels.cpu_native import native_library
from deepinfer_kernels.sampling_reference import filter_logits
from tests.kernels.helpers import bits, generator, seed_for

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler")

NEG_INF = float("-inf")
ONE_BELOW = 1 - 2**-24
REL_TOL = 1e-5
FILTERS = ["top_k", "top_p", "min_p", "top_k+top_p", "top_p+min_p", "top_k+min_p",
           "top_k+top_p+min_p"]


def rows_of(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Per-row parameters: temperatures, uniforms (0 and the largest float below 1 in the
    first rows), top_k (1..vocab-ish, some off), top_p, min_p (some off)."""
    u = torch.rand(n, generator=g)
    u[: min(n, 2)] = torch.tensor([0.0, ONE_BELOW])[: min(n, 2)]
    return {"temperatures": 0.3 + 1.7 * torch.rand(n, generator=g), "uniforms": u,
            "top_k": torch.randint(1, 300, (n,), generator=g),
            "top_p": 0.3 + 0.7 * torch.rand(n, generator=g),
            "min_p": 0.3 * torch.rand(n, generator=g)}


def filters_of(name: str, rows: dict[str, torch.Tensor], vocab: int) -> dict:
    """The filter arguments ``name`` turns on; every other row of each is off."""
    out = {}
    for f in name.split("+"):
        t = rows[f].clone()
        off = {"top_k": vocab, "top_p": 1.0, "min_p": 0.0}[f]
        t[1::3] = off  # a third of the rows without it: per-row choice in one batch
        out[f] = t
    return out


def call(fn, logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``fn``, checking that it leaves its inputs as they were and returns ``[N]`` int64."""
    tensors = [logits, *args, *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]
    before = [bits(t.clone()) for t in tensors]
    out = fn(logits, *args, **kwargs)
    assert all(torch.equal(b, bits(t)) for b, t in zip(before, tensors)), "input modified"
    assert out.shape == (logits.shape[0],) and out.dtype == torch.int64
    return out


def check(logits: torch.Tensor, rows: dict, got: torch.Tensor, filters: dict) -> None:
    """Every draw valid on the reference's filtered logits, in the kept set, and equal to
    the reference's draw in all but rare rows."""
    t, u = rows["temperatures"], rows["uniforms"]
    scaled = filter_logits(logits, t, **filters)
    ones = torch.ones_like(t)
    ok = reference.inverse_cdf_draw_ok(scaled, ones, u, got, REL_TOL)
    assert ok.all(), f"invalid draws in rows {(~ok).nonzero().flatten().tolist()}"
    want = reference.sample_tokens(scaled, ones, u)
    mismatches = int((got != want).sum())
    assert mismatches <= max(1, logits.shape[0] // 100), (got.tolist(), want.tolist())


# (vocab, rows): ragged against the 16-lane blocks; 49152 is SmolLM2's vocabulary, with
# enough rows that the call runs on every thread.
SHAPES = [(1, 4), (17, 12), (300, 24), (5000, 8), (49152, 6)]


@pytest.mark.parametrize("vocab, n", SHAPES)
def test_temperature_draws_match_reference(vocab, n):
    g = generator(seed_for("cpu_sample_tokens", vocab, n))
    logits = torch.randn(n, vocab, generator=g) * 3
    rows = rows_of(n, g)
    got = call(cpu_sampling.sample_tokens, logits, rows["temperatures"], rows["uniforms"])
    check(logits, rows, got, {})


@pytest.mark.parametrize("name", FILTERS)
@pytest.mark.parametrize("vocab, n", SHAPES[1:])
def test_filtered_draws_match_reference(vocab, n, name):
    g = generator(seed_for("cpu_sample_filtered", vocab, n, name))
    logits = torch.randn(n, vocab, generator=g) * 3
    rows = rows_of(n, g)
    filters = filters_of(name, rows, vocab)
    got = call(cpu_sampling.sample_tokens_filtered, logits, rows["temperatures"],
               rows["uniforms"], **filters)
    check(logits, rows, got, filters)


@pytest.mark.parametrize("spread", [0.05, 30.0])
def test_flat_and_peaked_rows(spread):
    """A nearly flat row (top-p must collect most of the vocabulary: the search widens
    until it holds top_p of the mass) and a peaked one (a few tokens hold it all)."""
    g = generator(seed_for("cpu_sample_spread", spread))
    n, vocab = 8, 4000
    logits = torch.randn(n, vocab, generator=g) * spread
    rows = rows_of(n, g)
    for name in ("top_p", "top_k+top_p", "min_p"):
        filters = filters_of(name, rows, vocab)
        got = call(cpu_sampling.sample_tokens_filtered, logits, rows["temperatures"],
                   rows["uniforms"], **filters)
        check(logits, rows, got, filters)


def test_long_tail_holds_the_mass_top_p_needs():
    """One token with about half the mass, the other half spread over 49k tokens far below
    it: the first collection (tokens near the maximum) holds less than top_p of the mass,
    so the search must widen to the tail before cutting."""
    g = generator(seed_for("cpu_sample_long_tail"))
    n, vocab = 8, 49152
    logits = torch.randn(n, vocab, generator=g) * 0.1
    logits[:, 17] = 10.8  # e^10.8 ~ 49k: about half the mass
    rows = rows_of(n, g)
    rows["temperatures"] = torch.ones(n)
    rows["uniforms"] = torch.linspace(0.05, 0.95, n)
    for p in (0.4, 0.6, 0.9):
        filters = {"top_p": torch.full((n,), p)}
        got = call(cpu_sampling.sample_tokens_filtered, logits, rows["temperatures"],
                   rows["uniforms"], **filters)
        check(logits, rows, got, filters)
        assert (got != 17).any() == (p > 0.55)  # the tail is drawn only when kept


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32): min_p 0.5 keeps the tokens at
    half the largest probability (the reference drops only those below)."""
    n = 2048
    logits = torch.tensor([[0.125, 0.5, 0.25, 0.125]]).log().expand(n, -1).contiguous()
    u = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    got = call(cpu_sampling.sample_tokens_filtered, logits, torch.ones(n), u,
               min_p=torch.full((n,), 0.5))
    assert set(got.tolist()) == {1, 2}
    assert abs((got == 1).double().mean().item() - 2 / 3) < 2 / n


def test_large_top_k_in_a_peaked_row():
    """top_k of thousands where few tokens are near the maximum: the collection widens
    until it holds k tokens (ties with the k-th included)."""
    g = generator(seed_for("cpu_sample_large_k"))
    n, vocab = 6, 6000
    logits = torch.randn(n, vocab, generator=g) * 20
    rows = rows_of(n, g)
    k = torch.tensor([3000, 5999, 6000, 1, 2, 4500])
    p = torch.tensor([0.999, 1.0, 0.99, 1.0, 0.9, 1.0])
    got = call(cpu_sampling.sample_tokens_filtered, logits, rows["temperatures"],
               rows["uniforms"], top_k=k, top_p=p)
    check(logits, rows, got, {"top_k": k, "top_p": p})


def test_ties_at_the_cut_keep_the_lower_ids():
    """Eight tied tokens (exact powers of two: the sums are exact in both): top_k 3 keeps
    all tied with the 3rd; top_p 0.5 over 8 equal tokens keeps ids in increasing order
    until half the mass is before the next (the stable sort's order)."""
    n, vocab = 4096, 8
    logits = torch.zeros(n, vocab)
    u = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    t = torch.ones(n)
    got = call(cpu_sampling.sample_tokens_filtered, logits, t, u,
               top_p=torch.full((n,), 0.5))
    assert set(got.tolist()) == {0, 1, 2, 3}
    assert torch.equal(got, reference.sample_tokens_filtered(logits, t, u,
                                                             top_p=torch.full((n,), 0.5)))
    got = call(cpu_sampling.sample_tokens_filtered, logits, t, u,
               top_k=torch.full((n,), 3))
    assert set(got.tolist()) == set(range(8))


@pytest.mark.parametrize("top_p, kept", [(0.25, 64), (0.5, 128), (0.75, 192), (0.8, 205)])
def test_top_p_cut_among_many_tied_tokens(top_p, kept):
    """256 tied tokens (each 1/256: the partial sums are exact): top-p keeps ids in
    increasing order until the mass before the next reaches top_p, the same boundary
    rule deep inside the selection as at its end."""
    n, vocab = 512, 256
    logits = torch.zeros(n, vocab)
    u = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    f = {"top_p": torch.full((n,), top_p)}
    got = call(cpu_sampling.sample_tokens_filtered, logits, torch.ones(n), u, **f)
    assert set(got.tolist()) == set(range(kept))
    assert torch.equal(got, reference.sample_tokens_filtered(logits, torch.ones(n), u, **f))


def test_stratified_uniforms_reproduce_the_filtered_distribution():
    """One 300-token row at K stratified uniforms ``(j + 0.5) / K``, with top-k and top-p:
    an exact inverse CDF draws each kept token ``K * p`` times, up to one per interval
    end, and nothing else."""
    k = 8192
    g = generator(seed_for("cpu_sample_stratified"))
    row = torch.randn(1, 300, generator=g) * 2
    u = ((torch.arange(k, dtype=torch.float64) + 0.5) / k).float()
    t = torch.full((k,), 0.8)
    filters = {"top_k": torch.full((k,), 40), "top_p": torch.full((k,), 0.8)}
    got = call(cpu_sampling.sample_tokens_filtered, row.repeat(k, 1), t, u, **filters)
    scaled = filter_logits(row, t[:1], **{f: v[:1] for f, v in filters.items()})
    p = torch.softmax(scaled[0].double(), dim=-1)
    counts = torch.bincount(got, minlength=300).double()
    assert (counts - k * p).abs().max() <= 2
    assert set(got.tolist()) == set(p.nonzero().flatten().tolist())


@pytest.mark.parametrize("name", ["none", "top_p", "top_k+min_p"])
def test_banned_tokens_are_never_drawn(name):
    g = generator(seed_for("cpu_sample_banned", name))
    n, vocab = 16, 300
    logits = torch.randn(n, vocab, generator=g) * 2
    banned = torch.rand(n, vocab, generator=g) < 0.5
    banned[:, 7] = False
    logits[banned] = NEG_INF
    rows = rows_of(n, g)
    filters = {} if name == "none" else filters_of(name, rows, vocab)
    got = call(cpu_sampling.sample_tokens_filtered, logits, rows["temperatures"],
               rows["uniforms"], **filters)
    assert not banned.gather(1, got.unsqueeze(1)).any()
    check(logits, rows, got, filters)
    # u = 0: the first token the filters left.
    kept = filter_logits(logits[:1], rows["temperatures"][:1],
                         **{f: v[:1] for f, v in filters.items()})
    assert got[0] == kept[0].isfinite().nonzero()[0, 0]


def test_one_finite_token_and_degenerate_rows():
    """One finite logit is drawn whatever u (at the start, middle, end of a ragged row);
    NaN logits are never drawn (as in the Triton kernel), whatever u; a row with no
    finite logit gets id 0."""
    vocab = 1001
    for pos in (0, 500, 1000):
        logits = torch.full((3, vocab), NEG_INF)
        logits[:, pos] = torch.tensor([-50.0, 0.0, 80.0])
        u = torch.tensor([0.0, 0.5, ONE_BELOW])
        t = torch.ones(3)
        assert cpu_sampling.sample_tokens(logits, t, u).tolist() == [pos] * 3
        got = cpu_sampling.sample_tokens_filtered(logits, t, u, top_p=torch.full((3,), .5),
                                                  min_p=torch.full((3,), 0.1))
        assert got.tolist() == [pos] * 3
    g = generator(seed_for("cpu_sample_nan"))
    n = 64
    logits = torch.randn(n, vocab, generator=g) * 3
    nan = torch.rand(n, vocab, generator=g) < 0.3
    nan[:, 7] = False
    logits[nan] = float("nan")
    logits[:, 3] = float("nan")  # a NaN where the maximum would be
    u = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    for f in ({}, {"top_p": torch.full((n,), 0.9)}, {"top_k": torch.full((n,), 20)}):
        got = cpu_sampling.sample_tokens_filtered(logits, torch.ones(n), u, **f)
        assert not nan.gather(1, got.unsqueeze(1)).any() and not (got == 3).any()
        clean = logits.masked_fill(logits.isnan(), NEG_INF)
        check(clean, {"temperatures": torch.ones(n), "uniforms": u}, got, f)
    empty = torch.full((2, vocab), NEG_INF)
    empty[1] = float("nan")
    for got in (cpu_sampling.sample_tokens(empty, torch.ones(2), torch.full((2,), .5)),
                cpu_sampling.sample_tokens_filtered(empty, torch.ones(2),
                                                    torch.full((2,), .5),
                                                    top_k=torch.full((2,), 5))):
        assert got.tolist() == [0, 0]


def test_strided_rows_and_other_dtypes():
    """Rows of a wider tensor (a view) draw as their contiguous copy; bf16 logits take
    the reference (the C path is float32), with its exact draws."""
    g = generator(seed_for("cpu_sample_strided"))
    n, vocab = 12, 700
    wide = torch.randn(n, vocab + 37, generator=g) * 3
    view = wide[:, 5:5 + vocab]
    rows = rows_of(n, g)
    t, u = rows["temperatures"], rows["uniforms"]
    f = {"top_p": rows["top_p"], "min_p": rows["min_p"]}
    assert torch.equal(cpu_sampling.sample_tokens_filtered(view, t, u, **f),
                       cpu_sampling.sample_tokens_filtered(view.contiguous(), t, u, **f))
    assert torch.equal(cpu_sampling.sample_tokens(view, t, u),
                       cpu_sampling.sample_tokens(view.contiguous(), t, u))
    half = view.bfloat16()
    assert torch.equal(cpu_sampling.sample_tokens_filtered(half, t, u, **f),
                       reference.sample_tokens_filtered(half, t, u, **f))


def test_no_rows():
    out = cpu_sampling.sample_tokens_filtered(torch.empty(0, 9), torch.empty(0),
                                              torch.empty(0), top_p=torch.empty(0))
    assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.parametrize("name, kwargs, match", [
    ("logits", {"logits": torch.zeros(5)}, "logits"),
    ("vocab", {"logits": torch.zeros(2, 0)}, "logits"),
    ("temperatures", {"temperatures": torch.ones(3)}, "temperatures"),
    ("uniforms", {"uniforms": torch.ones(2, dtype=torch.float64)}, "uniforms"),
    ("top_k", {"top_k": torch.ones(2, dtype=torch.int32)}, "top_k"),
    ("top_p", {"top_p": torch.ones(3)}, "top_p"),
    ("min_p", {"min_p": torch.ones(2, 1)}, "min_p"),
])
def test_bad_input_raises_value_error_naming_the_argument(name, kwargs, match):
    args = {"logits": torch.randn(2, 9), "temperatures": torch.ones(2),
            "uniforms": torch.full((2,), 0.5), **kwargs}
    with pytest.raises(ValueError, match=match):
        cpu_sampling.sample_tokens_filtered(**args)
