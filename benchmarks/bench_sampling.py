"""Token sampling: the ops' draws against the torch ops they replace
(``deepinfer_kernels.reference``: divide, softmax, cumsum, search; top-p a sort of every
row), same logits, same uniforms, same run.

- CUDA: the fused Triton draw (``deepinfer_kernels.sample_tokens``; with filters,
  ``sample_tokens_filtered``: the torch filters, then that draw), ``do_bench``.
- CPU: the C draws (``cpu_backend.sample_tokens`` / ``sample_tokens_filtered``, one call
  a batch: ``kernels/csrc/sampling_cpu.c``), wall clock.

Filters per row set: ``none`` (temperature only), ``top_k=50``, ``top_p=0.9``, and
``top_k=40,top_p=0.95,min_p=0.05`` (llama.cpp's defaults); temperatures 0.5-1.5. Shapes:
64 and 256 rows of SmolLM2's 49k vocabulary and 64 rows of Qwen's 152k one. Reported: ms
each, torch ms / ours, how many rows drew a different token (only rows whose target lies
within rounding of a CDF boundary may: the sums run in another order) and how many draws
are not inverse-CDF answers of the reference's filtered logits at all, checked in float64
(``reference.inverse_cdf_draw_ok``): that count must be 0.

``--engine`` (CPU) adds the default model end to end: 128 requests of 16-64 random prompt
tokens, 64 tokens out each (temperature 0.8, top_p 0.9), generated tok/s with the C draws
against the same engine with its sampler's ops swapped for the reference, and greedy.

    python benchmarks/bench_sampling.py [--engine] [--save] [--out DIR]
    python -m pytest benchmarks/bench_sampling.py -q -s

Results: ``sampling-<device>.{json,md}`` in ``--out`` / ``$DEEPINFER_BENCH_OUT``, or
benchmarks/results with ``--save`` / ``DEEPINFER_BENCH_SAVE=1``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_moe import IS_CUDA, copy_bandwidth, out_dir, time_ms, write  # noqa: E402
from results_meta import git_commit, header_lines, table_lines, utc_now  # noqa: E402

import deepinfer_kernels  # noqa: E402
from deepinfer_kernels import cpu_backend, reference  # noqa: E402

DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
OPS = deepinfer_kernels if IS_CUDA else cpu_backend
SHAPES = [(64, 49152), (256, 49152), (64, 151936)]
SMALL_SHAPES = [(8, 2000), (32, 5000)]  # the smoke test's
FILTERS = {"none": {}, "top_k=50": {"top_k": 50}, "top_p=0.9": {"top_p": 0.9},
           "top_k=40,top_p=0.95,min_p=0.05": {"top_k": 40, "top_p": 0.95, "min_p": 0.05}}
PREFIX = "sampling"


def draw(ops, logits, temps, uniforms, filters: dict) -> torch.Tensor:
    if not filters:
        return ops.sample_tokens(logits, temps, uniforms)
    return ops.sample_tokens_filtered(logits, temps, uniforms, **filters)


def case(rows: int, vocab: int, name: str, copy_gbs: float | None) -> dict:
    """Both draws on one random batch (logit scale of a real model's: std ~3); on CUDA,
    the plain draw's two reads of the logits against ``copy_gbs`` too."""
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    temps = (0.5 + torch.rand(rows, generator=g)).to(DEVICE)
    uniforms = torch.rand(rows, generator=g).to(DEVICE)
    filters = {}
    for key, value in FILTERS[name].items():
        dtype = torch.int64 if key == "top_k" else torch.float32
        filters[key] = torch.full((rows,), value, dtype=dtype, device=DEVICE)
    if "top_k" in filters:
        filters["max_top_k"] = FILTERS[name]["top_k"]
    ours = draw(OPS, logits, temps, uniforms, filters)
    want = draw(reference, logits, temps, uniforms, filters)
    scaled = reference.filter_logits(logits, temps, **filters)
    ok = reference.inverse_cdf_draw_ok(scaled, torch.ones_like(temps), uniforms, ours)
    torch_ms = time_ms(lambda: draw(reference, logits, temps, uniforms, filters))
    ms = time_ms(lambda: draw(OPS, logits, temps, uniforms, filters))
    row = {"rows": rows, "vocab": vocab, "filters": name, "torch_ms": round(torch_ms, 3),
           "ours_ms": round(ms, 3), "speedup": round(torch_ms / ms, 1),
           "rows_differing": int((ours != want).sum()), "invalid_draws": int((~ok).sum())}
    if copy_gbs and not filters:
        gbs = 2 * logits.numel() * logits.element_size() / 1e9 / (ms * 1e-3)
        row.update(GBps=round(gbs, 1), bw_frac=round(gbs / copy_gbs, 3))
    return row


def engine_rows(requests: int = 128, max_tokens: int = 64) -> list[dict]:
    """The default model's generated tok/s: C draws, the reference's, and greedy."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(device="cpu")
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 65, (requests,), generator=g)]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens,
                             ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sampler = llm.engine.runner.sampler
    ours = sampler.ops
    rows = []
    # Warm-up: the whole workload once, so that no timed run pays for first-use costs
    # (oneDNN builds a primitive per new batch shape) that the others then skip.
    llm.generate(prompts, sampled, use_tqdm=False)
    for label, ops, params in (("temperature 0.8, top_p 0.9: C draws", ours, sampled),
                               ("temperature 0.8, top_p 0.9: torch draws", reference,
                                sampled),
                               ("greedy", ours, greedy)):
        sampler.ops = ops
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"engine": label, "requests": requests, "tokens": tokens,
                     "seconds": round(wall, 1), "tok/s": round(tokens / wall, 1)})
        print(rows[-1], flush=True)
    sampler.ops = ours
    llm.close()
    return rows


def run(shapes: list[tuple[int, int]] = SHAPES, engine: bool = False) -> tuple[dict, list]:
    import triton

    copy_gbs = copy_bandwidth() if IS_CUDA else None
    rows = [case(n, v, name, copy_gbs) for n, v in shapes for name in FILTERS]
    name = torch.cuda.get_device_name() if IS_CUDA else "cpu"
    meta = {"device": name, "commit": git_commit(), "date": utc_now(),
            "torch": torch.__version__, "triton": triton.__version__,
            "threads": torch.get_num_threads(),
            "engine": engine_rows() if engine and not IS_CUDA else []}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["rows", "vocab", "filters", "torch_ms", "ours_ms", "speedup", "rows_differing",
            "invalid_draws"] + (["GBps", "bw_frac"] if IS_CUDA else [])
    ours = "the Triton draw" if IS_CUDA else "the C draws (cpu_backend)"
    lines = header_lines("Token sampling", meta, f"fp32 logits, {meta['threads']} threads")
    lines += [f"torch = deepinfer_kernels.reference (a sort per row for top-p); ours = "
              f"{ours}; speedup = torch ms / ours ms.", ""]
    lines += table_lines(cols, rows)
    if meta.get("engine"):
        lines += ["", "## End to end: the default model, CPU", "",
                  "128 requests, 16-64 random prompt tokens, 64 out each (ignore_eos); the "
                  "torch row swaps the engine sampler's ops for the reference.", ""]
        lines += table_lines(["engine", "requests", "tokens", "seconds", "tok/s"],
                             meta["engine"])
    return "\n".join(lines) + "\n"


def test_bench_sampling(tmp_path):
    """Smoke test (no timing assertions): every shape and filter set runs, every draw is a
    valid inverse-CDF answer in float64 (rows differing from the float32 torch ops are
    only reported: near a boundary either neighbour is right), the files are written."""
    meta, rows = run(SHAPES if IS_CUDA else SMALL_SHAPES)
    assert len(rows) == len(SMALL_SHAPES if not IS_CUDA else SHAPES) * len(FILTERS)
    assert all(r["torch_ms"] > 0 and r["invalid_draws"] == 0 for r in rows)
    path = write(meta, rows, out_dir(False, None) or tmp_path, PREFIX, markdown)
    print("\n" + path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="store_true",
                        help="add the default model end to end (CPU)")
    parser.add_argument("--save", action="store_true", help="write to benchmarks/results/")
    parser.add_argument("--out", help="write the results files here instead")
    args = parser.parse_args(argv)
    meta, rows = run(engine=args.engine)
    print(markdown(meta, rows))
    directory = out_dir(args.save, args.out)
    if directory is not None:
        print(f"written: {write(meta, rows, directory, PREFIX, markdown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
