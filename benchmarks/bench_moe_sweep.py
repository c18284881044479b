"""Tile sweep of the fused MoE grouped GEMM: how the configuration ``moe_gemm_config``
picks by rule compares with its neighbours, on the shapes the MoE targets are set at.

For each case (model shape, M tokens) and each of the layer's two GEMMs (gate+up: ``[M,
H] x [E, 2I, H]`` gated, per token; down: ``[M*k, I] x [E, H, I]`` times the routing
weight), every BLOCK_M near the rule's and a few tile variants around the rule's tile
(BLOCK_N, BLOCK_K, stages, warps) are timed alone with ``do_bench`` on the same routing.
Reported: ms, the weight-read bandwidth as a fraction of the measured copy bandwidth
(each touched expert's weights read once), and the rule's time over the best one's. A
configuration that does not compile (shared memory) is listed with its error.

One GPU run gives what the rule needs if it misses a target (issue: >= 3x a per-expert
loop at M = 256, >= 70% of copy bandwidth at M <= 16): ``scripts/gpu_ci.sh``'s
``moe-sweep`` step runs it after the benchmarks, in whatever time its budget has left.

    python benchmarks/bench_moe_sweep.py [--out DIR] [--max-seconds S]

On CPU (the interpreter) a tiny case with two variants runs as a smoke test of the
machinery; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from bench_moe import (
    DEVICE,
    DTYPE,
    IS_CUDA,
    SHAPES,
    copy_bandwidth,
    layer_inputs,
    time_ms,
)
from results_meta import git_commit, utc_now

import deepinfer_kernels  # before triton: on CPU it switches the interpreter on
from deepinfer_kernels.moe_gemm import moe_block_m, moe_gemm_config, moe_gemm_launches
from deepinfer_kernels.runtime import Target

CASES = ((("qwen3-30b-a3b", 16), ("mixtral-8x7b", 16), ("qwen3-30b-a3b", 256),
          ("mixtral-8x7b", 256)) if IS_CUDA else (("qwen3-like/32", 16),))
TILE_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
REL_ERR_MAX = 2e-2  # bf16 outputs, another accumulation order: about 4e-3


def block_ms(rule: int, interpret: bool) -> list[int]:
    """The rule's BLOCK_M and its neighbours (powers of two, 16..128); the interpreter
    (a smoke test) only the rule's."""
    if interpret:
        return [rule]
    return sorted({m for m in (rule // 2, rule, rule * 2) if 16 <= m <= 128})


def variants(rule: dict[str, int], interpret: bool) -> list[dict[str, int]]:
    """The rule's tile first, then single changes around it (no duplicates)."""
    if interpret:
        return [rule, {**rule, "BLOCK_N": rule["BLOCK_N"] * 2}]
    out = [rule]
    changes = [{"BLOCK_N": n} for n in (32, 64, 128)] + [{"BLOCK_K": k} for k in (64, 128)]
    changes += [{"num_stages": s} for s in (3, 4, 5)] + [{"num_warps": w} for w in (4, 8)]
    for change in changes:
        cfg = {**rule, **change}
        if cfg not in out:
            out.append(cfg)
    return out


def sweep_case(model: str, num_tokens: int, copy_gbs: float, deadline: float,
               seed: int = 0) -> list[dict]:
    """Time every (BLOCK_M, tile) of both GEMMs of one case; rows as documented above."""
    experts, top_k, hidden, inter = SHAPES[model]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x, w13, w2, weights, ids = layer_inputs(model, num_tokens, g)
    touched = int(torch.unique(ids).numel())
    act = torch.randn((num_tokens * top_k, inter), generator=g, device=DEVICE).to(DTYPE)
    target = Target.of(DEVICE)
    rule_bm = moe_block_m(num_tokens, top_k, experts, target)
    rows: list[dict] = []
    first: dict[str, torch.Tensor] = {}  # each GEMM's output under its first configuration
    for bm in block_ms(rule_bm, target.interpret):
        sorted_ids, block_expert, num_padded = deepinfer_kernels.moe_align(ids, experts, bm)
        gemms = {
            # name: (a, w, out, routing weights, gated, mul_weight, n, k)
            "gate_up": (x, w13, torch.empty((num_tokens * top_k, inter), dtype=DTYPE,
                                            device=DEVICE), None, True, False, inter, hidden),
            "down": (act, w2, torch.empty((num_tokens * top_k, hidden), dtype=DTYPE,
                                          device=DEVICE), weights, False, True, hidden, inter),
        }
        for name, (a, w, out, tw, gated, mul, n, k) in gemms.items():
            (launch,) = moe_gemm_launches(a, w, sorted_ids, block_expert, num_padded, tw, out,
                                          top_k, mul, gated, target)
            rule = moe_gemm_config(bm, n, k, a.element_size(), gated, target,
                                   block_expert.shape[0])
            weight_gb = touched * w.shape[1] * k * w.element_size() / 1e9
            for cfg in variants(rule, target.interpret):
                if time.perf_counter() > deadline:
                    return rows
                kw = {**launch.kwargs, **{key: cfg[key] for key in TILE_KEYS},
                      "BLOCK_M": bm, "EVEN_K": k % cfg["BLOCK_K"] == 0}
                grid = (block_expert.shape[0] * -(-n // cfg["BLOCK_N"]),)
                r = {"model": model, "tokens": num_tokens, "gemm": name, "BLOCK_M": bm,
                     **{key: cfg[key] for key in TILE_KEYS},
                     "rule": bm == rule_bm and cfg == rule}
                try:
                    ms = time_ms(lambda: launch.kernel[grid](*launch.args, **kw))  # noqa: B023
                except Exception as e:  # a tile that does not fit: listed, not fatal
                    r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                else:
                    r["ms"] = round(ms, 4)
                    r["bw_frac"] = round(weight_gb / (ms * 1e-3) / copy_gbs, 3)
                    # Every configuration computes the same thing: a wrong tile is no win.
                    ref = first.setdefault(name, out.float().clone())
                    r["rel_err"] = round(float((out.float() - ref).norm() / ref.norm()), 5)
                rows.append(r)
    return rows


def best_vs_rule(rows: list[dict]) -> list[dict]:
    """Per (model, tokens, gemm): the rule's ms, the best ms and its configuration."""
    out = []
    keys = sorted({(r["model"], r["tokens"], r["gemm"]) for r in rows})
    for key in keys:
        timed = [r for r in rows if (r["model"], r["tokens"], r["gemm"]) == key
                 and "ms" in r and r["rel_err"] < REL_ERR_MAX]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["ms"])
        rule = next((r for r in timed if r["rule"]), None)
        out.append({"model": key[0], "tokens": key[1], "gemm": key[2],
                    "rule_ms": rule["ms"] if rule else None, "best_ms": best["ms"],
                    "rule_over_best": round(rule["ms"] / best["ms"], 3) if rule else None,
                    "best": {k: best[k] for k in ("BLOCK_M", *TILE_KEYS)},
                    "best_bw_frac": best["bw_frac"]})
    return out


def run(max_seconds: float) -> tuple[dict, list[dict], list[dict]]:
    """Sweep ``CASES`` until done or ``max_seconds`` passed; (meta, rows, summary)."""
    import triton

    deadline = time.perf_counter() + max_seconds
    copy_gbs = copy_bandwidth()
    rows: list[dict] = []
    for model, m in CASES:
        rows += sweep_case(model, m, copy_gbs, deadline)
    meta = {"device": torch.cuda.get_device_name() if IS_CUDA else "cpu",
            "commit": git_commit(), "date": utc_now(), "torch": torch.__version__,
            "triton": triton.__version__, "dtype": str(DTYPE).replace("torch.", ""),
            "copy_GB/s": round(copy_gbs, 1), "complete": time.perf_counter() <= deadline}
    return meta, rows, best_vs_rule(rows)


def markdown(meta: dict, rows: list[dict], summary: list[dict]) -> str:
    lines = [f"# Fused MoE GEMM tile sweep: {meta['device']}", "",
             f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, triton "
             f"{meta['triton']}, dtype {meta['dtype']}, copy {meta['copy_GB/s']} GB/s"
             + ("" if meta["complete"] else "; cut short by its time limit") + ".", "",
             "| model | M | gemm | rule ms | best ms | rule / best | best config | best bw |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        cfg = ", ".join(f"{k}={v}" for k, v in s["best"].items())
        lines.append(f"| {s['model']} | {s['tokens']} | {s['gemm']} | {s['rule_ms']} | "
                     f"{s['best_ms']} | {s['rule_over_best']} | {cfg} | "
                     f"{s['best_bw_frac']:.0%} |")
    errors = [r for r in rows if "error" in r]
    wrong = [r for r in rows if r.get("rel_err", 0) >= REL_ERR_MAX]
    lines += ["", f"{len(rows)} configurations, {len(errors)} did not run, {len(wrong)} "
              f"disagreed with the first one run (relative error >= {REL_ERR_MAX}; left "
              "out of 'best')."]
    return "\n".join(lines) + "\n"


def write(meta: dict, rows: list[dict], summary: list[dict], out_dir: Path) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"moe-sweep-{slug}.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "results": rows}, indent=2) + "\n")
    path = out_dir / f"moe-sweep-{slug}.md"
    path.write_text(markdown(meta, rows, summary))
    return path


def test_moe_sweep_smoke(tmp_path):
    """The sweep's machinery on a tiny case (interpreter on CPU): the rule's tile is among
    the timed ones, every row has a time or an error, the files are written."""
    meta, rows, summary = run(max_seconds=600)
    assert meta["complete"] and rows
    assert any(r["rule"] for r in rows)
    assert all(("ms" in r) != ("error" in r) for r in rows)
    assert all(r["rel_err"] < REL_ERR_MAX for r in rows)  # fp32 on CPU: one result
    assert {s["gemm"] for s in summary} == {"gate_up", "down"}
    assert all(s["best_ms"] <= s["rule_ms"] for s in summary)
    assert write(meta, rows, summary, tmp_path).exists()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="folder for moe-sweep-<device>.{json,md}")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="stop sweeping after this long (the files say it was cut)")
    args = parser.parse_args(argv)
    meta, rows, summary = run(args.max_seconds)
    print(f"written: {write(meta, rows, summary, Path(args.out))}")
    print(markdown(meta, rows, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
