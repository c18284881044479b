"""Kernel microbenchmarks: Triton paged attention and cache ops vs same-run baselines.

On CUDA every timing is ``triton.testing.do_bench`` (kernel time, median ms). Baselines:
torch ``scaled_dot_product_attention`` on the same data gathered contiguous (gather not
timed; flash backend forced when it accepts the inputs), FlexAttention (``torch.compile``d
``flex_attention`` on the same gathered data, causal block mask; on a subset of the cases,
since every new shape costs a compile; ``DEEPINFER_BENCH_FLEX=0`` skips it) and
flash-attn's ``flash_attn_with_kvcache`` with a block table when flash_attn is importable
(flash-attn 2 needs pages of 256 tokens, so it reads the gathered data through a 256-token
block table). Decode also times the same kernel over an int8 KV cache (``kv_cache_dtype=
"int8"``: codes and a scale per 32 values, 0.56x the bytes of bf16), impl ``triton int8``.

On CPU the same file runs the reference ops and the interpreted Triton ops at tiny sizes
(a smoke test). Results go to ``benchmarks/results/kernels-<device>.{json,md}`` when
``DEEPINFER_BENCH_SAVE=1``, to ``$DEEPINFER_BENCH_OUT`` when set (scripts/gpu_ci.sh sets
it to its results folder), else to a temporary directory.

    DEEPINFER_BENCH_SAVE=1 python -m pytest benchmarks/bench_kernels.py -q -s
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from results_meta import git_commit, table_lines, utc_now

import deepinfer_kernels
from deepinfer_kernels import reference
from deepinfer_kernels.kv_quant import KV_GROUP, kv_row_width

IS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
SAVE = os.environ.get("DEEPINFER_BENCH_SAVE") == "1"
OUT = os.environ.get("DEEPINFER_BENCH_OUT")
FLEX = IS_CUDA and os.environ.get("DEEPINFER_BENCH_FLEX", "1") != "0"
RESULTS_DIR = Path(__file__).resolve().parent / "results"

try:  # pytest-benchmark is a dev dependency; keep the file usable without it.
    import pytest_benchmark  # noqa: F401
except ImportError:  # pragma: no cover

    @pytest.fixture
    def benchmark():
        return lambda fn, *a, **k: fn(*a, **k)


try:
    from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "no baseline"
    flash_attn_with_kvcache = None

_ROWS: list[dict] = []

# Model shape of the decode/prefill grids (Llama-3-8B-like attention).
HQ, HKV, D, BS = (32, 8, 128, 16) if IS_CUDA else (4, 2, 64, 16)
DTYPE = torch.bfloat16 if IS_CUDA else torch.float32


def _time_ms(fn: Callable[[], object]) -> float:
    """Median kernel time in ms: do_bench on CUDA, wall clock (3 runs) on CPU."""
    if IS_CUDA:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _record(op: str, case: str, impl: str, ms: float, *, gbytes: float | None = None,
            tflop: float | None = None, baseline_of: str | None = None) -> dict:
    row = {"op": op, "case": case, "impl": impl, "ms": round(ms, 4)}
    if gbytes is not None:
        row["GB/s"] = round(gbytes / (ms * 1e-3), 1)
    if tflop is not None:
        row["TFLOP/s"] = round(tflop / (ms * 1e-3), 2)
    _ROWS.append(row)
    return row


def _add_ratios() -> None:
    """speedup = baseline time / triton time, per (op, case)."""
    triton_ms = {(r["op"], r["case"]): r["ms"] for r in _ROWS if r["impl"] == "triton"}
    for r in _ROWS:
        base = triton_ms.get((r["op"], r["case"]))
        if base and r["impl"] != "triton":
            r["triton_speedup"] = round(r["ms"] / base, 3)


def _fits(nbytes: int, fraction: float = 0.4) -> bool:
    if not IS_CUDA:
        return True
    free, _ = torch.cuda.mem_get_info()
    return nbytes < fraction * free


def _paged(batch: int, ctx: int, block_size: int = BS):
    """Random cache with shuffled blocks: (k_cache, v_cache, block_tables, seq_lens)."""
    nblk = batch * (ctx // block_size)
    shape = (nblk, block_size, HKV, D)
    k_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE)
    perm = torch.randperm(nblk, device=DEVICE).to(torch.int32)
    tables = perm.view(batch, ctx // block_size)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, tables, lens


def _int8_like(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache (``kv_quant`` layout) of ``cache``'s shape: random codes and scales
    (no float temporaries: the largest cases hold tens of GB of KV)."""
    *lead, d = cache.shape
    codes = torch.randint(-127, 128, (*lead, d), dtype=torch.int8, device=cache.device)
    scales = torch.rand((*lead, d // KV_GROUP), device=cache.device) * 0.02 + 1e-3
    return torch.cat([codes, scales.view(torch.int8)], dim=-1)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[B, ctx, Hkv, D] contiguous copy of each sequence's cached tokens."""
    b = tables.shape[0]
    return cache[tables.long()].reshape(b, -1, cache.shape[2], cache.shape[3])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str | None):
    """Best-effort SDPA call (flash backend first). q/k/v are [B, H, L, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kwargs: dict = {}
    if causal == "top_left":
        kwargs["is_causal"] = True
    elif causal == "bottom_right":
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(q.shape[2], k.shape[2])
    if k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    for backends in ([SDPBackend.FLASH_ATTENTION], None):
        try:
            if backends is None:
                fn = lambda: sdpa(q, k, v, **kwargs)  # noqa: E731
            else:
                def fn(backends=backends):
                    with sdpa_kernel(backends):
                        return sdpa(q, k, v, **kwargs)
            fn()
            return fn, "sdpa-flash" if backends else "sdpa-default"
        except Exception:  # noqa: BLE001 - backend refused the inputs; try the next one
            continue
    return None, None


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor):
    """flash_attn_with_kvcache over 256-token pages of the gathered [B, L, Hkv, D] data."""
    if flash_attn_with_kvcache is None or k.shape[1] % 256:
        return None
    b, length = k.shape[0], k.shape[1]
    kp = k.reshape(-1, 256, HKV, D)
    vp = v.reshape(-1, 256, HKV, D)
    table = torch.arange(kp.shape[0], device=DEVICE, dtype=torch.int32).view(b, length // 256)
    try:
        fn = lambda: flash_attn_with_kvcache(  # noqa: E731
            q, kp, vp, cache_seqlens=lens, block_table=table, causal=True)
        fn()
        return fn
    except Exception:  # noqa: BLE001
        return None


_FLEX_COMPILED: Callable | None = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """FlexAttention on [B, H, L, D] tensors (CUDA only), or None where it is unavailable.

    ``causal``: query i sees keys up to ``i + Lk - Lq`` (bottom-right aligned, so a cached
    prefix is visible to every query, as in the paged kernel). Compiled once per shape:
    eager flex_attention materializes the scores, so it is never a fair baseline.
    """
    global _FLEX_COMPILED
    if not FLEX:
        return None
    try:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if _FLEX_COMPILED is None:
        # One recompile per benchmarked shape; past the limit dynamo would fall back to
        # the eager (score-materializing) implementation.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, max(64, getattr(dynamo_config, knob)))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    lq, lk = q.shape[2], k.shape[2]
    block_mask = None
    if causal:
        offset = lk - lq

        def bottom_right(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(bottom_right, None, None, lq, lk, device=q.device)
    gqa = k.shape[1] != q.shape[1]
    compiled = _FLEX_COMPILED
    try:
        fn = lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)  # noqa: E731
        fn()
        return fn
    except Exception:  # noqa: BLE001 - this torch's flex cannot run the case: no baseline
        return None


DECODE_GRID = (
    [(b, c) for b in (1, 16, 64, 256) for c in (512, 4096, 32768)] if IS_CUDA
    else [(1, 64), (2, 48)]
)


# Flex compiles per shape (seconds each): a few representative cases, not the whole grid.
FLEX_DECODE = {(16, 4096), (64, 4096)}
FLEX_PREFILL = {(4, 2048, 0.0), (4, 2048, 0.5), (16, 512, 0.0)}


@pytest.mark.parametrize("batch, ctx", DECODE_GRID)
def test_bench_decode(benchmark, batch, ctx):
    kv_bytes = 2 * batch * ctx * HKV * D * torch.finfo(DTYPE).bits // 8
    if not _fits(kv_bytes):
        pytest.skip(f"KV cache of {kv_bytes / 2**30:.1f} GiB does not fit")
    k_cache, v_cache, tables, lens = _paged(batch, ctx)
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEVICE)
    out = torch.empty_like(q)
    case = f"B={batch} ctx={ctx}"
    gbytes = (kv_bytes + 2 * q.numel() * q.element_size()) / 1e9

    def run():
        return deepinfer_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, out=out,
                                              max_seq_len=ctx)

    _record("decode", case, "triton", _time_ms(run), gbytes=gbytes)
    int8_bytes = kv_bytes * kv_row_width(D, "int8") // (D * torch.finfo(DTYPE).bits // 8)
    if _fits(kv_bytes + int8_bytes):
        kq, vq = _int8_like(k_cache), _int8_like(v_cache)
        _record("decode", case, "triton int8", _time_ms(
            lambda: deepinfer_kernels.paged_decode_attention(q, kq, vq, tables, lens, out=out,
                                                             max_seq_len=ctx)),
            gbytes=(int8_bytes + 2 * q.numel() * q.element_size()) / 1e9)
        del kq, vq
    if not IS_CUDA:
        _record("decode", case, "reference", _time_ms(
            lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)),
            gbytes=gbytes)
    elif _fits(2 * kv_bytes):
        k, v = _gather(k_cache, tables), _gather(v_cache, tables)
        fn, name = _sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), None)
        if fn is not None:
            _record("decode", case, name, _time_ms(fn), gbytes=gbytes)
        fa = _flash_attn(q[:, None], k, v, lens)
        if fa is not None:
            _record("decode", case, "flash-attn", _time_ms(fa), gbytes=gbytes)
        if (batch, ctx) in FLEX_DECODE:
            fx = _flex(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), causal=False)
            if fx is not None:
                _record("decode", case, "flex", _time_ms(fx), gbytes=gbytes)
        del k, v
    benchmark(run)


@pytest.mark.parametrize("splits", ["auto", 1])
def test_bench_decode_split(benchmark, splits):
    ctx = 32768 if IS_CUDA else 256
    k_cache, v_cache, tables, lens = _paged(1, ctx)
    q = torch.randn(1, HQ, D, dtype=DTYPE, device=DEVICE)
    gbytes = 2 * k_cache.numel() * k_cache.element_size() / 1e9
    num_splits = None if splits == "auto" else splits

    def run():
        return deepinfer_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                              num_splits=num_splits, max_seq_len=ctx)

    _record("decode-split", f"B=1 ctx={ctx}", f"triton splits={splits}", _time_ms(run),
            gbytes=gbytes)
    benchmark(run)


PREFILL_GRID = (
    [(n, s, p) for n, s in ((1, 512), (1, 8192), (4, 2048), (16, 512), (16, 8192))
     for p in (0.0, 0.5)] if IS_CUDA
    else [(1, 64, 0.0), (2, 32, 0.5)]
)


@pytest.mark.parametrize("num_seqs, seq_len, cached", PREFILL_GRID)
def test_bench_prefill(benchmark, num_seqs, seq_len, cached):
    k_cache, v_cache, tables, lens = _paged(num_seqs, seq_len)
    prefix = int(seq_len * cached)
    q_len = seq_len - prefix
    q = torch.randn(num_seqs * q_len, HQ, D, dtype=DTYPE, device=DEVICE)
    qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * q_len
    out = torch.empty_like(q)
    visible = q_len * prefix + q_len * (q_len + 1) // 2  # causal (query, key) pairs per seq
    tflop = 4 * D * HQ * visible * num_seqs / 1e12
    case = f"{num_seqs}x{seq_len} cached={int(cached * 100)}%"

    def run():
        return deepinfer_kernels.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens,
                                               out=out, max_query_len=q_len)

    _record("prefill", case, "triton", _time_ms(run), tflop=tflop)
    if not IS_CUDA:
        _record("prefill", case, "reference", _time_ms(
            lambda: reference.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens)),
            tflop=tflop)
    else:
        k, v = _gather(k_cache, tables), _gather(v_cache, tables)
        qb = q.view(num_seqs, q_len, HQ, D)
        fn, name = _sdpa(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         "top_left" if prefix == 0 else "bottom_right")
        if fn is not None:
            _record("prefill", case, name, _time_ms(fn), tflop=tflop)
        fa = _flash_attn(qb, k, v, lens)
        if fa is not None:
            _record("prefill", case, "flash-attn", _time_ms(fa), tflop=tflop)
        if (num_seqs, seq_len, cached) in FLEX_PREFILL:
            fx = _flex(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            if fx is not None:
                _record("prefill", case, "flex", _time_ms(fx), tflop=tflop)
        del k, v
    benchmark(run)


def test_bench_clone_blocks(benchmark):
    layers, nblk, npairs = (32, 4096, 1024) if IS_CUDA else (2, 64, 16)
    cache = torch.randn(layers, 2, nblk, BS, HKV, D, dtype=DTYPE, device=DEVICE)
    perm = torch.randperm(nblk, device=DEVICE)
    pairs = torch.stack([perm[:npairs], perm[npairs: 2 * npairs]], dim=1)
    block_bytes = BS * HKV * D * cache.element_size()
    gbytes = 2 * npairs * layers * 2 * block_bytes / 1e9  # read + write
    case = f"{npairs} pairs x {layers} layers"
    run = lambda: deepinfer_kernels.clone_blocks(cache, pairs)  # noqa: E731
    _record("clone_blocks", case, "triton", _time_ms(run), gbytes=gbytes)
    _record("clone_blocks", case, "torch-index", _time_ms(
        lambda: reference.clone_blocks(cache, pairs)), gbytes=gbytes)
    benchmark(run)


def test_bench_copy_bandwidth(benchmark):
    nbytes = (1 << 30) if IS_CUDA else (1 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    run = lambda: dst.copy_(src)  # noqa: E731
    _record("copy", f"{nbytes >> 20} MiB", "torch-copy_", _time_ms(run),
            gbytes=2 * nbytes / 1e9)
    benchmark(run)


def _markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["op", "case", "impl", "ms", "GB/s", "TFLOP/s", "triton_speedup"]
    lines = [f"# Kernel benchmarks: {meta['device']}", "",
             f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, "
             f"triton {meta['triton']}, dtype {meta['dtype']}, "
             f"heads {meta['heads']}, block {meta['block_size']}", "",
             "triton_speedup = baseline ms / triton ms (> 1: Triton faster).", ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", autouse=True)
def _write_results(tmp_path_factory):
    yield
    if not _ROWS:
        return
    _add_ratios()
    import triton

    name = torch.cuda.get_device_name() if IS_CUDA else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    meta = {
        "device": name, "commit": git_commit(),
        "date": utc_now(),
        "torch": torch.__version__, "triton": triton.__version__,
        "dtype": str(DTYPE).replace("torch.", ""), "heads": f"{HQ}q/{HKV}kv x {D}",
        "block_size": BS, "flash_attn": flash_attn_with_kvcache is not None,
        "flex": FLEX,
    }
    out_dir = (Path(OUT) if OUT else RESULTS_DIR if SAVE
               else tmp_path_factory.mktemp("bench_kernels"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernels-{slug}.json").write_text(
        json.dumps({"meta": meta, "results": _ROWS}, indent=2) + "\n")
    md = _markdown(meta, _ROWS)
    (out_dir / f"kernels-{slug}.md").write_text(md)
    print(f"\n{md}\nresults written to {out_dir}")
