"""Mixture-of-experts layer benchmark: ``deepinfer_kernels.fused_moe`` against a per-expert loop of
torch matmuls on the same routing; on CUDA also ``fused_moe_gguf`` with the experts kept
as Q4_0 blocks (weight-read bandwidth on the quantized bytes).

CUDA (bf16): ``triton.testing.do_bench`` at Qwen3-30B-A3B's shapes (E=128, top-8,
H=2048, I=768) and Mixtral's (E=8, top-2, H=4096, I=14336) for M = 1..256 (decode) and
4096 (prefill) tokens. Reported: ms, TFLOP/s (``6 * M * k * H * I`` flops), and for the
fused kernel the weight-read bandwidth (every touched expert's ``3 * H * I`` weights read
once) as a fraction of the measured device copy bandwidth (``dst.copy_(src)``, 1 GiB).

CPU: the interpreter is far too slow to time, so a scaled-down run times the torch
reference path (``deepinfer_kernels.reference.fused_moe``: grouped by expert, one matmul pair per
expert that got a token) against the same per-expert loop, and runs the interpreted Triton
layer once, untimed, as a correctness smoke check.

    python benchmarks/bench_moe.py [--save] [--out DIR]   # --save: benchmarks/results/
    python -m pytest benchmarks/bench_moe.py -q -s        # what `make test` collects

Results: ``moe-<device>.{json,md}`` (commit, date, device) in ``--out`` /
``$DEEPINFER_BENCH_OUT``, or benchmarks/results with ``--save`` /
``DEEPINFER_BENCH_SAVE=1``, else nowhere (pytest: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from results_meta import git_commit, table_lines, utc_now  # noqa: E402

import deepinfer_kernels  # noqa: E402
from deepinfer_kernels import reference  # noqa: E402

IS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
DTYPE = torch.bfloat16 if IS_CUDA else torch.float32
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# name: (experts, top_k, hidden, intermediate)
SHAPES = ({"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
          if IS_CUDA else {"qwen3-like/32": (16, 4, 64, 32), "mixtral-like/64": (8, 2, 64, 224)})
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 4096) if IS_CUDA else (1, 16, 128)
DECODE_MAX = 256


def time_ms(fn: Callable[[], object]) -> float:
    """Median ms: do_bench on CUDA, wall clock (5 runs after a warm-up) on CPU."""
    if IS_CUDA:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def per_expert_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The baseline: for every expert, find its (token, k) pairs and run its MLP on them
    with torch matmuls in x's dtype (one host sync per expert, as such loops have)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].T
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = (h @ w2[e].T).float() * topk_weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def copy_bandwidth() -> float:
    """Device copy bandwidth in GB/s (read + write bytes), 1 GiB on CUDA."""
    nbytes = (1 << 30) if IS_CUDA else (1 << 24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * nbytes / 1e9 / (time_ms(lambda: dst.copy_(src)) * 1e-3)


def layer_inputs(model: str, num_tokens: int, g: torch.Generator
                 ) -> tuple[torch.Tensor, ...]:
    """Random inputs of one MoE layer of ``model``'s shape at ``num_tokens`` tokens:
    ``(x [M, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [M, k], topk_ids [M, k])``,
    routed by the kernel on CUDA and by the reference on CPU."""
    experts, top_k, hidden, inter = SHAPES[model]
    x = torch.randn((num_tokens, hidden), generator=g, device=DEVICE).to(DTYPE)
    w13 = (torch.randn((experts, 2 * inter, hidden), generator=g, device=DEVICE)
           * hidden**-0.5).to(DTYPE)
    w2 = (torch.randn((experts, hidden, inter), generator=g, device=DEVICE)
          * inter**-0.5).to(DTYPE)
    logits = torch.randn((num_tokens, experts), generator=g, device=DEVICE)
    route = deepinfer_kernels.moe_route if IS_CUDA else reference.moe_route
    weights, ids = route(logits, top_k, True)
    return x, w13, w2, weights, ids


Q4_0 = 2  # ggml type id: 32 weights a block, an fp16 scale and 16 bytes of 4-bit codes


def q4_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[E, N, K]`` (K a multiple of 32) as Q4_0 blocks, uint8 ``[E, N, K / 32 *
    18]``: per 32 weights ``d = absmax / -8`` (the sign that maps the largest magnitude
    to code 0, as ggml does) as fp16, then codes ``round(w / d) + 8`` clamped to 0..15,
    weight i in the low nibble of byte i and weight 16 + i in its high nibble."""
    e, n, k = w.shape
    g = w.float().reshape(e, n, k // 32, 32)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    d = (g.gather(-1, idx) / -8).squeeze(-1)  # the signed value of largest magnitude / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (g * inv[..., None] + 8.5).floor().clamp(0, 15).to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    scale = d.to(torch.float16).view(torch.uint8).reshape(e, n, k // 32, 2)
    return torch.cat([scale, codes], dim=-1).reshape(e, n, -1).contiguous()


def bench_case(model: str, num_tokens: int, copy_gbs: float, seed: int = 0) -> list[dict]:
    """Time one (model shape, M) on the same routing; returns result rows."""
    experts, top_k, hidden, inter = SHAPES[model]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x, w13, w2, weights, ids = layer_inputs(model, num_tokens, g)

    touched = int(torch.unique(ids).numel())
    weight_gb = touched * 3 * hidden * inter * x.element_size() / 1e9
    tflop = 6 * num_tokens * top_k * hidden * inter / 1e12
    case = f"M={num_tokens}"
    rows = []

    def row(impl: str, ms: float, bandwidth: bool) -> dict:
        r = {"model": model, "case": case, "tokens": num_tokens, "impl": impl,
             "ms": round(ms, 4), "TFLOP/s": round(tflop / (ms * 1e-3), 3),
             "experts_touched": touched}
        if bandwidth:
            gbs = weight_gb / (ms * 1e-3)
            r["weight GB/s"] = round(gbs, 1)
            r["bw_frac"] = round(gbs / copy_gbs, 3)
        rows.append(r)
        return r

    loop = lambda: per_expert_loop(x, w13, w2, weights, ids)  # noqa: E731
    decode = num_tokens <= DECODE_MAX
    if IS_CUDA:
        out = torch.empty_like(x)
        fused = lambda: deepinfer_kernels.fused_moe(x, w13, w2, weights, ids, out=out)  # noqa: E731
        err = ((fused().float() - loop().float()).norm() / loop().float().norm()).item()
        row("triton-fused", time_ms(fused), decode)["rel_err_vs_loop"] = round(err, 5)
        # The experts as Q4_0 blocks (weights stay quantized: 18 bytes a 32 weights),
        # against fused_moe on the same weights dequantized; bandwidth on those bytes.
        b13, b2 = q4_0_blocks(w13), q4_0_blocks(w2)
        dq13 = reference.dequantize_gguf(b13.reshape(-1, b13.shape[2]), Q4_0)
        dq2 = reference.dequantize_gguf(b2.reshape(-1, b2.shape[2]), Q4_0)
        dense = deepinfer_kernels.fused_moe(x, dq13.view(w13.shape).to(DTYPE),
                                            dq2.view(w2.shape).to(DTYPE), weights, ids)
        gguf = lambda: deepinfer_kernels.fused_moe_gguf(  # noqa: E731
            x, b13, b2, Q4_0, Q4_0, weights, ids, out=out)
        err = ((gguf().float() - dense.float()).norm() / dense.float().norm()).item()
        r = row("triton-fused-gguf-q4_0", time_ms(gguf), False)
        gbs = weight_gb * 18 / 32 / x.element_size() / (r["ms"] * 1e-3)
        r.update({"rel_err_vs_dequantized": round(err, 5)}
                 | ({"weight GB/s": round(gbs, 1), "bw_frac": round(gbs / copy_gbs, 3)}
                    if decode else {}))
    else:
        ref = lambda: reference.fused_moe(x, w13, w2, weights, ids)  # noqa: E731
        row("torch-reference", time_ms(ref), decode)
        if num_tokens == TOKENS[0]:  # the interpreter, once, untimed: a smoke check
            got = deepinfer_kernels.fused_moe(x, w13, w2, weights, ids)
            torch.testing.assert_close(got, ref(), atol=1e-4, rtol=1e-4)
            b13, b2 = q4_0_blocks(w13), q4_0_blocks(w2)
            got = deepinfer_kernels.fused_moe_gguf(x, b13, b2, Q4_0, Q4_0, weights, ids)
            want = reference.fused_moe_gguf(x, b13, b2, Q4_0, Q4_0, weights, ids)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    row("torch-per-expert-loop", time_ms(loop), decode)
    base = rows[0]["ms"]
    for r in rows[1:]:
        r["speedup_of_" + rows[0]["impl"]] = round(r["ms"] / base, 3)
    return rows


def run(tokens: tuple[int, ...] = TOKENS) -> tuple[dict, list[dict]]:
    import triton

    copy_gbs = copy_bandwidth()
    rows = [r for model in SHAPES for m in tokens for r in bench_case(model, m, copy_gbs)]
    name = torch.cuda.get_device_name() if IS_CUDA else "cpu"
    meta = {"device": name, "commit": git_commit(), "date": utc_now(),
            "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE).replace("torch.", ""), "copy_GB/s": round(copy_gbs, 1),
            "shapes": {k: dict(zip(("E", "top_k", "H", "I"), v)) for k, v in SHAPES.items()},
            "timed_fused": "triton" if IS_CUDA else "torch reference (interpreter untimed)"}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["model", "case", "impl", "ms", "TFLOP/s", "weight GB/s", "bw_frac",
            "experts_touched", "rel_err_vs_loop"]
    speed = sorted({k for r in rows for k in r if k.startswith("speedup_of_")})
    cols += speed
    shapes = ", ".join(f"{k} (E={v['E']}, k={v['top_k']}, H={v['H']}, I={v['I']})"
                       for k, v in meta["shapes"].items())
    lines = [f"# MoE layer benchmark: {meta['device']}", "",
             f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, triton "
             f"{meta['triton']}, dtype {meta['dtype']}; shapes: {shapes}.", "",
             f"Timed fused path: {meta['timed_fused']}. bw_frac = weight bytes of the "
             f"touched experts / time / measured copy bandwidth ({meta['copy_GB/s']} GB/s); "
             "decode sizes only. speedup_of_X = this row's ms / X's ms.", ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


def write(meta: dict, rows: list[dict], out_dir: Path, prefix: str = "moe",
          render: Callable[[dict, list[dict]], str] = markdown) -> Path:
    """``<prefix>-<device>.json`` (meta and rows) and ``.md`` (``render``'s table) in
    ``out_dir``; returns the markdown file's path."""
    slug = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{prefix}-{slug}.json").write_text(
        json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    (out_dir / f"{prefix}-{slug}.md").write_text(render(meta, rows))
    return out_dir / f"{prefix}-{slug}.md"


def out_dir(save: bool, out: str | None) -> Path | None:
    """Where a benchmark's results go: ``out``, else ``$DEEPINFER_BENCH_OUT``, else
    benchmarks/results when saving, else nowhere (None)."""
    out = out or os.environ.get("DEEPINFER_BENCH_OUT")
    if out:
        return Path(out)
    return RESULTS_DIR if save or os.environ.get("DEEPINFER_BENCH_SAVE") == "1" else None


def test_bench_moe(tmp_path):
    """Smoke test (no timing assertions): the grid runs and the results files are written.
    On CPU, a scaled-down grid; on CUDA, the issue's grid."""
    meta, rows = run(TOKENS if IS_CUDA else TOKENS[:2])
    assert rows and all(r["ms"] > 0 for r in rows)
    path = write(meta, rows, out_dir(False, None) or tmp_path)
    assert path.exists()
    print("\n" + path.read_text())


def cli(argv: list[str] | None, doc: str, run_all: Callable[[], tuple[dict, list[dict]]],
        render: Callable[[dict, list[dict]], str], prefix: str) -> int:
    """A results benchmark's command line: ``--save`` / ``--out DIR``; runs ``run_all``,
    prints ``render``'s table and writes the files (see ``write``) where asked."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--save", action="store_true", help="write to benchmarks/results/")
    parser.add_argument("--out", help="write the results files here instead")
    args = parser.parse_args(argv)
    meta, rows = run_all()
    print(render(meta, rows))
    directory = out_dir(args.save, args.out)
    if directory is not None:
        print(f"written: {write(meta, rows, directory, prefix, render)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, run, markdown, "moe")


if __name__ == "__main__":
    sys.exit(main())
