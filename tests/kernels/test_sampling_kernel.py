"""``sample_tokens`` (one draw per row from ``softmax(logits / T)`` by inverting the row's
CDF at a given uniform) against the torch reference, plus what an exact inverse CDF
promises on its own: the drawn token's cumulative interval holds ``u * total`` (checked in
float64), banned (-inf) tokens are never drawn, stratified uniforms reproduce ``p``.

The kernel sums in another order than torch (per block, then across blocks), so a target
within rounding of a CDF boundary may pick the neighbouring token: a mismatch with the
reference is allowed when it is rare and still a valid draw up to a 1e-5 relative
tolerance. Each case checks that the inputs are left as they were and that the output is
a new int64 tensor on the logits' device.

The interpreter runs one program per row with a 16384-element block whatever the vocab
(5-20 ms a row), so the row counts are small.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.runtime import Target
from deepinfer_kernels.sampling import sample_tokens_launches
from tests.kernels.helpers import DEVICE, bits, generator, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, BF16, F16]
NEG_INF = float("-inf")
ONE_BELOW = 1 - 2**-24  # the largest float32 below 1
REL_TOL = 1e-5


def planned_block() -> int:
    """The vocab block the planner picks here (16384 in the interpreter, 4096 on a GPU)."""
    x = torch.empty(1, 8, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    (launch,) = sample_tokens_launches(x, one, one, one.long(), Target.of(DEVICE))
    return launch.kwargs["BLOCK"]


def temperatures(n: int, g: torch.Generator) -> torch.Tensor:
    return (0.3 + 1.7 * torch.rand(n, generator=g)).to(DEVICE)


def uniforms(n: int, g: torch.Generator) -> torch.Tensor:
    """Random in [0, 1), with the edges 0 and the largest float32 below 1 in rows 0, 1."""
    u = torch.rand(n, generator=g)
    u[:2] = torch.tensor([0.0, ONE_BELOW])[:n]
    return u.to(DEVICE)


def sample(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``deepinfer_kernels.sample_tokens``, checking that it leaves its inputs as they were and
    returns a new ``[N]`` int64 tensor on the logits' device."""
    before = [t.clone() for t in (logits, temps, u)]
    out = deepinfer_kernels.sample_tokens(logits, temps, u)
    for i, (b, a) in enumerate(zip(before, (logits, temps, u))):
        assert torch.equal(bits(b), bits(a)), f"input {i} was modified"
    assert out.shape == (logits.shape[0],) and out.dtype == torch.int64
    assert out.device == logits.device and out.is_contiguous()
    if out.numel():
        ptr = out.untyped_storage().data_ptr()
        assert all(ptr != t.untyped_storage().data_ptr() for t in (logits, temps, u))
    return out


def valid_draws(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """Per row: whether ``ids`` is an inverse-CDF answer at ``u`` (float64, up to
    ``REL_TOL`` of the total; ``reference.inverse_cdf_draw_ok``)."""
    return reference.inverse_cdf_draw_ok(logits, temps, u, ids, REL_TOL)


def check_against_reference(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor,
                            got: torch.Tensor) -> None:
    """Every draw valid; ids equal to the reference's except for rare rounding ties."""
    ok = valid_draws(logits, temps, u, got)
    assert ok.all(), f"invalid draws in rows {(~ok).nonzero().flatten().tolist()}"
    want = reference.sample_tokens(logits, temps, u)
    mismatches = int((got != want).sum())
    assert mismatches <= max(1, logits.shape[0] // 100), (
        f"{mismatches} of {logits.shape[0]} rows differ from the reference")


# --- agreement with the reference ------------------------------------------------------

# (vocab, rows): none a multiple of the block; 40000 is over the interpreter's 16384 block
# (3 iterations a pass; 10 with a GPU's 4096), with few rows.
VOCABS = [(7, 12), (300, 12), (5000, 8), (40000, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab, rows", VOCABS)
def test_matches_reference(vocab, rows, dtype):
    g = generator(seed_for("sample_tokens", vocab, rows, dtype))
    logits = (randn((rows, vocab), F32, g) * 3).to(dtype)  # logit spreads of a real model
    temps, u = temperatures(rows, g), uniforms(rows, g)
    got = sample(logits, temps, u)
    check_against_reference(logits, temps, u, got)
    # u = 0: the first token (its p is over 1e-8 in each of these rows: far from underflow).
    assert got[0] == 0


def test_strided_rows_match_contiguous():
    """Rows of a wider tensor (a row stride of 313, not the vocab) give the same ids."""
    g = generator(seed_for("sample_tokens_strided"))
    rows, vocab = 8, 300
    logits = randn((rows, vocab + 13), F16, g)[:, 5:5 + vocab]
    assert logits.stride(0) != vocab
    temps, u = temperatures(rows, g), uniforms(rows, g)
    got = sample(logits, temps, u)
    assert torch.equal(got, sample(logits.contiguous(), temps, u))
    check_against_reference(logits, temps, u, got)


def test_no_rows():
    logits = torch.empty(0, 7, device=DEVICE)
    out = deepinfer_kernels.sample_tokens(logits, torch.empty(0, device=DEVICE),
                                torch.empty(0, device=DEVICE))
    assert out.shape == (0,) and out.dtype == torch.int64 and out.device == logits.device


def test_stratified_uniforms_reproduce_the_distribution():
    """One 5-token row drawn at K stratified uniforms ``(j + 0.5) / K``: an exact inverse
    CDF draws token i ``K * p[i]`` times, up to one for each interval end (deterministic,
    not statistical). K is small in the interpreter (one program per row)."""
    k = 4000 if DEVICE.type == "cuda" else 128
    g = generator(seed_for("sample_tokens_stratified"))
    row = randn((1, 5), F32, g) * 2
    temp = 0.8
    u = ((torch.arange(k, dtype=torch.float64) + 0.5) / k).float().to(DEVICE)
    got = sample(row.repeat(k, 1), torch.full((k,), temp, device=DEVICE), u)
    counts = torch.bincount(got, minlength=5).double().cpu()
    p = torch.softmax(row[0].double() / temp, dim=-1).cpu()
    assert (counts - k * p).abs().max() <= 2, (counts.tolist(), (k * p).tolist())


# --- banned tokens ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_banned_tokens_are_never_drawn(dtype):
    """Half the vocab -inf at random positions (at least one token left per row)."""
    g = generator(seed_for("sample_tokens_banned", dtype))
    rows, vocab = 16, 300
    logits = randn((rows, vocab), dtype, g) * 2
    banned = (torch.rand(rows, vocab, generator=g) < 0.5).to(DEVICE)
    banned[:, 7] = False
    logits[banned] = NEG_INF
    temps, u = temperatures(rows, g), uniforms(rows, g)
    u[1] = 0.5  # not 1 - 2^-24: with banned tokens that is the rounding edge, tested below
    got = sample(logits, temps, u)
    assert not banned.gather(1, got.unsqueeze(1)).any()
    check_against_reference(logits, temps, u, got)
    # u = 0: the first drawable token.
    assert got[0] == (~banned[0]).nonzero()[0, 0]


# The interpreter's NumPy warns at exp(-inf - -inf) on the branch tl.where discards.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_one_finite_token_is_always_drawn():
    """A row with one finite logit draws it whatever u: at the start, in the middle, at the
    end; and past the first block(s) of a 40000 vocab (blocks of -inf before it)."""
    g = generator(seed_for("sample_tokens_one_finite"))
    cases = []  # (vocab, position)
    for vocab, positions in ((300, (0, 150, 299)), (40000, (20000, 39999))):
        cases += [(vocab, pos) for pos in positions]
    for vocab, pos in cases:
        edges = [0.0, ONE_BELOW, float(torch.rand(1, generator=g))]
        n = len(edges)
        logits = torch.full((n, vocab), NEG_INF, device=DEVICE)
        logits[:, pos] = randn((n,), F32, g) * 5
        got = sample(logits, temperatures(n, g), torch.tensor(edges, device=DEVICE))
        assert got.tolist() == [pos] * n, (vocab, pos)


def test_banned_token_after_a_block_boundary_is_never_drawn():
    """A -inf token first in its block, at targets swept across the cumulative mass of the
    blocks before it in steps of one float32 u (2^-24): the scan must carry the same
    running total across the boundary that it compared within the block, or a target
    between the two draws the banned token."""
    block = planned_block()
    vocab = block + 2
    g = generator(seed_for("sample_tokens_block_boundary"))
    row = randn((1, vocab), F32, g)
    row[0, block] = NEG_INF
    cdf = torch.softmax(row[0].double(), dim=-1).cumsum(dim=-1)
    u0 = float(cdf[block - 1] / cdf[-1])
    steps = torch.arange(-16, 16, dtype=torch.float64)
    u = (u0 + steps * 2**-24).float().to(DEVICE)
    n = u.numel()
    logits, temps = row.repeat(n, 1), torch.ones(n, device=DEVICE)
    got = sample(logits, temps, u)
    drew_banned = (got == block).nonzero().flatten().tolist()
    assert not drew_banned, (
        f"token {block} (-inf) drawn at u = {[float(u[i]).hex() for i in drew_banned]}")
    # Every target here is within rounding of a CDF boundary: valid draws, not the
    # reference's ids.
    assert valid_draws(logits, temps, u, got).all()


# --- the rounding edge at u -> 1 -------------------------------------------------------

# 5-token rows where the kernel's scan total falls below u * (its normaliser) at
# u = 1 - 2^-24 in the interpreter (the two sum in different orders), so that the kernel's
# rounding-edge rule decides: with the last token drawable, and with it -inf.
CRAFTED_LAST_DRAWABLE = [[0.0, 0.0, 0.5, 2.5, 1.0], [0.0, 0.0, 1.0, 2.0, 2.5],
                         [0.0, 0.0, 2.0, 0.0, 3.0]]
CRAFTED_BANNED_TAIL = [[0.0, 1.5, 0.0, 0.0, NEG_INF], [0.0, 0.0, 2.0, 2.0, NEG_INF],
                       [0.0, 1.5, 2.0, 0.5, NEG_INF]]
NEAR_ONE = [ONE_BELOW, 1 - 2**-23, 1 - 3 * 2**-24]


def near_one(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row at each ``NEAR_ONE`` uniform: ``(logits, temperatures (1), uniforms)``."""
    logits = rows.to(DEVICE).repeat_interleave(len(NEAR_ONE), dim=0)
    n = logits.shape[0]
    u = torch.tensor(NEAR_ONE * rows.shape[0], device=DEVICE)
    return logits, torch.ones(n, device=DEVICE), u


def test_u_just_below_one_draws_the_last_token():
    """The last token drawable (p > 1e-3 here): an exact inverse CDF at u within 3 ulps of
    1 draws it; so do the kernel (by its rounding-edge rule where its scan falls short)
    and the reference."""
    g = generator(seed_for("sample_tokens_near_one_last"))
    for rows in (torch.tensor(CRAFTED_LAST_DRAWABLE), torch.randn(6, 300, generator=g) * 2):
        logits, temps, u = near_one(rows)
        got = sample(logits, temps, u)
        vocab = logits.shape[1]
        assert got.tolist() == [vocab - 1] * logits.shape[0]
        assert torch.equal(got, reference.sample_tokens(logits, temps, u))


def test_u_just_below_one_banned_tail():
    """The last tokens -inf: the smallest token whose cumulative probability exceeds
    ``u * total`` is the last drawable one: what the docstring promises and what the
    reference returns (in float32 ``u * total < total`` for every u < 1, so the
    reference's own rounding-edge rule never applies), not the row's most likely token."""
    g = generator(seed_for("sample_tokens_near_one_banned"))
    random = torch.randn(6, 300, generator=g) * 2
    random[:, 150:] = NEG_INF
    for rows in (torch.tensor(CRAFTED_BANNED_TAIL), random):
        logits, temps, u = near_one(rows)
        got = sample(logits, temps, u)
        last_drawable = torch.full_like(got, int(rows[0].isfinite().nonzero().max()))
        assert torch.equal(reference.sample_tokens(logits, temps, u), last_drawable)
        wrong = (got != last_drawable).nonzero().flatten().tolist()
        assert not wrong, (f"rows {wrong} (u {[float(u[i]) for i in wrong]}): drew "
                           f"{got[wrong].tolist()}, not the last drawable token "
                           f"{int(last_drawable[0])}")


def test_near_one_draws_no_extra_mass_onto_the_last_token():
    """u a hair below 1 with a last token of negligible probability (a reserved id): the
    draw is the float64 inverse CDF's, never the last token. (The scan's total can round
    below the first pass's normaliser; a draw past it once fell back to the last token,
    giving it ~1e-7 of the mass, far more than its own.)"""
    g = generator(seed_for("sample_tokens_near_one_tail"))
    rows, vocab = 4, 40000  # several interpreter blocks: sums in another order per pass
    logits = randn((rows, vocab), F32, g) * 3
    logits[:, -1] = -40.0  # p ~ 1e-19: drawable, but ~never
    temps = torch.ones(rows, device=DEVICE)
    u = torch.tensor([1 - 2**-20, 1 - 2**-21, 1 - 2**-22, 1 - 2**-23], device=DEVICE)
    got = sample(logits, temps, u)
    assert (got != vocab - 1).all(), got.tolist()
    p = torch.softmax(logits.double(), dim=-1)
    cdf = p.cumsum(dim=-1)
    exact = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
    # Within a token or two of the exact answer: fp32 sums of 40k terms differ by ~1e-7.
    assert ((got - exact.squeeze(1)).abs() <= 2).all(), (got.tolist(), exact.tolist())
    assert valid_draws(logits, temps, u, got).all()


# --- degenerate rows -------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # x / 0, 0 / 0 in the interpreter
def test_zero_temperature_and_nan_rows_give_an_id_in_range():
    """Documented: a zero temperature or NaN logits give some id in [0, V) (the sampler
    replaces greedy rows); no crash, no out-of-range id."""
    g = generator(seed_for("sample_tokens_degenerate"))
    vocab = 300
    logits = randn((4, vocab), F32, g)
    logits[2] = float("nan")
    logits[3, ::3] = float("nan")
    temps = torch.tensor([0.0, 0.0, 1.0, 0.7], device=DEVICE)
    logits[1, :10] = 0.0  # 0 / 0 in a zero-temperature row
    got = sample(logits, temps, torch.tensor([0.3, ONE_BELOW, 0.5, 0.2], device=DEVICE))
    assert ((got >= 0) & (got < vocab)).all(), got.tolist()


# --- bad input -------------------------------------------------------------------------

def _t(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.full(shape, 0.5, device=DEVICE).to(dtype)


def _sample(logits: torch.Tensor | None = None, temperatures: torch.Tensor | None = None,
            uniforms: torch.Tensor | None = None) -> None:
    """sample_tokens on valid arguments (N 3, V 8) with the given ones replaced."""
    deepinfer_kernels.sample_tokens(_t(3, 8) if logits is None else logits,
                          _t(3) if temperatures is None else temperatures,
                          _t(3) if uniforms is None else uniforms)


BAD_INPUTS = {
    "logits_1d": ("logits", lambda: _sample(logits=_t(8))),
    "logits_3d": ("logits", lambda: _sample(logits=_t(3, 2, 4))),
    "logits_int": ("logits", lambda: _sample(logits=_t(3, 8, dtype=torch.int32))),
    "logits_float64": ("logits", lambda: _sample(logits=_t(3, 8, dtype=torch.float64))),
    "logits_empty_vocab": ("logits", lambda: _sample(logits=_t(3, 0))),
    "logits_strided_cols": ("logits", lambda: _sample(logits=_t(8, 3).t())),
    "temperatures_float64": ("temperatures", lambda: _sample(
        temperatures=_t(3, dtype=torch.float64))),
    "temperatures_bf16": ("temperatures", lambda: _sample(temperatures=_t(3, dtype=BF16))),
    "temperatures_length": ("temperatures", lambda: _sample(temperatures=_t(4))),
    "temperatures_2d": ("temperatures", lambda: _sample(temperatures=_t(3, 1))),
    "temperatures_strided": ("temperatures", lambda: _sample(temperatures=_t(6)[::2])),
    "uniforms_float64": ("uniforms", lambda: _sample(uniforms=_t(3, dtype=torch.float64))),
    "uniforms_length": ("uniforms", lambda: _sample(uniforms=_t(2))),
    "uniforms_2d": ("uniforms", lambda: _sample(uniforms=_t(1, 3))),
}


@pytest.mark.parametrize("name, call", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_value_error_naming_the_argument(name, call):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call()
