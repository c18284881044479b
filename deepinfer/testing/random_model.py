"""Random-weight Hugging Face checkpoints, made locally (nothing is downloaded).

For benchmarks at realistic sizes on machines that cannot fetch weights, and for tests:
``make_random_checkpoint`` writes config.json + safetensors + a real byte-level BPE
tokenizer (trained on a few sentences) that ``LLM(path)`` loads like any HF folder.

    python -m deepinfer.testing.random_model --preset qwen3-0.6b --out /tmp/qwen3-random
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

# Shapes of real models (weights random): what matters for speed is the shapes.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0),
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                     tie_word_embeddings=True, rope_theta=500000.0),
}

_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello engine",
    "paged attention stores keys and values in blocks", "a b c d e f g h i j k",
    "once upon a time there was a small model", "0123456789 + - * / = ( )",
]


def build_bpe_tokenizer(vocab_size: int = 290):
    """A real byte-level BPE tokenizer with at most ``vocab_size`` ids and a chat template.

    Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>`` (bos 1, eos 2).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(_CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return tok


def make_random_checkpoint(out_dir: str, preset: str, *, seed: int = 0,
                           dtype: torch.dtype = torch.bfloat16,
                           tokenizer: str | None = None,
                           num_layers: int | None = None) -> str:
    """Write a random-weight checkpoint of ``preset``'s shapes to ``out_dir``; returns it.

    ``tokenizer``: a folder or ``.gguf`` file whose tokenizer the checkpoint gets (its
    BOS/EOS ids go into the config): a real vocabulary where the tokenizer's cost matters
    (structured output's token masks). Default: a small BPE trained here (290 ids).
    ``num_layers``: fewer decoder layers than the preset (quick runs, tests)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from deepinfer.tokenizer import load_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: expected one of {sorted(PRESETS)}")
    spec = dict(PRESETS[preset])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: expected at least 1")
        spec["num_hidden_layers"] = num_layers
    tok = build_bpe_tokenizer() if tokenizer is None else load_tokenizer(tokenizer)
    if len(tok) > spec["vocab_size"]:
        raise ValueError(f"tokenizer={tokenizer!r}: {len(tok)} tokens do not fit preset "
                         f"{preset!r}'s vocabulary of {spec['vocab_size']}")
    bos = 1 if tok.bos_token_id is None else tok.bos_token_id
    eos = 2 if tok.eos_token_id is None else tok.eos_token_id
    arch = spec.pop("arch")
    cfg_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    cfg = cfg_cls(**spec, bos_token_id=bos, eos_token_id=eos)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="folder or .gguf file to take the tokenizer from (default: a small "
                        "BPE trained here)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the preset's)")
    args = p.parse_args(argv)
    print(make_random_checkpoint(args.out, args.preset, seed=args.seed,
                                 tokenizer=args.tokenizer, num_layers=args.layers))


if __name__ == "__main__":
    main()
