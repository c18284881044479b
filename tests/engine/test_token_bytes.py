"""TokenBytes: the true bytes of each token, for OpenAI's logprob entries."""

import pytest

from deepinfer.token_bytes import TokenBytes

TEXT = "Héllo 😀 世界, 日本語! ok 🇫🇷 done\n∑ x² ≤ ∞ — ça va? <tag> end"


@pytest.mark.parametrize("name", ["smol_tok", "bpe_tok"])
def test_byte_level_pieces_concatenate_to_the_text(name, request):
    tok = request.getfixturevalue(name)
    tb = TokenBytes(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tb(i) for i in ids) == TEXT.encode("utf-8")
    # Some token is a piece of a multi-byte character: its text is U+FFFD, its bytes
    # are the piece's own (not the replacement character's).
    partial = [i for i in ids if tb.text(i) == "\ufffd"]
    assert partial, "the text should split a character over tokens"
    for i in partial:
        with pytest.raises(UnicodeDecodeError):
            tb(i).decode("utf-8")
    # A whole-word token reads as itself, leading space included.
    word = tok.encode(" done", add_special_tokens=False)
    assert b"".join(tb(i) for i in word) == b" done"


def test_sentencepiece_byte_fallback_and_spaces(sp_tok):
    tok, vocab = sp_tok
    tb = TokenBytes(tok)
    assert tb(vocab["▁Hello"]) == b" Hello" and tb.text(vocab["▁Hello"]) == " Hello"
    assert tb(vocab["!"]) == b"!"
    # "é" is not in the vocabulary: two byte-fallback pieces, each one byte.
    ids = tok.encode("▁Hello é", add_special_tokens=False)
    pieces = [tb(i) for i in ids]
    assert b"".join(pieces).endswith("é".encode())
    assert tb(vocab["<0xC3>"]) == b"\xc3" and tb.text(vocab["<0xC3>"]) == "\ufffd"


def test_special_tokens_are_their_text(smol_tok):
    tb = TokenBytes(smol_tok)
    eos = smol_tok.eos_token_id
    assert tb(eos) == smol_tok.eos_token.encode("utf-8")
    assert tb.text(eos) == smol_tok.eos_token


def test_a_tokenizer_without_a_fast_backend_decodes_the_id():
    class Plain:
        all_special_ids = []

        def convert_ids_to_tokens(self, i):
            return f"w{i}"

        def decode(self, ids, **kw):
            return "".join(f"<{i}>" for i in ids)

    tb = TokenBytes(Plain())
    assert tb(7) == b"<7>" and tb.text(3) == "<3>"
