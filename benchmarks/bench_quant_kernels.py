"""GGUF-quantized matmul microbenchmarks: ``deepinfer_kernels.gguf_matmul`` (weights kept as
GGUF blocks, decoded in registers) per block type, against the device's copy bandwidth
and a dense bf16 matmul of the same shape, same run. CUDA only: on a CPU the whole file
is skipped (the interpreter is far too slow to time; tests/kernels/test_gguf_matmul.py
checks its numbers there).

Per type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), an ``N = K = 4096`` weight (a
Llama-3-8B / Qwen3-8B attention projection) and bf16 x of M = 1 and 16 rows (the GEMV,
decode) and 256 (the GEMM, prefill). Every timing is ``triton.testing.do_bench`` (median
ms; it flushes L2 before each run, so the weight comes from device memory). Reported:
ms; the quantized bytes read once over that time as GB/s and as a fraction of the copy
bandwidth measured on a buffer of the same size (``dst.copy_(src)``, read + write bytes);
TFLOP/s; ``dense_ms`` of ``x @ W.T`` with W dequantized to bf16 (cuBLAS, 16 bits a
weight) and ``dense / gguf``; the error against ``deepinfer_kernels.reference`` over the
scale of the dot products. At M <= 16 the bandwidth fraction is the measure (the kernel
streams the weight once); at 256 the comparison with the dense GEMM.

    DEEPINFER_BENCH_SAVE=1 python -m pytest benchmarks/bench_quant_kernels.py -q -s

Results: ``quant-kernels-<device>.{json,md}`` in ``$DEEPINFER_BENCH_OUT`` when set
(scripts/gpu_ci.sh sets it), benchmarks/results with ``DEEPINFER_BENCH_SAVE=1``, else a
temporary folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from results_meta import git_commit, header_lines, table_lines, utc_now

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS, block_format
from deepinfer_kernels.gguf_matmul import GEMV_MAX_M

IS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not IS_CUDA, reason="times compiled Triton kernels: CUDA only")

try:  # pytest-benchmark is a dev dependency; keep the file usable without it.
    import pytest_benchmark  # noqa: F401
except ImportError:  # pragma: no cover

    @pytest.fixture
    def benchmark():
        return lambda fn, *a, **k: fn(*a, **k)


RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHAPE = (4096, 4096)  # (N, K)
ROWS = (1, 16, 256)
DTYPE = torch.bfloat16
TYPES = {f.name: f.type_id for f in BLOCK_FORMATS.values()}
# Byte offsets of each block's fp16 fields (deepinfer_kernels.gguf_blocks lists the
# layouts): random bytes there could be NaN or inf, so they get small finite scales.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_ROWS: list[dict] = []


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def random_blocks(name: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """uint8 ``[n, row_bytes]`` of random codes with fp16 scales in ``±[2^-12, 2^-8]``."""
    fmt = block_format(TYPES[name])
    raw = torch.randint(0, 256, (n * k // fmt.block_weights, fmt.block_bytes), generator=g,
                        dtype=torch.uint8, device="cuda")
    for at in FP16_FIELDS[name]:
        scale = torch.exp2(torch.empty(raw.shape[0], device="cuda").uniform_(-12, -8,
                                                                               generator=g))
        sign = torch.randint(0, 2, (raw.shape[0],), generator=g, device="cuda") * 2 - 1
        raw[:, at:at + 2] = (scale * sign).half().view(torch.uint8).view(-1, 2)
    return raw.view(n, -1)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(TYPES))
def test_bench_gguf_matmul(benchmark, name: str, m: int):
    n, k = SHAPE
    g = torch.Generator(device="cuda").manual_seed(len(_ROWS))
    blocks = random_blocks(name, n, k, g)
    x = torch.randn((m, k), generator=g, device="cuda").to(DTYPE)
    out = torch.empty((m, n), dtype=DTYPE, device="cuda")
    qtype = TYPES[name]
    run = lambda: deepinfer_kernels.gguf_matmul(x, blocks, qtype, out=out)  # noqa: E731

    w = reference.dequantize_gguf(blocks, qtype)
    want, scale = x.float() @ w.T, x.float().abs() @ w.abs().T
    err = float(((run().float() - want).abs() / scale.clamp_min(1e-30)).max())
    w16 = w.to(DTYPE)
    dense = lambda: torch.matmul(x, w16.T)  # noqa: E731

    src = torch.empty_like(blocks)
    dst = torch.empty_like(blocks)
    copy_gbs = 2 * blocks.numel() / 1e9 / (_time_ms(lambda: dst.copy_(src)) * 1e-3)
    ms, dense_ms = _time_ms(run), _time_ms(dense)
    gbs = blocks.numel() / 1e9 / (ms * 1e-3)
    _ROWS.append({
        "type": name, "M": m, "path": "gemv" if m <= GEMV_MAX_M else "gemm", "ms": round(ms, 4),
        "GB/s": round(gbs, 1), "copy_GB/s": round(copy_gbs, 1),
        "bw_frac": round(gbs / copy_gbs, 3),
        "TFLOP/s": round(2 * m * n * k / 1e12 / (ms * 1e-3), 2),
        "dense_ms": round(dense_ms, 4), "dense_over_gguf": round(dense_ms / ms, 2),
        "max_err": float(f"{err:.2g}"),
    })
    assert err < 2e-2, f"{name} M={m}: error {err:.3g} of the dot products' scale"
    benchmark(run)


def _markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["type", "M", "path", "ms", "GB/s", "copy_GB/s", "bw_frac", "TFLOP/s", "dense_ms",
            "dense_over_gguf", "max_err"]
    n, k = meta["shape"]
    lines = header_lines("GGUF matmul benchmark", meta, f"x {meta['dtype']}, N = {n}, "
                         f"K = {k}")
    lines += ["GB/s = the quantized bytes, read once, over the kernel's time; bw_frac = that "
              "/ the copy bandwidth of a same-size buffer (read + write bytes); dense = "
              "x @ W.T with W dequantized to bf16 (cuBLAS); dense_over_gguf > 1: the "
              "quantized kernel is faster; max_err = |error| / (|x| @ |W|.T), worst "
              "output.", ""]
    return "\n".join(lines + table_lines(cols, rows)) + "\n"


@pytest.fixture(scope="module", autouse=True)
def _write_results(tmp_path_factory):
    yield
    if not _ROWS:
        return
    import triton

    name = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    meta = {"device": name, "commit": git_commit(), "date": utc_now(),
            "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE).replace("torch.", ""), "shape": list(SHAPE)}
    out = os.environ.get("DEEPINFER_BENCH_OUT")
    out_dir = (Path(out) if out else RESULTS_DIR if os.environ.get("DEEPINFER_BENCH_SAVE") == "1"
               else tmp_path_factory.mktemp("bench_quant_kernels"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"quant-kernels-{slug}.json").write_text(
        json.dumps({"meta": meta, "results": _ROWS}, indent=2) + "\n")
    md = _markdown(meta, _ROWS)
    (out_dir / f"quant-kernels-{slug}.md").write_text(md)
    print(f"\n{md}\nresults written to {out_dir}")
