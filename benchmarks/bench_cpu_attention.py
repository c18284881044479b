"""CPU paged decode attention: kernels.reference vs kernels.cpu_backend's two paths vs a
dense floor.

Per case, in the same process and interleaved round by round (the machine may be shared,
so compare the ratios, not the absolute times):

- reference: ``kernels.reference.paged_decode_attention`` (the test oracle);
- native: ``kernels.cpu_backend.paged_decode_attention``, the engine's CPU op, which runs
  the C kernel of ``kernels.cpu_native`` (reads K/V straight from the paged cache);
- gathered: ``kernels.cpu_backend.gathered_decode_attention``, its torch fallback (blocks
  gathered into a workspace, then SDPA);
- dense: ``scaled_dot_product_attention`` over a contiguous ``[B, Hkv, ctx, D]`` cache, the
  query heads of a KV head as the query axis: the floor, what a model that kept a dense
  cache would pay.

The paged caches hold the same K/V in shuffled blocks (a block table after churn). Cases:
SmolLM2-135M attention (Hq 9, Hkv 3, D 64) at B=64 and ctx 256/1024, and the tiny model of
benchmarks/bench_host.py (Hq 4, Hkv 2, D 16) at B=256/1024 and ctx 300, Gemma-3-1B's and
Gemma-2-2B's (D 256) at B=16 and ctx 1024, all sequences at ctx (the dense floor's case);
``ragged`` rows draw lengths in [ctx/2, ctx] for the paged ops while the floor stays at
ctx. Block size 16; fp32, or ``--dtype bfloat16`` (the engine's cache for a bf16 model:
queries, caches and the dense floor all bf16).

    python benchmarks/bench_cpu_attention.py                  # prints the table
    python benchmarks/bench_cpu_attention.py --threads 1 --reps 9
    python benchmarks/bench_cpu_attention.py --save           # results/cpu-attention-cpu.*
    python benchmarks/bench_cpu_attention.py --save --dtype bfloat16 --tag avx2-bf16
                                                  # results/cpu-attention-cpu-avx2-bf16.*

The ``test_`` function at the bottom runs one tiny case so the suite exercises this file
(a correctness check, never timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from results_meta import git_commit, utc_now, vector_isa  # noqa: E402

from deepinfer_kernels import cpu_backend, cpu_native, reference  # noqa: E402

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    ctx: int
    hq: int
    hkv: int
    d: int
    ragged: bool = False


CASES = [
    Case("SmolLM2", 64, 256, 9, 3, 64),
    Case("SmolLM2", 64, 1024, 9, 3, 64),
    Case("SmolLM2 ragged", 64, 1024, 9, 3, 64, ragged=True),
    Case("tiny", 256, 300, 4, 2, 16),
    Case("tiny", 1024, 300, 4, 2, 16),
    Case("tiny ragged", 1024, 300, 4, 2, 16, ragged=True),
    # Gemma's head dim 256 (the wide kernel's since 2026-12-07): Gemma-3-1B, Gemma-2-2B
    Case("Gemma-3-1B", 16, 1024, 4, 1, 256),
    Case("Gemma-2-2B", 16, 1024, 8, 4, 256),
]


@dataclass
class Inputs:
    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    k_dense: torch.Tensor  # [B, Hkv, ctx, D]
    v_dense: torch.Tensor


def make_inputs(case: Case, seed: int = 0, dtype: torch.dtype = torch.float32) -> Inputs:
    """Dense K/V of ``case`` and the same tokens scattered over shuffled cache blocks, all
    (the query too) in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    b, ctx, hkv, d = case.batch, case.ctx, case.hkv, case.d
    width = -(-ctx // BLOCK_SIZE)
    k_dense = torch.randn((b, hkv, ctx, d), generator=g)
    v_dense = torch.randn((b, hkv, ctx, d), generator=g)
    num_blocks = b * width + 1
    tables = torch.randperm(num_blocks, generator=g)[: b * width].view(b, width)

    def paged(dense: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros((num_blocks, BLOCK_SIZE, hkv, d))
        tokens = torch.zeros((b, width * BLOCK_SIZE, hkv, d))
        tokens[:, :ctx] = dense.transpose(1, 2)
        cache[tables.reshape(-1)] = tokens.view(b * width, BLOCK_SIZE, hkv, d)
        return cache

    if case.ragged:
        lens = torch.randint(ctx // 2, ctx + 1, (b,), generator=g)
    else:
        lens = torch.full((b,), ctx)
    return Inputs(torch.randn((b, case.hq, d), generator=g).to(dtype),
                  paged(k_dense).to(dtype), paged(v_dense).to(dtype), tables.int(),
                  lens.int(), k_dense.to(dtype), v_dense.to(dtype))


def ops(x: Inputs) -> dict[str, Callable[[], torch.Tensor]]:
    """The timed calls on one case's inputs, each returning ``[B, Hq, D]``."""
    b, hq, d = x.q.shape
    hkv = x.k_cache.shape[2]
    q_dense = x.q.view(b, hkv, hq // hkv, d)
    out = torch.empty_like(x.q)
    args = (x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens)
    return {
        "reference": lambda: reference.paged_decode_attention(*args, out=out),
        "native": lambda: cpu_backend.paged_decode_attention(*args, out=out),
        "gathered": lambda: cpu_backend.gathered_decode_attention(*args, out=out),
        "dense": lambda: F.scaled_dot_product_attention(
            q_dense, x.k_dense, x.v_dense).view(b, hq, d),
    }


def time_case(case: Case, reps: int, dtype: torch.dtype) -> dict[str, float]:
    """Median seconds per call of each op; ops interleaved within every round."""
    fns = ops(make_inputs(case, dtype=dtype))
    for fn in fns.values():  # warm-up: workspace allocation, first-touch of the caches
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def label(case: Case) -> str:
    return f"{case.name}, B={case.batch}, ctx={case.ctx}, {case.hq}/{case.hkv}x{case.d}"


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| case | dense ms | reference ms | gathered ms | native ms | reference / dense | "
             "gathered / dense | native / dense | gathered / native |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["ms"]
        lines.append(
            f"| {r['case']} | {t['dense']:.2f} | {t['reference']:.2f} | "
            f"{t['gathered']:.2f} | {t['native']:.2f} | "
            f"{t['reference'] / t['dense']:.2f}x | {t['gathered'] / t['dense']:.2f}x | "
            f"{t['native'] / t['dense']:.2f}x | {t['gathered'] / t['native']:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="timed rounds per case (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="query, cache and dense-floor dtype (default float32)")
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/cpu-attention-cpu[-TAG].{json,md}")
    ap.add_argument("--tag", default="",
                    help="suffix of the results files (e.g. the CPU class and dtype)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for case in CASES:
        ms = {k: v * 1e3 for k, v in time_case(case, args.reps, dtype).items()}
        rows.append({"case": label(case), "batch": case.batch, "ctx": case.ctx,
                     "ragged": case.ragged, "ms": ms})
        print(table_lines(rows)[-1], file=sys.stderr, flush=True)  # progress
    lines = table_lines(rows)
    native = "built" if cpu_native.native_library() is not None else "NOT BUILT (torch path)"
    note = ("\n\nragged rows: paged lengths drawn in [ctx/2, ctx], the dense floor at ctx. "
            f"Median of {args.reps} interleaved rounds, {torch.get_num_threads()} threads. "
            f"Native kernel: {native}.")
    print("\n" + "\n".join(lines) + note)
    if args.save:
        out = Path(__file__).resolve().parent / "results"
        out.mkdir(exist_ok=True)
        meta = {"commit": git_commit(), "date": utc_now(), "device": "cpu",
                "machine": platform.machine(), "processor": platform.processor(),
                "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "vector_isa": vector_isa()}
        data = {**meta, "block_size": BLOCK_SIZE, "dtype": args.dtype, "reps": args.reps,
                "rows": rows}
        stem = "cpu-attention-cpu" + (f"-{args.tag}" if args.tag else "")
        (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
        flags = (f" --dtype {args.dtype}" if args.dtype != "float32" else "") + (
            f" --tag {args.tag}" if args.tag else "")
        head = (f"# CPU paged decode attention ({meta['machine']}, {meta['vector_isa']}, "
                f"{meta['threads']} threads, {args.dtype})\n\ncommit {meta['commit']}, "
                f"{meta['date']}, torch {meta['torch']}, "
                f"`python benchmarks/bench_cpu_attention.py --save{flags}`\n\n")
        (out / f"{stem}.md").write_text(head + "\n".join(lines) + note + "\n")


def test_bench_cpu_attention_smoke():
    """One small case through every op: the paged ops agree with the dense floor."""
    case = Case("smoke", 3, 40, 4, 2, 16)
    results = {name: fn().clone() for name, fn in ops(make_inputs(case, seed=1)).items()}
    for name in ("reference", "native", "gathered"):
        torch.testing.assert_close(results[name], results["dense"], atol=2e-5, rtol=1e-5)
    assert len(table_lines([{"case": label(case), "ms": {k: 1.0 for k in results}}])) == 3


if __name__ == "__main__":
    main()
