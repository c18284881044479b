"""llama.cpp as a peer baseline: greedy decode speed of a GGUF model through llama-cpp-python.

Run it with the Python of a separate venv that has ``llama-cpp-python`` (built from source on
the machine that measures); it imports neither deepinfer nor torch, so it can sit in the same
benchmark run as the engine without sharing its environment::

    /work/venvs/llamacpp/bin/python benchmarks/peer_llamacpp.py --model M.gguf \\
        --max-tokens 128 --threads 2 --reps 3

What is measured, per repetition (after one untimed warm-up of the same work):

- prompt-eval seconds: the prompt decoded in chunks of ``--n-batch`` tokens, plus the greedy
  draw of the first generated token from its last logits (time to first token);
- decode seconds: the remaining ``max_tokens - 1`` steps, each one ``llama_decode`` of one
  token and one greedy draw (llama.cpp's own C greedy sampler: an argmax, no Python over the
  vocabulary). ``decode_tok_s`` = (max_tokens - 1) / decode seconds;
- end-to-end: max_tokens / (prompt-eval + decode seconds).

The loop calls llama.cpp's C API directly (``llama_decode``, ``llama_sampler_sample``) rather
than ``Llama.create_completion``, so EOS never stops it (exactly ``max_tokens`` tokens each
rep: same work as the engine's ``ignore_eos`` runs) and llama-cpp-python's Python-side
per-token work (detokenizing, stop strings, logits copies) stays out of the numbers. The KV
cache is cleared before each rep. llama.cpp's own perf counters (``llama_perf_context``) are
reported beside the wall-clock times.

Settings and why:

- ``--threads`` defaults to ``os.cpu_count()``; ``n_threads_batch`` is the same.
- ``--n-batch`` (prompt tokens per ``llama_decode``; ``n_ubatch`` follows it) defaults to 512,
  llama.cpp's own default. An earlier measurement on this machine's CPU (AMD EPYC, AVX-512
  with VNNI/BF16, no AMX) reported a ``GGML_NATIVE=ON`` build crashing with SIGSEGV when it
  decoded a prompt in batches > 1, with ``n_batch=1`` running. It did not reproduce with
  llama-cpp-python 0.3.36 built with ``-DGGML_NATIVE=ON`` (n_batch 2..512, prompts of 38 and
  830 tokens, flash attention on and off, 1 and 2 threads, this loop and the high-level
  ``Llama`` API). Should a build crash, ``--n-batch 1`` is the fallback: it slows only the
  prompt, not the per-token decode this compares.
- The machine's load average is reported: llama.cpp's threads wait for each other at every
  op, so a core taken by other work slows ``--threads`` = all cores far more than it slows one
  thread. Compare runs made on a quiet machine.
- The prompt: ``--prompt TEXT`` is one user message rendered with the GGUF's own chat template
  (``tokenizer.chat_template``) with the generation prompt, as deepinfer's
  ``apply_chat_template`` does; ``--raw`` tokenizes the text as is; ``--prompt-tokens`` takes
  comma-separated token ids verbatim.
- ``--flash-attn`` is off by default (llama-cpp-python's default).

Output: one JSON line on stdout (medians over the reps, and each rep's rates). llama.cpp
cannot tell how it was built: set ``LLAMA_CPP_BUILD_FLAGS`` to the ``CMAKE_ARGS`` used and the
line records them beside ``llama_print_system_info()``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import llama_cpp
from llama_cpp import Llama

DEFAULT_PROMPT = "Write a short story about a robot."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="path of a .gguf file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=DEFAULT_PROMPT,
                     help="user message, rendered with the model's chat template")
    src.add_argument("--prompt-tokens", default=None,
                     help="comma-separated prompt token ids, used verbatim")
    p.add_argument("--raw", action="store_true",
                   help="tokenize --prompt as is (BOS added), without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--n-batch", type=int, default=512,
                   help="prompt tokens per llama_decode (1: the fallback for a crashing build)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-ctx", type=int, default=0,
                   help="context size (0: prompt + max_tokens, rounded up to 256)")
    p.add_argument("--flash-attn", action="store_true")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (the first token is timed with the prompt)")
    if args.reps < 1 or args.n_batch < 1 or args.threads < 1:
        p.error("--reps, --n-batch and --threads must be positive")
    return args


def chat_prompt(llm: Llama, message: str) -> str:
    """``message`` as one user turn in the GGUF's chat template, generation prompt added."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise SystemExit("the model has no tokenizer.chat_template: pass --raw")

    def piece(token: int) -> str:
        return llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    fmt = Jinja2ChatFormatter(template=template, eos_token=piece(llm.token_eos()),
                              bos_token=piece(llm.token_bos()))
    return fmt(messages=[{"role": "user", "content": message}]).prompt


def prompt_ids(llm: Llama, args: argparse.Namespace) -> list[int]:
    if args.prompt_tokens:
        return [int(t) for t in args.prompt_tokens.split(",") if t.strip()]
    if args.raw:
        return llm.tokenize(args.prompt.encode(), add_bos=True, special=False)
    # The template writes any BOS itself: no extra one, special tokens parsed as such.
    return llm.tokenize(chat_prompt(llm, args.prompt).encode(), add_bos=False, special=True)


def decode(ctx, tokens: list[int]) -> None:
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens)))
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")


def generate(llm: Llama, sampler, ids: list[int], n_batch: int,
             max_tokens: int) -> tuple[float, float, list[int]]:
    """One greedy generation of exactly ``max_tokens`` tokens from an empty KV cache:
    (prompt-eval seconds incl. the first token's draw, decode seconds, tokens)."""
    ctx = llm.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    llama_cpp.llama_sampler_reset(sampler)
    t0 = time.perf_counter()
    for i in range(0, len(ids), n_batch):
        decode(ctx, ids[i:i + n_batch])
    tok = llama_cpp.llama_sampler_sample(sampler, ctx, -1)
    t1 = time.perf_counter()
    out = [tok]
    one = (llama_cpp.llama_token * 1)()
    for _ in range(max_tokens - 1):
        one[0] = tok
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        tok = llama_cpp.llama_sampler_sample(sampler, ctx, -1)
        out.append(tok)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    # The tokenizer is needed before n_ctx is known: a vocab-only load is cheap.
    vocab = Llama(model_path=args.model, vocab_only=True, verbose=False)
    ids = prompt_ids(vocab, args)
    del vocab
    n_ctx = args.n_ctx or -(-(len(ids) + args.max_tokens) // 256) * 256
    t_vocab = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=n_ctx, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=args.n_batch, n_ubatch=args.n_batch,
                flash_attn=args.flash_attn, n_gpu_layers=0, verbose=False)
    load_s = time.perf_counter() - t0

    sampler = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_greedy())
    try:
        generate(llm, sampler, ids, args.n_batch, args.max_tokens)  # warm-up
        llama_cpp.llama_perf_context_reset(llm.ctx)
        runs = [generate(llm, sampler, ids, args.n_batch, args.max_tokens)
                for _ in range(args.reps)]
        perf = llama_cpp.llama_perf_context(llm.ctx)
    finally:
        llama_cpp.llama_sampler_free(sampler)

    prompt_s = [r[0] for r in runs]
    decode_s = [r[1] for r in runs]
    n_dec = args.max_tokens - 1
    dec_tps = [n_dec / s for s in decode_s]
    e2e_tps = [args.max_tokens / (p + d) for p, d, _ in runs]
    texts = {bytes(llm.detokenize(r[2])) for r in runs}
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    result = {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "model": os.path.basename(args.model),
        "python": platform.python_version(),
        "settings": {
            "n_threads": args.threads, "n_threads_batch": args.threads,
            "n_batch": args.n_batch, "n_ubatch": args.n_batch, "n_ctx": n_ctx,
            "flash_attn": args.flash_attn, "sampler": "greedy (llama_sampler_init_greedy)",
            "ignore_eos": True, "reps": args.reps, "warmup": 1,
            # How the library was built (CMAKE_ARGS), if the caller says: llama.cpp can't tell.
            "build_flags": os.environ.get("LLAMA_CPP_BUILD_FLAGS", ""),
            "system_info": system_info,
        },
        "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "vocab_load_s": round(t_vocab, 4),
        "load_s": round(load_s, 4),
        "prompt_tokens": len(ids),
        "max_tokens": args.max_tokens,
        "prompt_eval_s": round(statistics.median(prompt_s), 5),
        "prompt_tok_s": round(len(ids) / statistics.median(prompt_s), 2),
        "decode_tokens": n_dec,
        "decode_s": round(statistics.median(decode_s), 5),
        "decode_tok_s": round(statistics.median(dec_tps), 2),
        "decode_tok_s_all": [round(x, 2) for x in dec_tps],
        "e2e_tok_s": round(statistics.median(e2e_tps), 2),
        "e2e_tok_s_all": [round(x, 2) for x in e2e_tps],
        # llama.cpp's own counters over the timed reps (its p_eval: batches of > 1 token).
        "llama_perf": {"t_p_eval_ms": round(perf.t_p_eval_ms, 2),
                       "n_p_eval": perf.n_p_eval, "t_eval_ms": round(perf.t_eval_ms, 2),
                       "n_eval": perf.n_eval},
        "same_output_every_rep": len(texts) == 1,
        "output_head": next(iter(texts)).decode("utf-8", errors="replace")[:80],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
