"""IncrementalDetokenizer on SmolLM2's byte-level BPE and on a sentencepiece-style tokenizer."""

import pytest

from deepinfer.detokenizer import IncrementalDetokenizer

TEXT = "Héllo 😀 世界, 日本語のテキスト! ok 🇫🇷 👩‍👩‍👧 done\n∑ x² ≤ ∞ — ça va?"


def feed(det, ids):
    return [det.add(t) for t in ids]


def test_byte_level_multibyte_chars_are_never_split(smol_tok):
    ids = smol_tok.encode(TEXT)
    # The text really does split characters across tokens.
    assert any("\ufffd" in smol_tok.decode([t]) for t in ids)
    det = IncrementalDetokenizer(smol_tok, smol_tok.encode("Say:"))
    chunks = feed(det, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # a character's first bytes emitted nothing
    assert "".join(chunks) == det.text == TEXT
    assert det.text == smol_tok.decode(ids, skip_special_tokens=True)
    assert det.token_ids == ids and not det.stopped
    # Every prefix of the emitted text is a prefix of the true text, token by token.
    det = IncrementalDetokenizer(smol_tok, [])
    for i, t in enumerate(ids):
        det.add(t)
        assert TEXT.startswith(det.text)
        assert len(det.text) >= len(smol_tok.decode(ids[:i + 1]).rstrip("\ufffd")) - 1


def test_decodes_a_sliding_window_not_the_whole_sequence(smol_tok):
    class Counting:
        def __init__(self, tok):
            self.tok, self.longest = tok, 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return self.tok.decode(ids, **kw)

    ids = smol_tok.encode(TEXT * 6)
    counting = Counting(smol_tok)
    det = IncrementalDetokenizer(counting, smol_tok.encode("A long prompt " * 20))
    feed(det, ids)
    assert len(ids) > 200 and counting.longest <= 12
    assert det.text == TEXT * 6


def test_special_tokens_skipped_or_kept(smol_tok):
    ids = smol_tok.encode("Hi<|im_end|> there")
    assert smol_tok.convert_tokens_to_ids("<|im_end|>") in ids
    det = IncrementalDetokenizer(smol_tok, [], skip_special_tokens=True)
    feed(det, ids)
    assert det.text == "Hi there"
    det = IncrementalDetokenizer(smol_tok, [], skip_special_tokens=False)
    feed(det, ids)
    assert det.text == "Hi<|im_end|> there"


def test_stop_string_across_tokens_is_detected_and_trimmed(smol_tok):
    text = "Hello world, this is the end of it."
    ids = smol_tok.encode(text)
    stop = "o wor"  # spans the tokens 'Hello' and ' world'
    assert not any(stop in smol_tok.decode([t]) for t in ids)
    det = IncrementalDetokenizer(smol_tok, [], stop=["unused", stop])
    chunks = feed(det, ids)
    assert det.stopped and det.stop_reason == stop
    assert det.text == "Hell"
    assert "".join(chunks) == "Hell"
    # Tokens after the stop change nothing.
    assert chunks[2:] == [""] * (len(ids) - 2)
    assert det.text == "Hell"


def test_earliest_stop_string_wins_and_multibyte_stop(smol_tok):
    ids = smol_tok.encode("abc 世界 xyz")
    det = IncrementalDetokenizer(smol_tok, [], stop=["xyz", "界"])
    feed(det, ids)
    assert det.stopped and det.stop_reason == "界" and det.text == "abc 世"
    # Both stop strings complete with the same token: the earlier position wins.
    ids = smol_tok.encode("one two three")
    det = IncrementalDetokenizer(smol_tok, [], stop=["hree", "two t"])
    feed(det, ids)
    assert det.text == "one "


def test_partial_stop_prefix_is_held_back_but_text_is_full(smol_tok):
    ids = smol_tok.encode("I said STO and then STOP here")
    det = IncrementalDetokenizer(smol_tok, [], stop=["STOP"])
    streamed = ""
    saw_held_back = False
    for t in ids:
        streamed += det.add(t)
        if det.stopped:
            break
        assert det.text.startswith(streamed)
        saw_held_back |= det.text.endswith("STO") and not streamed.endswith("STO")
    assert saw_held_back  # ".text" had "STO" while add() had not returned it yet
    assert det.stopped and det.text == streamed == "I said STO and then "


def test_no_stop_strings_means_never_stopped(smol_tok):
    det = IncrementalDetokenizer(smol_tok, [], stop=None)
    feed(det, smol_tok.encode("STOP stop </s>"))
    assert not det.stopped and det.text == "STOP stop </s>"


def test_sentencepiece_style_leading_space_and_byte_fallback(sp_tok):
    tok, vocab = sp_tok
    emoji = [vocab[f"<0x{b:02X}>"] for b in "😀".encode()]
    prompt = [1, vocab["▁Hello"]]
    out = [vocab["▁world"], vocab["▁"], *emoji, vocab["!"], vocab["▁st"], vocab["op"],
           vocab["▁done"], 2]
    det = IncrementalDetokenizer(tok, prompt)
    chunks = feed(det, out)
    # The window starts in the prompt, so ' world' keeps its space (decoding the output
    # alone would strip it), and the emoji's four byte tokens come out as one character.
    assert chunks[:2] == [" world", " "]
    assert chunks[2:6] == ["", "", "", "😀"]
    full = tok.decode(prompt + out, skip_special_tokens=True)
    head = tok.decode(prompt, skip_special_tokens=True)
    assert det.text == full[len(head):] == " world 😀! stop done"
    # Stop string across the '▁st' + 'op' pieces.
    det = IncrementalDetokenizer(tok, prompt, stop=["stop"])
    feed(det, out)
    assert det.stopped and det.text == " world 😀! "


MULTILINGUAL = [TEXT, "naïve café – ½ ¾ 🚀🚀 Здравствуй мир", "αβγ δ ε 中文 한국어 🤖!"]


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_decode_once_equals_the_incremental_text_at_every_length(smol_tok, text):
    """The engine decodes a sample without stop strings once, at its end: the text must
    be the incremental one, also when the output ends inside a multi-byte character."""
    from deepinfer.detokenizer import decode_once

    prompt = smol_tok.encode("Translate:")
    ids = smol_tok.encode(text)
    for skip in (True, False):
        det = IncrementalDetokenizer(smol_tok, prompt, skip_special_tokens=skip)
        for n, t in enumerate(ids, 1):
            det.add(t)
            assert decode_once(smol_tok, prompt, ids[:n], skip_special_tokens=skip) \
                == det.text, (n, ids[:n])


def test_decode_once_sentencepiece_leading_space_and_byte_fallback(sp_tok):
    from deepinfer.detokenizer import decode_once

    tok, vocab = sp_tok
    euro = [vocab[f"<0x{b:02X}>"] for b in "€".encode()]
    ids = [vocab["▁Hello"], vocab["▁world"], *euro, vocab["!"], vocab["▁done"]]
    prompt = [1, vocab["▁the"], vocab["▁end"]]
    det = IncrementalDetokenizer(tok, prompt)
    for n, t in enumerate(ids, 1):
        det.add(t)
        assert decode_once(tok, prompt, ids[:n]) == det.text, n
    assert det.text == " Hello world€! done"


# --- decode_once's trailing-incomplete-character search and the fast decode helper -----

FFFD = "\ufffd"


def kept_length(tok, prompt, ids, skip):
    """How many output tokens decode_once must keep: the longest prefix whose decode
    (after 5 prompt tokens of context) does not end in U+FFFD, found by the definition,
    one tokenizer.decode per dropped token; 0 if none."""
    ctx = list(prompt[-5:])
    for n in range(len(ids), 0, -1):
        if not tok.decode(ctx + list(ids[:n]), skip_special_tokens=skip,
                          clean_up_tokenization_spaces=False).endswith(FFFD):
            return n
    return 0


def reference_decode_once(tok, prompt, ids, skip):
    n = kept_length(tok, prompt, ids, skip)
    if n == 0:
        return ""
    ctx = list(prompt[-5:])

    def dec(x):
        return tok.decode(x, skip_special_tokens=skip, clean_up_tokenization_spaces=False) \
            if x else ""

    return dec(ctx + list(ids[:n]))[len(dec(ctx)):]


def incomplete_tail_cases(name, request):
    """(tokenizer, prompt, outputs): outputs that end in runs of tokens holding an
    incomplete UTF-8 sequence, around the 32-candidate batch boundaries."""
    if name == "sp":
        tok, vocab = request.getfixturevalue("sp_tok")

        def byte_ids(s):
            return [vocab[f"<0x{b:02X}>"] for b in s.encode()]

        head = [vocab["▁Hello"], vocab["▁world"]]
        prompt = [1, vocab["▁the"], vocab["▁end"]]
        eos = 2
    else:
        tok = request.getfixturevalue("smol_tok" if name == "smol" else "bpe_tok")

        def byte_ids(s):
            return tok.encode(s)

        head = tok.encode("Hello world ")
        prompt = tok.encode("Say something: ")
        eos = tok.eos_token_id
    euro, emoji = byte_ids("€"), byte_ids("😀")
    # A token that decodes to a lone continuation byte ("€" is E2 82 AC).
    cont = next(t for t in euro[1:] if tok.decode([t]) == FFFD) if len(euro) > 1 \
        else next(t for t in emoji[1:] if tok.decode([t]) == FFFD)
    outs = [head + [cont] * k for k in (1, 31, 32, 33, 64, 65, 100)]
    outs += [
        [cont] * 100,                                   # nothing is ever complete
        head + emoji[:-1] + [cont] * 100,               # a split emoji, then the run
        head + euro + emoji[:-1] + [cont] * 40,         # the last whole char is kept
        head + euro[:1] + [eos] + [cont] * 40,          # special token after a lead byte
        head + emoji + [eos] + emoji[:-1],              # ... and before a split char
        head + euro[:-1] + [cont] * 20 + euro + [cont] * 45,
    ]
    return tok, prompt, outs


class CountingBackend:
    """Stands in for the Rust tokenizer, counting Python-level decode calls."""

    def __init__(self, backend):
        self.backend, self.decodes, self.batches, self.batched = backend, 0, 0, 0

    def decode(self, ids, **kw):
        self.decodes += 1
        return self.backend.decode(ids, **kw)

    def decode_batch(self, seqs, **kw):
        self.batches += 1
        self.batched += len(seqs)
        return self.backend.decode_batch(seqs, **kw)


class DecodeOnly:
    """Exposes only ``decode``, so the detokenizer takes its generic path."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def decode(self, ids, **kw):
        self.calls += 1
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("name", ["bpe", "smol", "sp"])
def test_decode_once_drops_long_incomplete_tails_in_batches(name, request, monkeypatch):
    """The backend path: same text as the incremental path and as one-decode-per-token,
    with two decodes plus a few batched calls instead of one decode per dropped token."""
    from deepinfer import detokenizer
    from deepinfer.detokenizer import _backend_tokenizer, decode_once

    tok, prompt, outs = incomplete_tail_cases(name, request)
    assert _backend_tokenizer(tok) is tok.backend_tokenizer
    saw_long_tail = False
    for out in outs:
        for skip in (True, False):
            expected = reference_decode_once(tok, prompt, out, skip)
            det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            feed(det, out)
            assert det.text == expected, (out, skip)
            counting = CountingBackend(tok.backend_tokenizer)
            with monkeypatch.context() as m:
                m.setattr(detokenizer, "_backend_tokenizer", lambda _tok, c=counting: c)
                assert decode_once(tok, prompt, out, skip_special_tokens=skip) == expected, \
                    (out, skip)
            assert counting.decodes == 2  # the context and the whole output
            kept = kept_length(tok, prompt, out, skip)
            # Candidates are tried longest first, 32 per call, none past the answer.
            tried = len(out) - max(kept, 1)
            assert counting.batches == -(-tried // 32), (out, skip)
            assert tried <= counting.batched < tried + 32
            saw_long_tail |= tried >= 100
    assert saw_long_tail


@pytest.mark.parametrize("name", ["bpe", "smol", "sp"])
def test_decode_once_drops_long_incomplete_tails_generic_path(name, request):
    """Without a Rust tokenizer to batch on: one decode per dropped token, same text."""
    from deepinfer.detokenizer import _backend_tokenizer, decode_once

    tok, prompt, outs = incomplete_tail_cases(name, request)
    assert _backend_tokenizer(DecodeOnly(tok)) is None
    for out in outs:
        for skip in (True, False):
            expected = reference_decode_once(tok, prompt, out, skip)
            det = IncrementalDetokenizer(DecodeOnly(tok), prompt, skip_special_tokens=skip)
            feed(det, out)
            wrapped = DecodeOnly(tok)
            assert decode_once(wrapped, prompt, out, skip_special_tokens=skip) \
                == det.text == expected, (out, skip)
            kept = kept_length(tok, prompt, out, skip)
            # The context, then each length from the whole output down to the answer.
            assert wrapped.calls == 1 + len(out) - max(kept, 1) + 1


def random_ids(tok, rng, n):
    specials = list(tok.all_special_ids)
    return [rng.choice(specials) if rng.random() < 0.15 else rng.randrange(len(tok))
            for _ in range(n)]


@pytest.mark.parametrize("name", ["bpe", "smol", "sp"])
def test_fast_decoder_matches_tokenizer_decode(name, request, monkeypatch):
    """The helper calls the Rust tokenizer directly, never ``tokenizer.decode``, and gives
    its exact text (special tokens skipped or kept, no clean-up)."""
    import random

    from deepinfer.detokenizer import _backend_tokenizer, _decoder

    tok = request.getfixturevalue({"bpe": "bpe_tok", "smol": "smol_tok", "sp": "sp_tok"}[name])
    if name == "sp":
        tok = tok[0]
    assert _backend_tokenizer(tok) is tok.backend_tokenizer
    rng = random.Random(0)
    cases = [[]] + [random_ids(tok, rng, rng.randrange(1, 80)) for _ in range(300)]
    assert any(set(ids) & set(tok.all_special_ids) for ids in cases)
    expected = {skip: [tok.decode(ids, skip_special_tokens=skip,
                                  clean_up_tokenization_spaces=False) for ids in cases]
                for skip in (True, False)}
    assert expected[True] != expected[False]

    def no_wrapper(*args, **kwargs):
        raise AssertionError("tokenizer.decode called")

    monkeypatch.setattr(tok, "decode", no_wrapper)
    for skip in (True, False):
        decode = _decoder(tok, skip, _backend_tokenizer(tok))
        assert [decode(ids) for ids in cases] == expected[skip]
        # The incremental detokenizer decodes through it too.
        det = IncrementalDetokenizer(tok, cases[1], skip_special_tokens=skip)
        feed(det, cases[2])


def test_decoder_respects_overridden_decode(bpe_tok):
    """A tokenizer class with its own decoding is not bypassed; neither is a test double."""
    from transformers import PreTrainedTokenizerFast

    from deepinfer.detokenizer import _backend_tokenizer, _decoder, decode_once

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    tok = Shouting(tokenizer_object=bpe_tok.backend_tokenizer, unk_token="<unk>",
                   bos_token="<s>", eos_token="</s>")
    ids = bpe_tok.encode("Hello world, the end")
    assert _backend_tokenizer(tok) is None
    assert _decoder(tok, True, _backend_tokenizer(tok))(ids) == "HELLO WORLD, THE END"
    assert decode_once(tok, [], ids) == "HELLO WORLD, THE END"
    det = IncrementalDetokenizer(tok, [])
    feed(det, ids)
    assert det.text == "HELLO WORLD, THE END"
    wrapped = DecodeOnly(bpe_tok)
    decode = _decoder(wrapped, True, _backend_tokenizer(wrapped))
    assert decode(ids) == "Hello world, the end" and wrapped.calls == 1
