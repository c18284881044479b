"""CPU paged prefill attention: the native C kernel (``deepinfer_kernels.cpu_prefill``,
what ``cpu_backend.paged_prefill_attention`` runs) against the torch path it replaced
(``cpu_backend.gathered_prefill_attention``: each sequence's K/V gathered out of the
cache, widened, then SDPA), on the same inputs, interleaved round by round in one process
(compare the ratios; the machine may be shared).

Cases: SmolLM2-135M's attention (9 query heads over 3 KV heads, 64 wide), bf16 cache
and queries, block size 16, shuffled blocks: B prompts of L new tokens with no cached
prefix, and the same with a cached prefix of P tokens (a chunked or prefix-cached
prefill).

    python benchmarks/bench_cpu_prefill.py                 # prints the table
    python benchmarks/bench_cpu_prefill.py --save          # results/cpu-prefill-cpu.*
    python benchmarks/bench_cpu_prefill.py --save --tag avx2   # cpu-prefill-cpu-avx2.*

The ``test_`` function at the bottom runs one tiny case so the suite exercises this file
(a correctness check, never timing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import pytest
import torch
from results_meta import git_commit, header_lines, table_lines, utc_now, vector_isa

from deepinfer_kernels import cpu_backend, cpu_prefill

HERE = Path(__file__).resolve().parent
CASES = [(4, 128, 0), (4, 512, 0), (2, 1024, 0), (4, 256, 256), (16, 64, 448)]  # B, L, P
HQ, HKV, D, BS = 9, 3, 64, 16


def make_inputs(batch: int, new: int, prefix: int, dtype=torch.bfloat16, seed: int = 0):
    """q ``[B*L, Hq, D]`` and a paged cache holding each sequence's P + L tokens in
    shuffled blocks; returns the op's positional arguments."""
    g = torch.Generator().manual_seed(seed)
    length = prefix + new
    per = -(-length // BS)
    k_cache = torch.randn(batch * per + 1, BS, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(batch * per + 1, BS, HKV, D, generator=g).to(dtype)
    tables = torch.randperm(batch * per, generator=g).view(batch, per).int()
    starts = torch.arange(batch + 1, dtype=torch.int32) * new
    lens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch * new, HQ, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, starts, lens


def time_case(batch: int, new: int, prefix: int, reps: int) -> dict:
    args = make_inputs(batch, new, prefix)
    assert cpu_prefill.can_prefill(*args[:4])
    fns = {"native": lambda: cpu_prefill.paged_prefill_attention(*args),
           "torch": lambda: cpu_backend.gathered_prefill_attention(*args)}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):  # interleaved: a busy moment hits both
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    native, torch_ms = (statistics.median(times[n]) * 1e3 for n in ("native", "torch"))
    # Multiply-adds of QK and PV over the causal triangle (and the whole prefix).
    macs = batch * HQ * D * 2 * (new * prefix + new * (new + 1) / 2)
    return {"B": batch, "new tokens": new, "cached prefix": prefix,
            "native ms": round(native, 2), "torch ms": round(torch_ms, 2),
            "torch / native": round(torch_ms / native, 2),
            "native GMAC/s": round(macs / native / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--tag", default="",
                    help="suffix of the results files (e.g. the CPU's vector class)")
    a = ap.parse_args()
    rows = []
    for case in CASES:
        rows.append(time_case(*case, a.reps))
        print(rows[-1], flush=True)
    if a.save:
        meta = {"device": f"CPU ({platform.processor() or platform.machine()}, "
                          f"{vector_isa()}, {torch.get_num_threads()} threads)",
                "commit": git_commit(),
                "date": utc_now(), "torch": torch.__version__, "triton": "n/a"}
        out = HERE / "results"
        stem = "cpu-prefill-cpu" + (f"-{a.tag}" if a.tag else "")
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                     indent=1) + "\n")
        flags = f" --tag {a.tag}" if a.tag else ""
        lines = header_lines("CPU paged prefill attention", meta,
                             f"Hq {HQ}, Hkv {HKV}, D {D}, bf16, block size {BS}, "
                             f"`python benchmarks/bench_cpu_prefill.py --save{flags}`")
        lines += table_lines(list(rows[0]), rows) + [""]
        (out / f"{stem}.md").write_text("\n".join(lines))
        print(f"wrote {out / f'{stem}.md'}")


def test_bench_cpu_prefill_smoke():
    if not cpu_prefill.can_prefill(*make_inputs(1, 4, 0)[:4]):
        pytest.skip("native CPU kernels not built (no C compiler)")
    args = make_inputs(2, 20, 13, dtype=torch.float32, seed=3)
    got = cpu_prefill.paged_prefill_attention(*args)
    want = cpu_backend.gathered_prefill_attention(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    main()
