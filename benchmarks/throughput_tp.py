"""``bench_throughput.py --tp N``: the workload written as a ``deepinfer-generate`` input
and run through the command line twice, ``--tp 1`` then ``--tp N``, each in a fresh
process; tok/s of both, and whether their greedy outputs are equal token for token."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import torch
from results_meta import git_commit, utc_now
from throughput_workload import Workload, make_workload
from tree_state import commit_label, uncommitted_source

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The summary line deepinfer-generate prints on stderr at the end of a run.
_DONE = re.compile(r"done: (\d+) requests ok, (\d+) failed \| prompt (\d+) tok, "
                   r"generated (\d+) tok in ([\d.]+)s \(([\d.]+) tok/s out")


def device_type(device: str) -> str:
    """The device type ``--device`` names (``"cuda"``, ``"cpu"``...); ``auto``: CUDA when
    there is one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def write_job_input(wl: Workload, tokenizer, path: str) -> None:
    """The workload as a ``deepinfer-generate`` ``.jsonl`` input: each prompt's random ids
    decoded to text (the CLI takes text; re-encoding gives about the same length), greedy,
    ``ignore_eos`` and the request's own ``max_tokens``."""
    with open(path, "w", encoding="utf-8") as f:
        for i, (ids, m) in enumerate(zip(wl.prompts, wl.max_tokens)):
            f.write(json.dumps({"id": str(i), "prompt": tokenizer.decode(ids),
                                "max_tokens": m, "temperature": 0.0,
                                "ignore_eos": True}) + "\n")


def run_cli(args: argparse.Namespace, job: str, out: str, tp: int) -> dict:
    """One ``python -m deepinfer.generate ... --tp {tp}`` run in a fresh process (its ranks
    spawned by it). ``seconds``: the CLI's own ``done:`` line (engine built and model
    loaded, records queued, to the last record), ``wall_seconds``: the whole process."""
    cmd = [sys.executable, "-m", "deepinfer.generate", "--input", job, "--output", out,
           "--device", args.device, "--dtype", args.dtype, "--tp", str(tp),
           "--max-model-len", str(2 * args.max_len + 16), "--no-progress"]
    if args.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if getattr(args, "async_scheduling", None) is not None:
        cmd.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.model is not None:
        cmd += ["--model", args.model]
    env = dict(os.environ)
    if getattr(args, "threads", 0):
        env["OMP_NUM_THREADS"] = str(args.threads)  # every rank's torch threads
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=getattr(args, "tp_timeout", 1800))
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    done = _DONE.search(proc.stderr)
    if proc.returncode != 0 or done is None:
        raise RuntimeError(f"--tp {tp} run failed (exit {proc.returncode}): "
                           f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    ok, failed, prompt_tok, gen_tok = (int(done.group(i)) for i in range(1, 5))
    # Both figures are printed to one decimal: the seconds from whichever is more precise.
    elapsed, rate = float(done.group(5)), float(done.group(6))
    seconds = elapsed if elapsed >= rate or rate == 0 else gen_tok / rate
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    shown = " ".join("JOB" if c == job else "OUT" if c == out else c for c in cmd[1:])
    prefix = f"OMP_NUM_THREADS={args.threads} " if getattr(args, "threads", 0) else ""
    return {"tp": tp, "command": f"{prefix}python {shown}", "seconds": seconds,
            "wall_seconds": wall, "requests_ok": ok,
            "failed": failed, "prompt_tokens": prompt_tok, "tokens": gen_tok,
            "tok_per_s": gen_tok / seconds,
            # 1-minute load average before / after: other jobs on the machine show here.
            "loadavg_1min": [round(load_before, 2), round(load_after, 2)],
            "token_ids": {r["id"]: r["outputs"][0]["token_ids"] for r in records
                          if "outputs" in r}}


def compare_outputs(one: dict[str, list[int]], many: dict[str, list[int]]) -> dict:
    """Token-for-token equality of two runs' outputs, by request id; for each request that
    differs, the first position where it does."""
    diverged = {}
    for rid in sorted(set(one) | set(many), key=lambda r: (len(r), r)):
        a, b = one.get(rid), many.get(rid)
        if a == b:
            continue
        if a is None or b is None:
            diverged[rid] = "missing in the " + ("--tp 1" if a is None else "--tp N") + " run"
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diverged[rid] = f"first differs at output token {first} of {len(a)}/{len(b)}"
    return {"equal": not diverged, "requests": len(set(one) | set(many)),
            "equal_requests": len(set(one) | set(many)) - len(diverged),
            "diverged": diverged}


def run_tp(args: argparse.Namespace) -> dict:
    """The workload through ``deepinfer-generate --tp 1`` and ``--tp N``: tok/s of both,
    their ratio, and whether the outputs are equal token for token."""
    from deepinfer.loading.loader import load_config, resolve_dtype, resolve_model_path
    from deepinfer.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    cfg = load_config(path)
    dev = device_type(args.device)
    wl = make_workload(args.num_requests, args.min_len, args.max_len, cfg.vocab_size,
                       args.seed)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "job.jsonl")
        write_job_input(wl, load_tokenizer(path), job)
        for tp in (1, args.tp):
            runs.append(run_cli(args, job, os.path.join(tmp, f"out-tp{tp}.jsonl"), tp))
    one, many = runs
    same = compare_outputs(one.pop("token_ids"), many.pop("token_ids"))
    threads = (getattr(args, "threads", 0) or int(os.environ.get("OMP_NUM_THREADS") or 0)
               or torch.get_num_threads())
    result = {
        "device": (torch.cuda.get_device_name() if dev == "cuda"
                   else platform.processor() or platform.machine()),
        "device_type": dev,
        "gpus": torch.cuda.device_count() if dev == "cuda" else 0,
        "cpu_cores": os.cpu_count(),
        "threads_per_process": threads,
        "commit": git_commit(),
        # Work in progress: the source that ran is HEAD plus these (see tree_state).
        "uncommitted_source": uncommitted_source(),
        "date": utc_now(),
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "heads": [cfg.num_heads, cfg.num_kv_heads],
        "dtype": str(resolve_dtype(args.dtype, cfg.torch_dtype, torch.device(dev),
                                   path.endswith(".gguf"))),
        "num_requests": args.num_requests, "len_range": [args.min_len, args.max_len],
        "tp": args.tp, "tp1": one, f"tp{args.tp}": many,
        "tp_vs_tp1": many["tok_per_s"] / one["tok_per_s"],
        "outputs_equal": same,
    }
    if dev == "cpu":
        result["note"] = (
            f"CPU: a correctness-of-scale check, not a speed figure. The {args.tp} ranks "
            f"are {args.tp} processes of {threads} torch thread(s) each sharing this "
            f"machine's {os.cpu_count()} cores (which other jobs may also use; see the "
            "load averages) with --tp 1's one process of as many threads, every layer's "
            "all-reduce is a gloo copy through local TCP, and only the leader samples "
            "and schedules while the others wait, so the ratio says little about TP "
            "itself. What this run "
            "checks is that the split model gives the same greedy tokens as the whole one "
            "at this workload's scale. GPU figures (one GPU per rank, NCCL) come from "
            "scripts/gpu_ci.sh when a multi-GPU machine is lent")
    return result


def write_tp_results(result: dict, name: str) -> None:
    """``RESULTS/{name}.json`` (``result`` as is) and ``RESULTS/{name}.md`` (the table)."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    n = result["tp"]
    one, many, same = result["tp1"], result[f"tp{n}"], result["outputs_equal"]
    where = (f"{result['gpus']} x {result['device']}" if result["device_type"] == "cuda"
             else f"{result['device']}, {result['cpu_cores']} cores, "
                  f"{result['threads_per_process']} thread(s) per process")
    lines = [
        f"# Tensor parallel throughput: --tp {n} vs --tp 1 ({where})", "",
        f"commit {commit_label(result['commit'], result.get('uncommitted_source', []))}, "
        f"{result['date']}, model {result['model']} "
        f"({result['heads'][0]} heads, {result['heads'][1]} KV heads), {result['dtype']}, "
        f"{result['num_requests']} requests, lengths {result['len_range'][0]}-"
        f"{result['len_range'][1]} in and out, greedy, ignore_eos; each run is "
        "`python -m deepinfer.generate ... --tp N` in a fresh process", "",
        "| run | seconds | wall seconds | prompt tokens | generated tokens | tok/s "
        "| load avg before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in (one, many):
        load = "{} / {}".format(*r.get("loadavg_1min", ["?", "?"]))
        lines.append(f"| --tp {r['tp']} | {r['seconds']:.1f} | {r['wall_seconds']:.1f} | "
                     f"{r['prompt_tokens']} | {r['tokens']} | {r['tok_per_s']:.1f} | "
                     f"{load} |")
    lines += ["", f"--tp {n} / --tp 1: **{result['tp_vs_tp1']:.2f}x** (seconds: the CLI's "
              "`done:` line, from the engine's first step to the last record; wall: the "
              "whole command, process start-up and model loading included)", ""]
    if same["equal"]:
        lines.append(f"Outputs equal token for token: **yes**, all {same['requests']} "
                     "requests.")
    else:
        lines.append(f"Outputs equal token for token: **no**, {same['equal_requests']} of "
                     f"{same['requests']} requests; the others:")
        lines += [f"- request {rid}: {why}" for rid, why in same["diverged"].items()]
    if "note" in result:
        lines += ["", result["note"] + "."]
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
