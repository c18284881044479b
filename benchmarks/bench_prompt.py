"""Prompt processing (prefill) speed against llama.cpp, on the same GGUF file, in the
same run.

    LLAMACPP_PYTHON=/path/to/venv/bin/python python benchmarks/bench_prompt.py --save

Per prompt length (``--lengths``, default 128, 512, 1024 tokens), one prompt of random
token ids (BOS first), ``--reps`` times, each time new ids:

- deepinfer: ``LLM(model)`` with its defaults (``quantization="auto"``, dtype auto; no
  prefix caching, so no rep reuses another's blocks), ``generate`` of one token: the
  prompt's prefill and the first token's draw;
- llama.cpp (``benchmarks/peer_llamacpp.py`` under ``$LLAMACPP_PYTHON``; skipped with a
  note when unset): the same ids, its prompt evaluation (``n_batch`` 512: the prompt in
  512-token chunks) and the first token's draw, KV cache cleared each rep.

Reported: prompt tok/s of each (prompt tokens / median seconds) and their ratio; and for
deepinfer alone ``--batch`` prompts of the middle length together (its batched prefill,
which llama.cpp's single-sequence loop has no counterpart for). ``--save`` writes
``benchmarks/results/prompt-cpu[-TAG].{json,md}``. The ``test_`` function at the bottom
runs a tiny case through the deepinfer side (sanity, never timing).
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
from pathlib import Path

import torch
from results_meta import git_commit, header_lines, table_lines, utc_now, vector_isa

HERE = Path(__file__).resolve().parent


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` ids: BOS (1) then random ids past the special ones."""
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist()
            for _ in range(num)]


def deepinfer_seconds(llm, num: int, length: int, reps: int) -> float:
    """Median seconds to prefill ``num`` new prompts of ``length`` tokens together and draw
    each one's first token (fresh ids every rep)."""
    from deepinfer import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(random_prompts(num, length, vocab, seed=10_000), sp, use_tqdm=False)
    times = []
    for rep in range(reps):
        prompts = random_prompts(num, length, vocab, seed=rep)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def llamacpp_prompt(model_path: str, ids: list[int], reps: int) -> dict | None:
    """llama.cpp's prompt evaluation of ``ids`` (its JSON line), or None when
    $LLAMACPP_PYTHON is unset."""
    python = os.environ.get("LLAMACPP_PYTHON")
    if not python:
        return None
    cmd = [python, str(HERE / "peer_llamacpp.py"), "--model", model_path,
           "--prompt-tokens", ",".join(map(str, ids)), "--max-tokens", "2",
           "--threads", str(torch.get_num_threads()), "--reps", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--batch", type=int, default=16,
                    help="deepinfer's batched prefill: prompts together (0: none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--tag", default="", help="suffix of the results files")
    a = ap.parse_args(argv)
    from deepinfer import LLM
    from deepinfer.loading.loader import resolve_model_path

    path = resolve_model_path(a.model)
    lengths = [int(n) for n in a.lengths.split(",")]
    llm = LLM(a.model, device="cpu", enable_prefix_caching=False)
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    rows, raw = [], []
    if os.environ.get("LLAMACPP_PYTHON") is None:
        print("llama.cpp: skipped (set LLAMACPP_PYTHON to a venv python with "
              "llama-cpp-python)", flush=True)
    for length in lengths:
        ours = length / deepinfer_seconds(llm, 1, length, a.reps)
        vocab = llm.engine.model_config.vocab_size
        peer = llamacpp_prompt(path, random_prompts(1, length, vocab, seed=99)[0], a.reps)
        row = {"prompt tokens": length, "deepinfer tok/s": round(ours, 1)}
        if peer is not None:
            raw.append(peer)
            row["llama.cpp tok/s"] = round(float(peer["prompt_tok_s"]), 1)
            row["deepinfer / llama.cpp"] = round(ours / float(peer["prompt_tok_s"]), 2)
        rows.append(row)
        print(row, flush=True)
    batched = None
    if a.batch:
        mid = lengths[len(lengths) // 2]
        secs = deepinfer_seconds(llm, a.batch, mid, a.reps)
        batched = {"prompts": a.batch, "prompt tokens": mid,
                   "deepinfer tok/s": round(a.batch * mid / secs, 1)}
        print(batched, flush=True)
    llm.close()
    if a.save:
        _save(a, path, dtype, rows, batched, raw)


def _save(a: argparse.Namespace, path: str, dtype: str, rows: list[dict],
          batched: dict | None, raw: list[dict]) -> None:
    meta = {"device": f"CPU ({platform.processor() or platform.machine()}, "
                      f"{vector_isa()}, {torch.get_num_threads()} threads)",
            "commit": git_commit(), "date": utc_now(), "torch": torch.__version__,
            "triton": "n/a", "model": os.path.basename(path), "dtype": dtype}
    stem = "prompt-cpu" + (f"-{a.tag}" if a.tag else "")
    out = HERE / "results"
    (out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "batched": batched, "llamacpp": raw}, indent=1) + "\n")
    flags = f" --tag {a.tag}" if a.tag else ""
    lines = header_lines("Prompt processing against llama.cpp", meta,
                         f"{meta['model']}, deepinfer {dtype}, random ids, medians of "
                         f"{a.reps}, `python benchmarks/bench_prompt.py --save{flags}`")
    lines += table_lines(list(rows[0]), rows) + [""]
    if raw:
        lines += [f"llama.cpp: llama-cpp-python {raw[0].get('llama_cpp_python', '?')}, "
                  f"n_batch {raw[0].get('settings', {}).get('n_batch', '?')}.", ""]
    if batched:
        lines += [f"deepinfer, {batched['prompts']} prompts of {batched['prompt tokens']} "
                  f"tokens together: {batched['deepinfer tok/s']} tok/s.", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print(f"wrote {out / f'{stem}.md'}")


def test_prompt_rate_runs_tiny():
    from deepinfer import LLM

    llm = LLM(None, device="cpu", enable_prefix_caching=False)
    try:
        assert deepinfer_seconds(llm, 2, 8, reps=1) > 0
        ids = random_prompts(2, 8, llm.engine.model_config.vocab_size, seed=0)
        assert len(ids) == 2 and all(len(p) == 8 and p[0] == 1 for p in ids)
    finally:
        llm.close()


if __name__ == "__main__":
    sys.exit(main())
