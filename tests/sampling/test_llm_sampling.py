"""Sampling parameters through the whole engine (tiny random Llama + a real BPE tokenizer).

Each test would fail if its parameter were ignored by the engine.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPT = "the quick brown fox"
OTHER = ["hello world, hello engine", "once upon a time", "a b c d e f"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama_tied"].path, dtype="float32", device="cpu",
               max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory=8 << 20,
               block_size=8)


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seed_reproducible_whatever_else_is_in_the_batch(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _gen(llm, [PROMPT], sp)[0].outputs[0].token_ids
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True),
                    sp,
                    SamplingParams(temperature=0.9, seed=99, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    mixed = _gen(llm, [OTHER[0], PROMPT, OTHER[1], OTHER[2]], mixed_params)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = _gen(llm, [PROMPT], SamplingParams(temperature=1.0, seed=4321,
                                                    max_tokens=12, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_max_tokens_and_ignore_eos(llm):
    out = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=9,
                                             ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"


def test_stop_string_trims_text(llm):
    base = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                              ignore_eos=True))[0].outputs[0].text
    assert len(base) > 6
    stop = base[3:6]
    out = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                             stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: base.index(stop)]
    assert stop not in out.text
    kept = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                              stop=[stop], include_stop_str_in_output=True)
                )[0].outputs[0]
    assert kept.text == base[: base.index(stop) + len(stop)] and kept.stop_reason == stop
    assert kept.token_ids == out.token_ids
    assert _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
                )[0].outputs[0].stop_reason is None  # a length limit


def test_stop_string_on_the_last_allowed_token_is_a_stop(llm):
    """The token that reaches max_tokens also completes a stop string: the text is cut
    there, so the reason is "stop", not "length"."""
    base = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                              ignore_eos=True))[0].outputs[0]
    # The shortest prefix of the output whose text ends in a 2-char string seen nowhere
    # before it: that token completes it.
    for k in range(2, len(base.token_ids) + 1):
        text = llm.tokenizer.decode(base.token_ids[:k], skip_special_tokens=True)
        stop = text[-2:]
        if len(text) >= 2 and text.find(stop) == len(text) - 2 and stop.strip():
            break
    else:
        pytest.skip("no usable stop string in this output")
    out = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True,
                                             stop=[stop]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:k] and out.text == text[:-2]
    assert out.finish_reason == "stop"


def test_min_tokens_holds_back_stop_strings(llm):
    """As for EOS and stop ids, a stop string does not end the output before min_tokens
    tokens (vLLM's rule): the first match counted is one completed by token min_tokens
    or later."""
    base = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                              ignore_eos=True))[0].outputs[0]
    first_char = base.text.strip()[0]
    early = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                               ignore_eos=True, stop=[first_char]))
    assert len(early[0].outputs[0].token_ids) < 6  # it stops at once without min_tokens
    held = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                              stop=[first_char], min_tokens=6))
    out = held[0].outputs[0]
    assert len(out.token_ids) >= 6 and out.token_ids == base.token_ids[:len(out.token_ids)]


def test_bad_prompts_fail_the_call_and_leave_nothing_queued(llm):
    """Any bad prompt (not only a ValueError from the engine) aborts the requests added
    before it; token ids must be integers (7.5 would be truncated, True taken as 1)."""
    for prompts, match in (([PROMPT, None], r"prompt 1: expected a string or a list"),
                           ([[5, 7.5]], r"prompt 0: .*must be integers.*7\.5"),
                           ([[5, True]], r"prompt 0: .*must be integers.*True")):
        with pytest.raises(ValueError, match=match):
            _gen(llm, prompts, SamplingParams(max_tokens=2))
        assert not llm.engine.has_unfinished() and not llm.engine.requests
    import numpy as np

    (out,) = _gen(llm, [[int(t) for t in np.array([5, 7])]], SamplingParams(max_tokens=2))
    assert out.prompt_token_ids == [5, 7]
    (out,) = _gen(llm, [list(np.array([5, 7]))], SamplingParams(max_tokens=2))
    assert out.prompt_token_ids == [5, 7] and all(type(t) is int for t in out.prompt_token_ids)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                ignore_eos=True))[0].outputs[0].token_ids
    first = greedy[0]
    stopped = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                 ignore_eos=True, stop_token_ids=[first]))
    assert stopped[0].outputs[0].token_ids == [first]
    assert stopped[0].outputs[0].finish_reason == "stop"
    assert stopped[0].outputs[0].stop_reason == first
    late = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                              stop_token_ids=[first], min_tokens=3))
    toks = late[0].outputs[0].token_ids
    assert len(toks) >= 3 and first not in toks[:3]


def test_penalties_change_greedy_output(llm):
    base = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=24,
                                              ignore_eos=True))[0].outputs[0].token_ids
    assert len(set(base)) < len(base)  # the random model repeats itself
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
               {"repetition_penalty": 3.0}):
        out = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=24,
                                                 ignore_eos=True, **kw))[0].outputs[0]
        assert out.token_ids != base, kw
        assert len(set(out.token_ids)) > len(set(base)), kw


def test_penalty_state_kept_only_for_penalized_samples(llm):
    """Token counts are recorded only for samples with a penalty (a greedy batch without
    one copies no logits and counts nothing), and a penalized sample batched with plain
    ones gives what it gives alone, as do the plain ones."""
    states = llm.engine.runner.states
    for t in states:
        t.zero_()
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain_alone = _gen(llm, [OTHER[0]], plain)[0].outputs[0].token_ids
    _gen(llm, OTHER, plain)
    assert not any(bool(t.any()) for t in states)
    pen = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                         repetition_penalty=3.0, frequency_penalty=0.5)
    alone = _gen(llm, [PROMPT], pen)[0].outputs[0].token_ids
    assert any(bool(t.any()) for t in states)
    mixed = _gen(llm, [OTHER[0], PROMPT, OTHER[1]], [plain, pen, plain])
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[0].outputs[0].token_ids == plain_alone


def test_top_k_one_is_greedy(llm):
    greedy = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=10,
                                                ignore_eos=True))[0].outputs[0].token_ids
    topk = _gen(llm, [PROMPT], SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10,
                                              ignore_eos=True))[0].outputs[0].token_ids
    assert topk == greedy


def test_logprobs(llm):
    out = _gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                             logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 2 <= len(lp) <= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token


def test_parallel_samples_differ_and_share_prompt_blocks(llm):
    engine = llm.engine
    prompt_ids = llm.tokenizer.encode(PROMPT * 4)  # several full blocks
    engine.add_request("fork", None, prompt_ids,
                       SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6,
                                      ignore_eos=True))
    # Decode steps run until the next prefill attempt point; the prompt step then
    # prefills the prompt once and forks it.
    for _ in range(64):
        engine.step()
        seqs = engine.scheduler.get_sequences("fork")
        if seqs[0].output_token_ids:
            break
    assert len(seqs) == 3
    tables = [list(s.blocks) for s in seqs]
    full = len(prompt_ids) // 8
    assert full >= 2
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    done = []
    while engine.has_unfinished():
        done += engine.step()
    outs = done[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert all(len(o.token_ids) == 6 for o in outs)
    assert engine.scheduler.cache_usage() == 0


def test_text_decoded_at_the_end_equals_the_incremental_text(llm):
    """Samples without stop strings are decoded once when they finish; a stop string
    that never matches switches on the incremental detokenizer: same text, same tokens."""
    prompts = [PROMPT, *OTHER]
    lazy = _gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    eager = _gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                              stop=["\x00never\x00"]))
    for a, b in zip(lazy, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].text


def test_seeded_sampling_follows_the_distribution():
    """The counter-based seeded draws are uniform: over many seeds, a seeded row's tokens
    follow softmax(logits / T) like unseeded rows do."""
    import torch

    from deepinfer.sampling.sampler import Sampler, SamplingTensors

    logits = torch.tensor([0.0, 1.0, 2.0, 0.5]).expand(4000, -1).clone()
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4000)]
    st = SamplingTensors.from_params(params, 4, "cpu", steps=[3] * 4000)
    tokens, _ = Sampler().sample(logits, st)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03), freq


def test_engine_seed_makes_unseeded_requests_reproducible(tiny_checkpoints):
    """LLM(seed=...): requests without a seed draw from the engine's own stream, so the
    same calls give the same tokens, whatever the program draws from torch in between."""
    import torch

    runs = []

    def run(seed):
        llm = LLM(tiny_checkpoints["llama_tied"].path, dtype="float32", device="cpu",
                  kv_cache_memory=8 << 20, seed=seed)
        runs.append(seed)
        torch.manual_seed(1000 + len(runs))  # the global stream differs each run
        sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in _gen(llm, [PROMPT, OTHER[0]], sp)]

    first = run(11)
    assert run(11) == first
    assert run(12345) != first
    with pytest.raises(ValueError, match="seed"):
        LLM(tiny_checkpoints["llama_tied"].path, device="cpu", seed="11")
