"""Sliding-window attention on the CPU: the C kernels (``kernels.cpu_backend``) with a
window against the same kernels over the whole context, in the same process, interleaved
round by round (compare the ratios, not the absolute times, on a shared machine).

A window should cost about what its keys cost: decode reads ``window`` keys a sequence
instead of ``ctx``, a prefill of ``n`` tokens about ``n * window`` score rows instead of
``n^2 / 2``. The table gives the measured ratio beside that key-count ratio. Cases: a
Mistral-7B-like head layout (Hq 32, Hkv 8, D 128) with window 512 (Gemma-3-1B's), bf16
cache, block size 16::

    python benchmarks/bench_sliding_window.py             # prints the table
    python benchmarks/bench_sliding_window.py --save      # results/sliding-window-cpu.*

The ``test_`` function at the bottom checks one tiny case against the torch reference
(correctness only, never timing).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from results_meta import interleaved_medians_ms, save_cpu_table

from deepinfer_kernels import cpu_backend, reference

BLOCK, HQ, HKV, D = 16, 32, 8, 128
#: (name, op, sequences, context or prompt tokens, window)
CASES = [("decode", 16, 4096, 512), ("decode", 4, 8192, 512), ("decode", 64, 1024, 512),
         ("prefill", 1, 2048, 512), ("prefill", 1, 4096, 512)]


def paged(lens: list[int], dtype: torch.dtype, seed: int = 0, hkv: int = HKV, d: int = D):
    """K/V caches ``[NB, BLOCK, hkv, d]`` holding ``lens`` tokens in shuffled blocks, and
    the block tables ``[B, W]`` int32 and lengths ``[B]`` int32."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    total = sum(need)
    k = torch.randn((total, BLOCK, hkv, d), generator=g).to(dtype)
    v = torch.randn((total, BLOCK, hkv, d), generator=g).to(dtype)
    perm = torch.randperm(total, generator=g).int()
    tables = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    return k, v, tables, torch.tensor(lens, dtype=torch.int32)


def calls(op: str, batch: int, ctx: int, window: int, backend=cpu_backend,
          dtype: torch.dtype = torch.bfloat16) -> dict[str, Callable[[], torch.Tensor]]:
    """The op without and with the window, on the same inputs."""
    g = torch.Generator().manual_seed(1)
    k, v, tables, lens = paged([ctx] * batch, dtype)
    if op == "decode":
        q = torch.randn((batch, HQ, D), generator=g).to(dtype)
        return {w: (lambda w=win: backend.paged_decode_attention(q, k, v, tables, lens,
                                                                  window=w))
                for w, win in (("full", None), ("window", window))}
    q = torch.randn((batch * ctx, HQ, D), generator=g).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32) * ctx
    return {w: (lambda w=win: backend.paged_prefill_attention(q, k, v, tables, starts, lens,
                                                               window=w))
            for w, win in (("full", None), ("window", window))}


def key_ratio(op: str, ctx: int, window: int) -> float:
    """Keys the full op reads over those the windowed one reads."""
    if op == "decode":
        return ctx / min(ctx, window)
    full = ctx * (ctx + 1) / 2
    win = sum(min(p + 1, window) for p in range(ctx))
    return full / win


def time_case(op: str, batch: int, ctx: int, window: int, reps: int) -> dict:
    ms = interleaved_medians_ms(calls(op, batch, ctx, window), reps)
    full, win = ms["full"], ms["window"]
    return {"op": op, "sequences": batch, "tokens": ctx, "window": window,
            "full ms": round(full, 2), "window ms": round(win, 2),
            "speed-up": f"{full / win:.2f}x", "key ratio": f"{key_ratio(op, ctx, window):.2f}x"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/sliding-window-cpu.{json,md}")
    args = ap.parse_args(argv)
    rows = []
    for case in CASES:
        rows.append(time_case(*case, reps=args.reps))
        print(rows[-1], flush=True)
    if not args.save:
        return
    out = save_cpu_table(
        "sliding-window-cpu", "Sliding-window attention, C kernels",
        "python benchmarks/bench_sliding_window.py --save", rows,
        f"Hq {HQ}, Hkv {HKV}, D {D}, bf16 cache, block size {BLOCK}; median of "
        f"{args.reps} interleaved rounds. The key ratio is what the window saves in "
        "keys read (decode) or score rows (prefill): the speed-up to expect.", args.reps)
    print(f"wrote {out}.json/.md", file=sys.stderr)


def test_windowed_calls_match_the_reference():
    """One tiny case of each op: the benchmark's calls, windowed or not, give the torch
    reference's values."""
    for op in ("decode", "prefill"):
        ours = calls(op, 2, 40, 9, dtype=torch.float32)
        theirs = calls(op, 2, 40, 9, backend=reference, dtype=torch.float32)
        for name in ours:
            torch.testing.assert_close(ours[name](), theirs[name](), atol=1e-4, rtol=0)
    assert key_ratio("decode", 4096, 512) == 8.0
    assert key_ratio("prefill", 10, 10) == 1.0


if __name__ == "__main__":
    main()
