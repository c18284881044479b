"""Attention logit soft-capping on the CPU (Gemma 2's ``attn_logit_softcapping``): the C
kernels (``kernels.cpu_backend``) with ``softcap=50`` against the same kernels without,
in the same process, interleaved round by round (compare the ratios, not the absolute
times, on a shared machine). The ratio is what the cap costs: one tanh a score.

Cases: Gemma-2-2B's head layout (Hq 8, Hkv 4, D 256), bf16 cache, block size 16::

    python benchmarks/bench_softcap.py             # prints the table
    python benchmarks/bench_softcap.py --save      # results/softcap-cpu.{json,md}

The ``test_`` function at the bottom checks one tiny case against the torch reference
(correctness only, never timing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_sliding_window import paged
from results_meta import git_commit, table_lines, utc_now

from deepinfer_kernels import cpu_backend, reference

HERE = Path(__file__).resolve().parent
HQ, HKV, D, CAP = 8, 4, 256, 50.0
#: (op, sequences, context or prompt tokens)
CASES = [("decode", 16, 4096), ("decode", 64, 1024), ("decode", 1, 8192),
         ("prefill", 1, 1024), ("prefill", 4, 512)]


def calls(op: str, batch: int, ctx: int, backend=cpu_backend, hq: int = HQ, hkv: int = HKV,
          d: int = D, dtype: torch.dtype = torch.bfloat16
          ) -> dict[str, Callable[[], torch.Tensor]]:
    """The op without and with the cap, on the same inputs (queries scaled so that the
    scores reach the cap)."""
    g = torch.Generator().manual_seed(1)
    k, v, tables, lens = paged([ctx] * batch, dtype, hkv=hkv, d=d)
    rows = batch if op == "decode" else batch * ctx
    q = (torch.randn((rows, hq, d), generator=g) * 4).to(dtype)
    if op == "decode":
        return {name: (lambda c=cap: backend.paged_decode_attention(q, k, v, tables, lens,
                                                                     softcap=c))
                for name, cap in (("plain", None), ("capped", CAP))}
    starts = torch.arange(batch + 1, dtype=torch.int32) * ctx
    return {name: (lambda c=cap: backend.paged_prefill_attention(q, k, v, tables, starts,
                                                                  lens, softcap=c))
            for name, cap in (("plain", None), ("capped", CAP))}


def time_case(op: str, batch: int, ctx: int, reps: int) -> dict:
    fns = calls(op, batch, ctx)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up (first-call costs)
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    plain, capped = (statistics.median(times[n]) * 1e3 for n in ("plain", "capped"))
    return {"op": op, "sequences": batch, "tokens": ctx, "uncapped ms": round(plain, 2),
            f"softcap {CAP:g} ms": round(capped, 2), "capped / uncapped":
            f"{capped / plain:.2f}x"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/softcap-cpu.{json,md}")
    args = ap.parse_args(argv)
    rows = []
    for case in CASES:
        rows.append(time_case(*case, reps=args.reps))
        print(rows[-1], flush=True)
    if not args.save:
        return
    meta = {"commit": git_commit(), "date": utc_now(), "torch": torch.__version__,
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "reps": args.reps, "rows": rows}
    out = HERE / "results" / "softcap-cpu"
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = [f"# Attention soft-capping, C kernels ({platform.machine()}, "
             f"{torch.get_num_threads()} threads)", "",
             f"commit `{meta['commit']}`, {meta['date']}, torch {torch.__version__}, "
             "`python benchmarks/bench_softcap.py --save`", "",
             *table_lines(list(rows[0]), rows), "",
             f"Hq {HQ}, Hkv {HKV}, D {D} (Gemma-2-2B), bf16 cache, block size 16; median "
             f"of {args.reps} interleaved rounds. The ratio is the cap's cost: a tanh per "
             "score beside the score's dot product of D values."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json/.md", file=sys.stderr)


def test_capped_calls_match_the_reference():
    """One tiny case of each op: the benchmark's calls, capped or not, give the torch
    reference's values, and the cap changes them."""
    for op in ("decode", "prefill"):
        ours = calls(op, 2, 40, hq=4, hkv=2, d=64, dtype=torch.float32)
        theirs = calls(op, 2, 40, backend=reference, hq=4, hkv=2, d=64,
                       dtype=torch.float32)
        for name in ours:
            torch.testing.assert_close(ours[name](), theirs[name](), atol=1e-4, rtol=0)
        assert (ours["plain"]() - ours["capped"]()).abs().max() > 1e-2


if __name__ == "__main__":
    main()
