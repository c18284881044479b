"""End-to-end offline throughput: deepinfer vs Hugging Face transformers, same run.

A nano-vllm-style workload: random prompt token ids and output budgets drawn from a seed,
``ignore_eos`` so every request generates exactly what it asked for. transformers runs
batched ``generate`` (left padding, greedy) over the same prompts; only the tokens each
request asked for are counted for it, so padding and over-generation cost it time but
earn nothing.

    python benchmarks/bench_throughput.py                      # CPU scale (64 requests)
    python benchmarks/bench_throughput.py --num-requests 256 --min-len 100 --max-len 1024
    python benchmarks/bench_throughput.py --no-hf              # deepinfer only

The test at the bottom runs a tiny workload so the suite exercises this file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


def make_workload(num_requests: int, min_len: int, max_len: int, vocab: int,
                  seed: int) -> Workload:
    """Random prompt ids in ``[min_len, max_len]`` and output budgets in the same range."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    outs = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return Workload(prompts, outs)


def run_deepinfer(llm, wl: Workload) -> tuple[float, int]:
    """Seconds and generated tokens for the whole workload through ``LLM.generate``."""
    from deepinfer import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in wl.max_tokens]
    llm.generate([wl.prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, tokens


def run_hf(model, wl: Workload, batch_size: int, pad_id: int) -> tuple[float, int]:
    """Batched greedy ``generate``; a batch runs to its longest budget."""
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    counted = 0
    t0 = time.perf_counter()
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = wl.prompts[i]
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        budget = max(wl.max_tokens[i] for i in idx)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=budget,
                           min_new_tokens=budget, do_sample=False, pad_token_id=pad_id)
        counted += sum(wl.max_tokens[i] for i in idx)
    return time.perf_counter() - t0, counted


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=RESULTS).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict:
    from deepinfer import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_model_len=2 * args.max_len + 16)
    vocab = llm.engine.model_config.vocab_size
    wl = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    ours_s, ours_tok = run_deepinfer(llm, wl)
    result = {
        "device": (torch.cuda.get_device_name() if llm.engine.device.type == "cuda"
                   else platform.processor() or platform.machine()),
        "device_type": llm.engine.device.type,
        "threads": torch.get_num_threads(),
        "commit": _git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "dtype": str(llm.engine.dtype),
        "num_requests": args.num_requests, "len_range": [args.min_len, args.max_len],
        "deepinfer": {"seconds": ours_s, "tokens": ours_tok, "tok_per_s": ours_tok / ours_s},
    }
    if not args.no_hf:
        hf = load_hf_model(llm.engine.model_path, llm.engine.dtype, llm.engine.device)
        pad = llm.engine.model_config.eos_token_ids[0]
        hf_s, hf_tok = run_hf(hf, wl, args.hf_batch_size, pad)
        result["transformers"] = {"seconds": hf_s, "tokens": hf_tok,
                                  "tok_per_s": hf_tok / hf_s, "batch_size": args.hf_batch_size}
        result["speedup"] = result["deepinfer"]["tok_per_s"] / result["transformers"]["tok_per_s"]
    return result


def load_hf_model(path: str, dtype: torch.dtype, device: torch.device):
    """The same weights in transformers (GGUF files are dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def write_results(result: dict, name: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [
        f"# Throughput ({result['device']}, {result['threads']} threads)", "",
        f"commit {result['commit']}, {result['date']}, model {result['model']}, "
        f"{result['dtype']}, {result['num_requests']} requests, lengths "
        f"{result['len_range'][0]}-{result['len_range'][1]} in and out", "",
        "| engine | seconds | tokens | tok/s |", "|---|---|---|---|",
    ]
    for key in ("deepinfer", "transformers"):
        if key in result:
            r = result[key]
            lines.append(f"| {key} | {r['seconds']:.2f} | {r['tokens']} | {r['tok_per_s']:.1f} |")
    if "speedup" in result:
        lines += ["", f"deepinfer / transformers: **{result['speedup']:.2f}x**"]
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--name", default=None, help="results file stem")
    args = p.parse_args(argv)
    result = run(args)
    name = args.name or f"throughput-{result['device_type']}"
    write_results(result, name)
    print(json.dumps(result, indent=2))
    return 0


def test_throughput_smoke(tmp_path, monkeypatch) -> None:
    """Tiny workload through both engines; both must produce every requested token."""
    monkeypatch.setattr(sys.modules[__name__], "RESULTS", str(tmp_path))
    args = argparse.Namespace(model=None, dtype="auto", device="cpu", num_requests=3,
                              min_len=4, max_len=8, max_num_seqs=4, hf_batch_size=2,
                              seed=0, no_hf=False)
    result = run(args)
    wanted = sum(make_workload(3, 4, 8, 49152, 0).max_tokens)
    assert result["deepinfer"]["tokens"] == wanted
    assert result["transformers"]["tokens"] == wanted
    write_results(result, "throughput-test")
    assert (tmp_path / "throughput-test.md").read_text().count("|") > 8


if __name__ == "__main__":
    sys.exit(main())
