"""Tokenizers: the default GGUF's (built from its metadata) and a local HF folder's."""

from __future__ import annotations

import pytest

from deepinfer.tokenizer import apply_chat_template, load_tokenizer


def test_gguf_round_trip(smollm2_tokenizer):
    text = "Hello, world! The quick brown fox jumps over 13 lazy dogs."
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5 and all(0 <= i < 49152 for i in ids)
    assert smollm2_tokenizer.decode(ids) == text


def test_gguf_tokenizer_is_cached(smollm2_path, smollm2_tokenizer):
    assert load_tokenizer(smollm2_path) is smollm2_tokenizer


def test_chat_template_smollm2(smollm2_tokenizer):
    ids = apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "Hi there"}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    text = smollm2_tokenizer.decode(ids)
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1  # SmolLM2 adds its default system prompt


def test_hf_folder_tokenizer_without_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hello world", add_special_tokens=False) == [1, 2]
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hello"}])


def test_missing_tokenizer_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        load_tokenizer(str(tmp_path / "nowhere.gguf"))


TEXTS = ["Hello world", " leading space", "Héllo 😀 世界, 日本語! ok 🇫🇷 👩‍👩‍👧\n∑ x² ≤ ∞",
         "<|im_start|>user\nhi<|im_end|>\n", "12345 6789 a1b2", "  two  spaces\t\ttabs\r\n",
         "def f(x):\n    return x**2  # comment", "<|endoftext|><file_sep>x"]


def test_gguf_tokenizer_built_from_metadata_equals_transformers(smollm2_path,
                                                                 smollm2_tokenizer):
    """The default model's tokenizer is built from the metadata the loader already read
    (one parse of the file); it must encode, decode and template exactly like the one
    transformers converts from the same file."""
    import os

    from transformers import AutoTokenizer

    from deepinfer.loading.gguf_reader import open_gguf
    from deepinfer.tokenizer import byte_level_tokenizer_from_gguf

    # The default model takes the fast path, not transformers' converter.
    meta = open_gguf(smollm2_path).metadata
    assert byte_level_tokenizer_from_gguf(meta) is not None
    ref = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path),
                                        gguf_file=os.path.basename(smollm2_path))
    for text in TEXTS:
        for special in (True, False):
            ids = smollm2_tokenizer.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) \
                    == ref.decode(ids, skip_special_tokens=skip), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert apply_chat_template(smollm2_tokenizer, msgs) == apply_chat_template(ref, msgs)
    # BOS/EOS are the file's; transformers' converter agrees from 5.2x on (5.17, the GPU
    # image's, took the BOS token for EOS too): compare the special ids only then.
    assert (smollm2_tokenizer.eos_token_id, smollm2_tokenizer.bos_token_id) == \
        (meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.bos_token_id"])
    if ref.eos_token_id == meta["tokenizer.ggml.eos_token_id"]:
        assert smollm2_tokenizer.all_special_ids == ref.all_special_ids
        assert smollm2_tokenizer.bos_token_id == ref.bos_token_id
    assert len(smollm2_tokenizer) == len(ref)


def test_gguf_metadata_of_another_kind_is_left_to_transformers():
    from deepinfer.tokenizer import byte_level_tokenizer_from_gguf

    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1]}
    assert byte_level_tokenizer_from_gguf(base).encode("ab", add_special_tokens=False) == [2]
    for change in ({"tokenizer.ggml.model": "llama"}, {"tokenizer.ggml.pre": "qwen2"},
                   {"tokenizer.ggml.add_bos_token": True}):
        assert byte_level_tokenizer_from_gguf({**base, **change}) is None, change


def _write_tokenizer_gguf(path, meta, tokens, types) -> None:
    """A GGUF holding only a byte-level tokenizer: ``meta``'s merges and BOS/EOS, the
    given tokens and token types."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_user_defined_tokens_stay_whole_as_in_transformers(smollm2_path, tmp_path):
    """llama.cpp's user-defined tokens (type 4, ``<think>``) are matched whole, as plain
    added tokens; a control token spelled outside the byte alphabet is a mislabel that
    transformers skips, and so do we. A file rewritten in place is read again."""
    from transformers import AutoTokenizer

    from deepinfer.loading.gguf_reader import open_gguf

    meta = open_gguf(smollm2_path).metadata
    tokens = list(meta["tokenizer.ggml.tokens"]) + ["<think>", "</think>", "<｜bad｜>"]
    types = list(meta["tokenizer.ggml.token_type"]) + [4, 4, 3]
    path = tmp_path / "t.gguf"
    _write_tokenizer_gguf(path, meta, tokens, types)
    ours = load_tokenizer(str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    think = len(tokens) - 3
    for text in ["Let me <think> about it</think> ok", "<think><think>", "a<｜bad｜>b",
                 "<|im_start|>user\n<think>x</think><|im_end|>"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text
    assert think in ours.encode("Let me <think> about it", add_special_tokens=False)
    assert think not in ours.all_special_ids  # not special: kept by skip_special_tokens

    _write_tokenizer_gguf(path, meta, tokens[:-3], types[:-3])  # the same path, rewritten
    assert think not in load_tokenizer(str(path)).encode("<think>", add_special_tokens=False)


def test_a_chat_template_that_refuses_messages_is_a_value_error():
    """Templates raise on messages they do not take (Mistral's "roles must alternate"):
    that request's ValueError, so one such line of a batch fails alone."""
    from deepinfer.testing.random_model import build_bpe_tokenizer
    from deepinfer.tokenizer import apply_chat_template

    tok = build_bpe_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('Conversation roles must alternate') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    assert apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="chat template refuses these messages: "
                                         "Conversation roles must alternate"):
        apply_chat_template(tok, [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "hi"}])
