"""Temperature sampling: the fused Triton draw (``deepinfer_kernels.sample_tokens``) against
the torch ops it replaces (``deepinfer_kernels.reference.sample_tokens``: divide, softmax,
cumsum, search, fallback check; what the sampler ran before), same logits, same uniforms, same run.

At 64 and 256 rows of a 152k vocabulary (Qwen) and a 49k one (SmolLM2), fp32 logits (as
``compute_logits`` returns them). Reported: ms, the fused kernel's bytes (the logits read
twice) as GB/s and as a fraction of the measured copy bandwidth, torch ms / fused ms, and
how many rows drew a different token (only rows whose target lies within rounding of a
CDF boundary may: the sums run in another order) and how many draws are not inverse-CDF
answers at all, checked in float64 (``reference.inverse_cdf_draw_ok``): that count must
be 0.

CUDA: ``triton.testing.do_bench``. CPU: the interpreter is too slow to time, so the torch
ops are timed at small shapes and the Triton draw runs once, untimed, as a check.

    python benchmarks/bench_sampling.py [--save] [--out DIR]
    python -m pytest benchmarks/bench_sampling.py -q -s

Results: ``sampling-<device>.{json,md}`` in ``--out`` / ``$DEEPINFER_BENCH_OUT``, or
benchmarks/results with ``--save`` / ``DEEPINFER_BENCH_SAVE=1``.
"""

from __future__ import annotations

import sys

import torch
from bench_moe import IS_CUDA, cli, copy_bandwidth, out_dir, time_ms, write  # noqa: E402
from results_meta import git_commit, header_lines, table_lines, utc_now  # noqa: E402

import deepinfer_kernels  # noqa: E402
from deepinfer_kernels import reference  # noqa: E402

DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
# (rows, vocab): decode batches of Qwen3 / SmolLM2 vocabularies; scaled down on CPU.
SHAPES = ([(64, 151936), (256, 151936), (256, 49152)] if IS_CUDA
          else [(8, 2000), (32, 5000)])
PREFIX = "sampling"


def case(rows: int, vocab: int, copy_gbs: float) -> dict:
    """Time both draws on one random batch (logit scale of a real model's: std ~3)."""
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    temps = (0.5 + torch.rand(rows, generator=g)).to(DEVICE)
    uniforms = torch.rand(rows, generator=g).to(DEVICE)
    fused = deepinfer_kernels.sample_tokens(logits, temps, uniforms)
    want = reference.sample_tokens(logits, temps, uniforms)
    row = {"rows": rows, "vocab": vocab,
           "torch_ms": round(time_ms(lambda: reference.sample_tokens(logits, temps,
                                                                      uniforms)), 4),
           "rows_differing": int((fused != want).sum()),
           "invalid_draws": int((~reference.inverse_cdf_draw_ok(logits, temps, uniforms,
                                                                fused)).sum())}
    if IS_CUDA:
        ms = time_ms(lambda: deepinfer_kernels.sample_tokens(logits, temps, uniforms))
        gbs = 2 * logits.numel() * logits.element_size() / 1e9 / (ms * 1e-3)
        row.update(fused_ms=round(ms, 4), fused_GBps=round(gbs, 1),
                   bw_frac=round(gbs / copy_gbs, 3), speedup=round(row["torch_ms"] / ms, 2))
    return row


def run() -> tuple[dict, list[dict]]:
    import triton

    copy_gbs = copy_bandwidth()
    rows = [case(n, v, copy_gbs) for n, v in SHAPES]
    name = torch.cuda.get_device_name() if IS_CUDA else "cpu"
    meta = {"device": name, "commit": git_commit(), "date": utc_now(),
            "torch": torch.__version__, "triton": triton.__version__,
            "copy_GB/s": round(copy_gbs, 1), "timed_fused": IS_CUDA}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["rows", "vocab", "torch_ms", "fused_ms", "speedup", "fused_GBps", "bw_frac",
            "rows_differing", "invalid_draws"]
    lines = header_lines("Temperature sampling", meta, "fp32 logits")
    lines += ["torch = deepinfer_kernels.reference.sample_tokens (the sampler's former torch ops); "
             "fused = the Triton draw; speedup = torch ms / fused ms; bw_frac = two reads "
             f"of the logits / time / copy bandwidth ({meta['copy_GB/s']} GB/s)."
             + ("" if meta["timed_fused"] else " CPU: fused not timed (interpreter)."), ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


def test_bench_sampling(tmp_path):
    """Smoke test (no timing assertions): every shape runs, every fused draw is a valid
    inverse-CDF answer in float64 (rows differing from the float32 torch ops are only
    reported: near a boundary either neighbour is right), and the files are written."""
    meta, rows = run()
    assert len(rows) == len(SHAPES)
    assert all(r["torch_ms"] > 0 and r["invalid_draws"] == 0 for r in rows)
    path = write(meta, rows, out_dir(False, None) or tmp_path, PREFIX, markdown)
    print("\n" + path.read_text())


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, run, markdown, PREFIX)


if __name__ == "__main__":
    sys.exit(main())
