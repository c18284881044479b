"""Tokenizers: the default GGUF's (via transformers) and a local HF folder's."""

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
