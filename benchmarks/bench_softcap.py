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
import sys
from collections.abc import Callable

import torch
from bench_sliding_window import paged
from results_meta import interleaved_medians_ms, save_cpu_table

from deepinfer_kernels import cpu_backend, reference

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
    ms = interleaved_medians_ms(calls(op, batch, ctx), reps)
    plain, capped = ms["plain"], ms["capped"]
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
    out = save_cpu_table(
        "softcap-cpu", "Attention soft-capping, C kernels",
        "python benchmarks/bench_softcap.py --save", rows,
        f"Hq {HQ}, Hkv {HKV}, D {D} (Gemma-2-2B), bf16 cache, block size 16; median of "
        f"{args.reps} interleaved rounds. The ratio is the cap's cost: a tanh per score "
        "beside the score's dot product of D values.", args.reps)
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
