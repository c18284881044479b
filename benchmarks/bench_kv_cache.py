"""The int8 KV cache (``kv_cache_dtype="int8"``) against the model-dtype one, on the CPU:

- the C decode attention kernel alone, bf16 cache vs int8 cache (SmolLM2's shapes: 9
  query heads over 3 KV heads, 64 wide), batches x context lengths, calls interleaved in
  one process (best of several rounds): ms and the ratio;
- end to end on the default model: a long-context batch (prompts and outputs of
  ``--min-len``..``--max-len`` tokens) at the same ``kv_cache_memory``, generated tok/s,
  the KV blocks each cache holds, and the prefill/decode split;
- the default model's mean NLL over passages of the project's docs with each cache.

::

    python benchmarks/bench_kv_cache.py --save   # benchmarks/results/kv-cache-cpu.{json,md}

The ``test_`` function at the bottom is a smoke check (never timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from results_meta import git_commit, table_lines, utc_now
from throughput_workload import run_workload

HERE = Path(__file__).resolve().parent
HQ, HKV, D, BS = 9, 3, 64, 16


def attention_inputs(batch: int, length: int, seed: int = 0) -> dict:
    """q ``[B, 9, 64]`` bf16 and both caches (bf16, int8) over the same random values."""
    from deepinfer_kernels.kv_quant import quantize_kv

    g = torch.Generator().manual_seed(seed)
    per_seq = -(-length // BS)
    nb = batch * per_seq + 1
    k, v = (torch.randn((nb, BS, HKV, D), generator=g) for _ in range(2))
    tables = torch.randperm(nb, generator=g)[:batch * per_seq].view(batch, per_seq).int()
    return {"q": torch.randn((batch, HQ, D), generator=g).bfloat16(), "tables": tables,
            "lens": torch.full((batch,), length, dtype=torch.int32),
            "bf16": (k.bfloat16(), v.bfloat16()), "int8": (quantize_kv(k), quantize_kv(v))}


def time_attention(batch: int, length: int, rounds: int = 5, budget_s: float = 0.2) -> dict:
    """Best ms per call of the C decode kernel on each cache, calls interleaved."""
    from deepinfer_kernels import cpu_backend

    x = attention_inputs(batch, length)
    best = {"bf16": float("inf"), "int8": float("inf")}
    for _ in range(rounds):
        for name in best:
            k, v = x[name]
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < budget_s:
                cpu_backend.paged_decode_attention(x["q"], k, v, x["tables"], x["lens"])
                n += 1
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e3)
    return best


def end_to_end(requests: int, min_len: int, max_len: int, memory: int) -> dict:
    """Generated tok/s of each cache on the same long-context workload and memory."""
    from deepinfer import LLM, SamplingParams

    out = {}
    for kv in ("auto", "int8"):
        llm = LLM(kv_cache_dtype=kv, kv_cache_memory=memory)
        wl = run_workload(requests, min_len, max_len, llm.engine.runner.cfg.vocab_size, 0)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in wl.max_tokens]
        stats = llm.engine.stats
        p0, d0, t0 = stats.prompt_time, stats.decode_time, time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        out[kv] = {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
                   "blocks": llm.engine.runner.num_blocks, "prefill_s": stats.prompt_time - p0,
                   "decode_s": stats.decode_time - d0}
        llm.close()
    return out


def doc_nll(tokens: int = 1024, dtype: str = "bfloat16") -> dict:
    """Mean NLL a token over passages of README.md and docs/*.md, with each cache."""
    from deepinfer import LLM, SamplingParams

    root = HERE.parent
    text = "\n".join(p.read_text() for p in [root / "README.md",
                                             *sorted((root / "docs").glob("*.md"))])
    passages = [text[i:i + 6000] for i in range(0, min(len(text), 60000), 6000)]
    out = {}
    for kv in ("auto", "int8"):
        llm = LLM(dtype=dtype, kv_cache_dtype=kv)
        ids = [llm.tokenizer.encode(p)[:tokens] for p in passages]
        outs = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=0),
                            use_tqdm=False)
        lps = [float(getattr(e, "logprob", e)) for o, p in zip(outs, ids)
               for e in (o.prompt_logprobs[i][p[i]] for i in range(1, len(p)))]
        out[kv] = {"nll": -sum(lps) / len(lps), "tokens": len(lps)}
        llm.close()
    return out


def write_results(result: dict) -> None:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "kv-cache-cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    e2e, nll = result["end_to_end"], result["nll"]
    lines = [f"# int8 KV cache vs bf16: {result['machine']}", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}; "
             "`python benchmarks/bench_kv_cache.py --save`.", "",
             "## Decode attention (C kernel, 9 query heads over 3 KV heads, 64 wide, "
             "best ms of interleaved rounds)", ""]
    lines += table_lines(["batch x context", "bf16 ms", "int8 ms", "bf16 / int8"],
                         [{"batch x context": k, "bf16 ms": f"{v['bf16']:.3f}",
                           "int8 ms": f"{v['int8']:.3f}",
                           "bf16 / int8": f"{v['bf16'] / v['int8']:.2f}x"}
                          for k, v in result["attention"].items()])
    w = result["workload"]
    lines += ["", f"## End to end: default model, {w['requests']} requests of "
              f"{w['min_len']}-{w['max_len']} tokens in and out, kv_cache_memory "
              f"{w['memory'] >> 20} MiB", ""]
    lines += table_lines(["kv_cache_dtype", "tok/s", "KV blocks", "prefill / decode s"],
                         [{"kv_cache_dtype": k, "tok/s": f"{v['tok_s']:.1f}",
                           "KV blocks": v["blocks"],
                           "prefill / decode s": f"{v['prefill_s']:.1f} / {v['decode_s']:.1f}"}
                          for k, v in e2e.items()])
    lines += ["", f"int8 / auto: {e2e['int8']['tok_s'] / e2e['auto']['tok_s']:.2f}x", "",
              f"## Mean NLL over the project's docs ({nll['auto']['tokens']} tokens, bf16)",
              "", f"auto {nll['auto']['nll']:.4f}, int8 {nll['int8']['nll']:.4f}", ""]
    (out / "kv-cache-cpu.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="4x256,64x128,64x512,16x2048",
                    help="decode attention cases, batch x context")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=700)
    ap.add_argument("--memory", type=int, default=1 << 30, help="kv_cache_memory bytes")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    attention = {}
    for case in args.cases.split(","):
        b, length = (int(v) for v in case.split("x"))
        attention[case] = time_attention(b, length)
        print(case, attention[case], flush=True)
    e2e = end_to_end(args.requests, args.min_len, args.max_len, args.memory)
    print(e2e, flush=True)
    nll = doc_nll()
    print(nll, flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                         "cores", "commit": git_commit(), "date": utc_now(),
              "torch": torch.__version__, "attention": attention, "end_to_end": e2e,
              "nll": nll, "workload": {"requests": args.requests, "min_len": args.min_len,
                                       "max_len": args.max_len, "memory": args.memory}}
    if args.save:
        write_results(result)


def test_bench_kv_cache_smoke():
    """One small case: both caches give the same attention within int8 rounding."""
    from deepinfer_kernels import cpu_backend

    x = attention_inputs(3, 40, seed=2)
    outs = {name: cpu_backend.paged_decode_attention(x["q"], *x[name], x["tables"],
                                                     x["lens"]).float()
            for name in ("bf16", "int8")}
    torch.testing.assert_close(outs["int8"], outs["bf16"], atol=3e-2, rtol=3e-2)
    assert set(time_attention(2, 20, rounds=1, budget_s=0.01)) == {"bf16", "int8"}


if __name__ == "__main__":
    main()
