"""Token steering's device side (issue 28, part 4): the per-slot ``SteeringTable`` rows,
gathered by slot, applied to random logits, match a dense torch reference; rows are
rewritten, widened and cleared as slots change hands; bad-word matching and the
resolution of a request's steering (ids checked, words tokenized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.sampling.steering import (
    SteeringTable,
    bad_word_bans,
    resolve_steering,
)

V = 50


def _steering(bias: dict[int, float] | None = None, allowed: list[int] | None = None):
    params = SamplingParams(logit_bias=bias, allowed_token_ids=allowed)
    return resolve_steering("r", params, tokenizer=None, vocab_size=V)


def _reference(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Dense: each row's biases added, then everything outside its allowed ids -inf."""
    out = logits.clone()
    for i, st in enumerate(rows):
        if st is None:
            continue
        for t, b in zip(st.bias_ids.tolist(), st.bias_values.tolist()):
            out[i, t] += b
        if st.allowed_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[torch.from_numpy(st.allowed_ids)] = True
            out[i, ~keep] = float("-inf")
    return out


def _check(table: SteeringTable, slot_rows: dict[int, object], slots: list[int],
           seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(slots), V, generator=gen)
    want = _reference(logits, [slot_rows.get(s) for s in slots])
    sl = np.asarray(slots, np.int64)
    step = table.gather(sl, torch.from_numpy(sl))
    if all(slot_rows.get(s) is None for s in slots):
        assert step is None  # nothing steered: nothing runs
        return
    got = logits.clone()
    step.apply(got)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_table_rows_match_the_dense_reference():
    table = SteeringTable(num_slots=6, device="cpu")
    rows = {
        0: _steering(bias={3: 100.0, 7: -100.0, 11: 2.5}),
        2: _steering(allowed=[4, 9, 30]),
        3: _steering(bias={1: -3.0}, allowed=[1, 2]),
    }
    for slot, st in rows.items():
        table.write(slot, st)
    _check(table, rows, [0, 1, 2, 3, 4], seed=1)
    _check(table, rows, [3, 0], seed=2)
    _check(table, rows, [1, 4, 5], seed=3)
    # A slot handed to an unsteered request is cleared; a wider row widens the table.
    table.write(0, None)
    rows.pop(0)
    wide = _steering(bias={t: float(t % 7) - 3.0 for t in range(0, 40, 3)})
    table.write(5, wide)
    rows[5] = wide
    table.write(2, None)
    rows.pop(2)
    _check(table, rows, [0, 2, 3, 5], seed=4)
    _check(table, rows, [0, 2], seed=5)


def test_the_version_changes_only_when_a_row_does():
    table = SteeringTable(num_slots=3, device="cpu")
    v = table.version
    table.write(1, None)
    assert table.version == v  # an unsteered slot stays unsteered: cached tensors hold
    table.write(1, _steering(bias={2: 1.0}))
    assert table.version > v


def test_bad_word_bans_match_the_tail_of_the_output():
    seqs = ((5, 6), (1, 2, 3))
    assert bad_word_bans(seqs, []) == []
    assert bad_word_bans(seqs, [9, 5]) == [6]
    assert bad_word_bans(seqs, [1, 2]) == [3]
    assert bad_word_bans(seqs, [2, 1]) == []
    assert bad_word_bans(seqs, [1, 2, 5]) == [6]


def test_resolution_checks_ids_and_tokenizes_words(smollm2_tokenizer):
    tok = smollm2_tokenizer
    vocab = len(tok)
    st = resolve_steering("r", SamplingParams(bad_words=["Paris", "New York City"],
                                              logit_bias={"5": 3}), tok, vocab)
    single = set(st.banned_ids.tolist())
    assert set(tok.encode(" Paris", add_special_tokens=False)) <= single
    assert set(tok.encode("Paris", add_special_tokens=False)) <= single
    assert tuple(tok.encode(" New York City", add_special_tokens=False)) in st.bad_sequences
    assert dict(zip(st.bias_ids.tolist(), st.bias_values.tolist()))[5] == 3.0
    assert resolve_steering("r", SamplingParams(), tok, vocab) is None
    for params, field in (
            (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
            (SamplingParams(allowed_token_ids=[1, vocab + 3]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"request 'r': {field}: token ids"):
            resolve_steering("r", params, tok, vocab)
    [paris] = tok.encode(" Paris", add_special_tokens=False)
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token"):
        resolve_steering("r", SamplingParams(allowed_token_ids=[paris],
                                             bad_words=["Paris"]), tok, vocab)


@pytest.mark.parametrize("kwargs,match", [
    ({"logit_bias": {"5": 101}}, r"logit_bias\[5\]=101: must be a number in \[-100, 100\]"),
    ({"logit_bias": {"5": "high"}}, r"logit_bias\[5\]='high'"),
    ({"logit_bias": {"five": 1}}, "logit_bias: key 'five' is not a token id"),
    ({"logit_bias": {-2: 1}}, "logit_bias: key -2 is not a token id"),
    ({"logit_bias": [1, 2]}, "logit_bias=.*must be an object"),
    ({"allowed_token_ids": []}, "allowed_token_ids=.*non-empty"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids="),
    ({"bad_words": "Paris"}, "bad_words="),
    ({"bad_words": ["  "]}, "bad_words="),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
