"""Token steering end to end on the default model (issue 28, part 4): ``logit_bias``
forces and bans tokens, ``allowed_token_ids`` restricts every step, a two-token bad word
never appears while the request beside it in the batch is unaffected, steering combines
with a grammar and penalties, with the overlapped loop too, and a request whose
steering leaves nothing to sample fails alone."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, device="cpu", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def baseline(llm) -> list[int]:
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8),
                         use_tqdm=False)
    return out.outputs[0].token_ids


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, **kw)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_full_bias_forces_a_token_and_a_negative_one_bans_it(llm, baseline):
    first = baseline[0]
    forced, banned, plain = _ids(llm.generate(
        [PROMPT] * 3, [_greedy(logit_bias={"42": 100}),
                       _greedy(logit_bias={first: -100}), _greedy()], use_tqdm=False))
    assert forced == [42] * 8
    assert first not in banned and banned != baseline
    assert plain == baseline  # the rows beside them are untouched
    # Sampled rows too (and the bias combines with a repetition penalty).
    [sampled] = _ids(llm.generate([PROMPT], SamplingParams(
        temperature=1.0, max_tokens=6, seed=3, logit_bias={42: 100},
        repetition_penalty=1.3), use_tqdm=False))
    assert sampled == [42] * 6


def test_allowed_token_ids_restrict_every_step(llm, baseline):
    allowed = [42, 260, 3575, 282]
    outs = llm.generate([PROMPT] * 2, [
        SamplingParams(temperature=1.0, max_tokens=12, seed=7, allowed_token_ids=allowed),
        _greedy()], use_tqdm=False)
    got = outs[0].outputs[0]
    assert len(got.token_ids) == 12 and set(got.token_ids) <= set(allowed)
    assert got.finish_reason == "length"  # EOS is not allowed
    assert _ids(outs)[1] == baseline


@pytest.mark.parametrize("overlap", [False, True])
def test_a_two_token_bad_word_never_appears(smollm2_path, baseline, overlap):
    llm = LLM(smollm2_path, device="cpu", kv_cache_memory=64 << 20,
              async_scheduling=overlap)
    tok = llm.engine.tokenizer
    pair = baseline[:2]  # " Paris" "." with this model
    word = tok.decode(pair)
    assert tok.encode(word, add_special_tokens=False) == pair, word
    steered, plain = llm.generate([PROMPT] * 2, [_greedy(bad_words=[word]), _greedy()],
                                  use_tqdm=False)
    ids = steered.outputs[0].token_ids
    assert all(ids[i:i + 2] != pair for i in range(len(ids) - 1)), ids
    assert ids[0] == pair[0]  # the first token alone is still allowed
    assert word.strip() not in steered.outputs[0].text
    assert plain.outputs[0].token_ids == baseline


def test_a_one_token_bad_word_is_never_sampled(llm, baseline):
    tok = llm.engine.tokenizer
    word = tok.decode(baseline[:1]).strip()
    [steered] = llm.generate([PROMPT], _greedy(bad_words=[word]), use_tqdm=False)
    ids = steered.outputs[0].token_ids
    variants = {t for w in (word, " " + word) for t in tok.encode(w, add_special_tokens=False)}
    assert not variants & set(ids), (variants, ids)


def test_steering_combines_with_a_grammar(llm):
    choice = {"choice": ["yes", "no"]}
    tok = llm.engine.tokenizer
    no = tok.encode("no", add_special_tokens=False)[0]
    yes = tok.encode("yes", add_special_tokens=False)[0]
    [a, b] = llm.generate([PROMPT] * 2, [
        _greedy(structured_outputs=choice, logit_bias={no: 100}),
        _greedy(structured_outputs=choice, logit_bias={yes: 100})], use_tqdm=False)
    assert (a.outputs[0].text, b.outputs[0].text) == ("no", "yes")
    [c] = llm.generate([PROMPT], _greedy(structured_outputs=choice, bad_words=["yes"]),
                       use_tqdm=False)
    assert c.outputs[0].text == "no"


def test_a_request_left_with_nothing_fails_alone(llm, baseline):
    choice = {"choice": ["yes", "no"]}
    starved, plain = llm.generate([PROMPT] * 2, [
        _greedy(structured_outputs=choice, allowed_token_ids=[42]), _greedy()],
        use_tqdm=False)
    assert starved.error is not None and "nothing left to sample" in starved.error
    assert "allowed_token_ids" in starved.error
    assert starved.outputs[0].finish_reason == "abort"
    assert plain.error is None and plain.outputs[0].token_ids == baseline
    # Known at submission: every allowed token is a bad word.
    paris = llm.engine.tokenizer.encode(" Paris", add_special_tokens=False)
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token"):
        llm.generate([PROMPT], _greedy(allowed_token_ids=paris, bad_words=["Paris"]),
                     use_tqdm=False)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: token ids \[{vocab}\] outside"):
        llm.generate([PROMPT], _greedy(logit_bias={vocab: 1}), use_tqdm=False)
