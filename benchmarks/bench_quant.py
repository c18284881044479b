"""GGUF weights kept as blocks (``quantization="auto"``) vs dequantized at load
(``"none"``), and llama.cpp on the same file, in the same run (issue 25).

    python benchmarks/bench_quant.py                       # kernels + end to end, CPU
    LLAMACPP_PYTHON=/path/to/venv/bin/python python benchmarks/bench_quant.py --save

Parts, each measured here, now:

1. copy bandwidth: a 256 MB ``torch`` copy, counted as bytes read per second (what a
   decode step that reads every weight once is bound by);
2. per block type, a 12288 x 2304 weight (the issue's shape): ``x @ W.T`` at M = 1, 16
   and 128 rows on the blocks (``deepinfer_kernels.cpu_gguf``; for the types it takes
   also repacked in row groups, ``cpu_gguf_rows16``, the path bf16 models take) against
   ``F.linear`` on the dequantized weight in bf16 and fp32; effective GB/s of the
   quantized bytes by the faster bf16-x path;
3. end to end on the default model (SmolLM2-135M-Instruct Q4_1, one chat prompt, greedy,
   128 tokens): single-stream decode tok/s of ``auto`` and ``none`` (dtype auto), the
   weight bytes read per token and their floor at the copy bandwidth;
4. llama.cpp (``benchmarks/peer_llamacpp.py``, run by ``$LLAMACPP_PYTHON``; skipped with
   a note when unset) on the same file and prompt: its decode tok/s;
5. batched: 128 requests (budgets 16-128, ``ignore_eos``) through ``auto`` and ``none``;
6. decode steps by batch size (``--scan``): ms per step of 1-64 sequences together,
   ``auto`` and ``none``.

Decode tok/s is (128 - 1) / (t(128 tokens) - t(1 token)): the prefill and the first token
are taken out, as llama.cpp's own decode figure does. Medians of ``--reps``.
``--save`` writes ``benchmarks/results/quant-cpu.{json,md}`` (with ``--model``:
``quant-cpu-<file name>.{json,md}``). The ``test_`` functions at
the bottom run tiny sizes so the suite exercises this file (sanity, never timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from results_meta import git_commit, header_lines, table_lines, utc_now, vector_isa

HERE = Path(__file__).resolve().parent
PROMPT = "Write a short story about a robot."
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
TYPE_IDS = dict(zip(TYPES, (8, 2, 3, 6, 7, 12, 13, 14), strict=True))


def seconds(fn: Callable[[], object], reps: int, min_time: float = 0.2) -> float:
    """Median seconds per call of ``fn`` over ``reps`` rounds of enough calls to last
    ``min_time`` (after a warm-up call)."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def copy_bandwidth(mbytes: int = 256, reps: int = 5) -> float:
    """Bytes read per second by a ``mbytes`` MB tensor copy."""
    src = torch.ones(mbytes << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    return src.numel() * 4 / seconds(lambda: dst.copy_(src), reps)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[n, row_bytes]`` blocks of ``qtype`` with small finite fp16 scales (random
    payload bytes: the kernels' speed does not depend on the values)."""
    from deepinfer_kernels.gguf_blocks import block_format

    fmt = block_format(TYPE_IDS[qtype])
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * k // fmt.block_weights, fmt.block_bytes),
                        dtype=torch.uint8, generator=g)
    scale = torch.tensor([0x2C00], dtype=torch.int16).view(torch.uint8)  # fp16 2^-4
    fields = {"Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,)}.get(qtype, (0, 2))
    for at in fields:
        raw[:, at:at + 2] = scale
    return raw.reshape(n, -1)


def kernel_rows(n: int, k: int, ms: list[int], reps: int, bandwidth: float,
                min_time: float = 0.2) -> list[dict]:
    """Per type and M: ms per call on blocks vs dequantized bf16 / fp32 weights."""
    from deepinfer_kernels import cpu_gguf, cpu_gguf_rows16

    rows = []
    for qtype in TYPES:
        blocks = random_blocks(qtype, n, k)
        matmul = cpu_gguf.bind_gguf_matmul(blocks, TYPE_IDS[qtype])
        grouped = None  # the row-group int8 kernel, where it takes the type
        if cpu_gguf_rows16.rows16_usable(blocks, TYPE_IDS[qtype]):
            packed = blocks.clone()
            cpu_gguf_rows16.pack_rows16(packed, TYPE_IDS[qtype])
            grouped = cpu_gguf_rows16.bind_rows16_matmul(packed, TYPE_IDS[qtype])
        w32 = cpu_gguf.dequantize_gguf(blocks, TYPE_IDS[qtype])
        w16 = w32.to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k)
            x16 = x.to(torch.bfloat16)
            tq = seconds(lambda x=x, f=matmul: f(x), reps, min_time)
            tq16 = seconds(lambda x=x16, f=matmul: f(x), reps, min_time)
            tg = (None if grouped is None
                  else seconds(lambda x=x16, f=grouped: f(x), reps, min_time))
            t16 = seconds(lambda x=x16, w=w16: F.linear(x, w), reps, min_time)
            t32 = seconds(lambda x=x, w=w32: F.linear(x, w), reps, min_time)
            best16 = tq16 if tg is None else min(tq16, tg)  # decode's path: bf16 x
            gbs = blocks.numel() / best16 / 1e9
            rows.append({
                "type": qtype, "M": m, "blocks fp32 x ms": round(tq * 1e3, 3),
                "blocks bf16 x ms": round(tq16 * 1e3, 3),
                "row groups bf16 x ms": "" if tg is None else round(tg * 1e3, 3),
                "bf16 ms": round(t16 * 1e3, 3),
                "fp32 ms": round(t32 * 1e3, 3), "bf16 x GB/s (best)": round(gbs, 1),
                "of copy bw": f"{gbs * 1e9 / bandwidth:.0%}"})
            print(rows[-1], flush=True)
    return rows


def decode_rate(llm, prompt: str, tokens: int, reps: int) -> float:
    """Single-stream greedy decode tok/s: (tokens - 1) / (t(tokens) - t(1))."""
    from deepinfer import SamplingParams

    chat = [{"role": "user", "content": prompt}]

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.chat(chat, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(tokens)  # warm-up
    return statistics.median((tokens - 1) / (run(tokens) - run(1)) for _ in range(reps))


def batched_rate(llm, num: int, seed: int = 0) -> float:
    """Generated tok/s for ``num`` random-token prompts (16-128 tokens in and out)."""
    from deepinfer import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    lens = torch.randint(16, 129, (num, 2), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (a,), generator=g).tolist() for a, _ in lens]
    params = [SamplingParams(temperature=0.0, max_tokens=b, ignore_eos=True) for _, b in lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def step_ms(llm, num: int, tokens: int = 32, seed: int = 0) -> float:
    """ms per decode step of ``num`` sequences together (32-token random prompts):
    (t(tokens + 1) - t(1)) / tokens, greedy, ``ignore_eos``."""
    from deepinfer import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(num)]

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return (run(tokens + 1) - run(1)) / tokens * 1e3


def scan_rows(scan: dict[str, dict[int, float]]) -> list[dict]:
    """Per batch size: ms per decode step and tok/s of each mode, and auto / none."""
    rows = []
    for num in scan["auto"]:
        a, b = scan["auto"][num], scan["none"][num]
        rows.append({"sequences": num, "auto ms/step": round(a, 2),
                     "none ms/step": round(b, 2), "auto tok/s": round(num * 1e3 / a, 1),
                     "none tok/s": round(num * 1e3 / b, 1),
                     "auto speed / none": round(b / a, 2)})
    return rows


def engine_rows(model: str | None, tokens: int, reps: int, batch: int,
                bandwidth: float, scan: list[int] = ()) -> tuple[list[dict], list[dict]]:
    """The end-to-end rows of ``auto`` and ``none``, and the decode-step scan over the
    batch sizes ``scan`` (both modes, each loaded once)."""
    from deepinfer import LLM

    rows, steps = [], {}
    for mode in ("auto", "none"):
        t0 = time.perf_counter()
        llm = LLM(model, device="cpu", quantization=mode, kv_cache_memory=256 << 20)
        startup = time.perf_counter() - t0
        rate = decode_rate(llm, PROMPT, tokens, reps)
        # A decode step reads every weight once, except that the embedding gives one row.
        read = llm.weight_bytes
        row = {"engine": f"deepinfer quantization={mode} ({llm.engine.dtype})".replace(
            "torch.", ""), "decode tok/s": round(rate, 1),
            "MB read / token": round(read / 1e6, 1),
            "floor tok/s": round(bandwidth / read, 1), "LLM() s": round(startup, 2)}
        if batch:
            row[f"{batch} requests tok/s"] = round(batched_rate(llm, batch), 1)
        rows.append(row)
        print(row, flush=True)
        steps[mode] = {num: statistics.median(step_ms(llm, num) for _ in range(reps))
                       for num in scan}
        print(mode, "ms/step", steps[mode], flush=True)
        llm.close()
        del llm
    return rows, scan_rows(steps) if scan else []


def llamacpp_row(model_path: str, tokens: int, reps: int) -> dict | None:
    """llama.cpp's decode tok/s on the same file, or None when $LLAMACPP_PYTHON is unset."""
    python = os.environ.get("LLAMACPP_PYTHON")
    if not python:
        print("llama.cpp: skipped (set LLAMACPP_PYTHON to a venv python with "
              "llama-cpp-python)", flush=True)
        return None
    cmd = [python, str(HERE / "peer_llamacpp.py"), "--model", model_path, "--prompt", PROMPT,
           "--max-tokens", str(tokens), "--threads", str(torch.get_num_threads()),
           "--reps", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    settings = res.get("settings", {})
    row = {"engine": f"llama.cpp (llama-cpp-python {res.get('llama_cpp_python', '?')}, "
                     f"n_batch {settings.get('n_batch', '?')})",
           "decode tok/s": round(float(res["decode_tok_s"]), 1)}
    print(row, flush=True)
    return {**row, "raw": res}


_OPS = ("add_rms_norm", "rms_norm", "rotary_qk", "silu_and_mul", "store_kv",
        "paged_decode_attention")


def breakdown(model: str | None, tokens: int, quantization: str = "auto") -> dict[str, float]:
    """ms per decoded token, by part: each linear layer kind, the head, the embedding, the
    backend's ops, and the rest of the step (sampling, scheduling, Python glue). Timers
    wrap the calls (~0.2 us each), the rest is the step time minus the parts."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, device="cpu", quantization=quantization, kv_cache_memory=256 << 20)
    m = llm.engine.model
    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable) -> Callable:
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return run

    for name, mod in m.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            mod.forward = timed(f"matmul {kind}", mod.forward)
    emb = m.model.embed_tokens
    emb.attend = timed("matmul lm_head", emb.attend)
    emb.lookup = timed("embedding rows", emb.lookup)
    backend = llm.engine.backend
    saved = {op: getattr(backend, op) for op in (*_OPS, "bind_decoder_stack")}
    for op in _OPS:
        setattr(backend, op, timed(op, saved[op]))

    def bind_timed(spec):  # the fused decode step, where the backend has one
        fn = saved["bind_decoder_stack"](spec)
        return None if fn is None else timed("decoder layers (one fused call)", fn)

    backend.bind_decoder_stack = bind_timed
    m.decoder_stack.reset()
    chat = [{"role": "user", "content": PROMPT}]
    try:
        llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        parts = []
        for n in (1, tokens):
            spent.clear()
            t0 = time.perf_counter()
            llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
            parts.append((time.perf_counter() - t0, dict(spent)))
    finally:
        for op, fn in saved.items():
            setattr(backend, op, fn)
        m.decoder_stack.reset()
    (t1, s1), (tn, sn) = parts
    per = {k: (sn.get(k, 0.0) - s1.get(k, 0.0)) / (tokens - 1) * 1e3 for k in sn}
    per["step total"] = (tn - t1) / (tokens - 1) * 1e3
    per["rest (sampling, scheduling, glue)"] = per["step total"] - sum(
        v for k, v in per.items() if k != "step total")
    llm.close()
    return {k: round(v, 3) for k, v in per.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="0: no batched run")
    ap.add_argument("--shape", default="12288x2304", help="N x K of the kernel rows")
    ap.add_argument("--ms", default="1,16,128")
    ap.add_argument("--scan", default="1,2,4,8,16,32,64",
                    help="batch sizes of the decode-step scan ('' for none)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--tag", default="",
                    help="appended to the results file's name (e.g. avx2: another CPU class)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the per-token breakdown of single-stream decode (ms)")
    a = ap.parse_args(argv)
    if a.breakdown:
        for mode in ("auto", "none"):
            print(mode, json.dumps(breakdown(a.model, a.tokens, mode), indent=1))
        return
    from deepinfer.loading.loader import resolve_model_path

    path = resolve_model_path(a.model)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s read", flush=True)
    n, k = (int(s) for s in a.shape.split("x"))
    kernels = [] if a.no_kernels else kernel_rows(n, k, [int(m) for m in a.ms.split(",")],
                                                  a.reps, bandwidth)
    engines, scan = engine_rows(a.model, a.tokens, a.reps, a.batch, bandwidth,
                                [int(b) for b in a.scan.split(",") if b])
    peer = llamacpp_row(path, a.tokens, a.reps)
    parts = {mode: breakdown(a.model, a.tokens, mode) for mode in ("auto", "none")}
    print(json.dumps(parts), flush=True)
    if peer is not None:
        engines.append({c: v for c, v in peer.items() if c != "raw"})
    meta = {"device": f"CPU ({platform.processor() or platform.machine()}, "
                      f"{torch.get_num_threads()} threads)", "commit": git_commit(),
            "date": utc_now(), "torch": torch.__version__, "triton": "n/a",
            "model": os.path.basename(path), "copy_gb_s": round(bandwidth / 1e9, 2),
            "vector_isa": vector_isa()}
    if a.save:
        stem = "quant-cpu" if a.model is None else (
            "quant-cpu-" + os.path.basename(a.model).removesuffix(".gguf"))
        stem += f"-{a.tag}" if a.tag else ""
        _save(meta, kernels, engines, peer, parts, n, k, scan, stem)


def _save(meta: dict, kernels: list[dict], engines: list[dict], peer: dict | None,
          parts: dict[str, dict[str, float]], n: int, k: int, scan: list[dict],
          stem: str = "quant-cpu") -> None:
    out = HERE / "results"
    (out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "kernels": kernels, "engines": engines, "breakdown_ms": parts,
         "decode_steps": scan, "llamacpp": peer and peer["raw"]}, indent=1) + "\n")
    lines = header_lines("GGUF weights kept quantized", meta,
                         f"{meta['model']}, copy bandwidth {meta['copy_gb_s']} GB/s read, "
                         f"{meta['vector_isa']}")
    lines += ["## End to end (single stream, 128 tokens, greedy)", ""]
    cols = sorted({c for r in engines for c in r}, key=lambda c: list(engines[0]).index(c)
                  if c in engines[0] else 99)
    lines += table_lines(cols, engines) + [""]
    if scan:
        lines += ["## Decode steps by batch size (32-token prompts, 32 steps, greedy)", ""]
        lines += table_lines(list(scan[0]), scan) + [""]
    lines += ["## Single-stream decode, ms per token by part", ""]
    rows = [{"part": p, **{mode: parts[mode].get(p, "") for mode in parts}}
            for p in parts["auto"]]
    lines += table_lines(["part", *parts], rows) + [""]
    if kernels:
        lines += [f"## Kernels: {n} x {k} weight, ms per call", ""]
        lines += table_lines(list(kernels[0]), kernels) + [""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print(f"wrote {out / f'{stem}.md'}")


# ------------------------------------------------------------------ sanity (suite)
def test_breakdown_names_every_part():
    parts = breakdown(None, tokens=3)
    # Decode steps go through the fused stack; the prompt step runs layer by layer.
    assert {"matmul qkv_proj", "matmul lm_head", "decoder layers (one fused call)",
            "rest (sampling, scheduling, glue)"} <= set(parts)
    assert parts["step total"] > 0


def test_kernel_rows_and_blocks_run_tiny():
    rows = kernel_rows(64, 256, [1, 40], reps=1, bandwidth=1e9, min_time=0.0)
    assert len(rows) == 2 * len(TYPES) and all(r["blocks fp32 x ms"] > 0 for r in rows)


if __name__ == "__main__":
    sys.exit(main())
