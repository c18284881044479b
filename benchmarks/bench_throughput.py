"""End-to-end offline throughput: deepinfer vs Hugging Face transformers, same run.

A nano-vllm-style workload: random prompt token ids and output budgets drawn from a seed,
``ignore_eos`` so every request generates exactly what it asked for. transformers runs
batched ``generate`` (left padding, greedy) over the same prompts at several batch sizes,
and the best one is the baseline; only the tokens each request asked for are counted for
it, so padding and over-generation cost it time but earn nothing.

    python benchmarks/bench_throughput.py                      # CPU scale (64 requests)
    python benchmarks/bench_throughput.py --num-requests 256 --min-len 100 --max-len 1024
    python benchmarks/bench_throughput.py --no-hf              # deepinfer only
    python benchmarks/bench_throughput.py --no-hf --dp 2       # + the same run over 2 DP ranks
    python benchmarks/bench_throughput.py --no-hf --pd 1:1     # + the same run, disaggregated
    python benchmarks/bench_throughput.py --tp 3               # deepinfer-generate --tp 1 vs 3

``--tp N`` is a mode of its own: the workload (16 requests, 16-64 tokens in and out unless
given) is written as a ``deepinfer-generate`` input and run twice through the command
line, ``--tp 1`` then ``--tp N``, each in a fresh process; the outputs must be equal token
for token (greedy). The default SmolLM2-135M (9 heads, 3 KV heads) splits over 3 ranks.
On CPU every process runs with ``OMP_NUM_THREADS=1`` unless ``--threads`` says otherwise.

The test at the bottom runs a tiny workload so the suite exercises this file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from results_meta import git_commit, utc_now
from tree_state import commit_label, uncommitted_source

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


def run(args: argparse.Namespace) -> dict:
    from deepinfer import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_model_len=2 * args.max_len + 16,
              async_scheduling=getattr(args, "async_scheduling", None))
    vocab = llm.engine.model_config.vocab_size
    wl = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    ours_s, ours_tok = run_deepinfer(llm, wl)
    result = {
        "device": (torch.cuda.get_device_name() if llm.engine.device.type == "cuda"
                   else platform.processor() or platform.machine()),
        "device_type": llm.engine.device.type,
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
        "date": utc_now(),
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "dtype": str(llm.engine.dtype),
        "num_requests": args.num_requests, "len_range": [args.min_len, args.max_len],
        "deepinfer": {"seconds": ours_s, "tokens": ours_tok, "tok_per_s": ours_tok / ours_s},
    }
    if not args.no_hf:
        hf = load_hf_model(llm.engine.model_path, llm.engine.dtype, llm.engine.device)
        pad = llm.engine.model_config.eos_token_ids[0]
        # Several batch sizes: the comparison is against transformers' best one.
        sweep = []
        for bs in _batch_sizes(args.hf_batch_size):
            hf_s, hf_tok = run_hf(hf, wl, bs, pad)
            sweep.append({"seconds": hf_s, "tokens": hf_tok, "tok_per_s": hf_tok / hf_s,
                          "batch_size": bs})
        result["transformers"] = max(sweep, key=lambda r: r["tok_per_s"])
        result["transformers_dtype"] = ("torch.float32 (GGUF, packed)"
                                        if llm.engine.model_path.endswith(".gguf")
                                        else str(llm.engine.dtype))
        result["transformers_sweep"] = sweep
        result["speedup"] = result["deepinfer"]["tok_per_s"] / result["transformers"]["tok_per_s"]
    if getattr(args, "dp", 1) > 1:
        result["deepinfer_dp"] = run_deepinfer_dp(args, wl, result["deepinfer"]["tok_per_s"])
    if getattr(args, "pd", None):
        result["deepinfer_pd"] = run_deepinfer_pd(args, wl, result["deepinfer"])
    return result


def run_deepinfer_pd(args: argparse.Namespace, wl: Workload, normal: dict) -> dict:
    """The same workload through ``run_disaggregated`` (P PROMPT + D COMPLETION processes,
    KV hand-off over torch.distributed), next to the NORMAL single-engine figures.

    ``seconds`` is the slowest rank's round loop (model loading and process start-up
    excluded, like the NORMAL run's timing after its warm-up; the PD ranks get no warm-up,
    which matters on CUDA); ``wall_seconds`` is the whole call, start-up included."""
    import tempfile

    from deepinfer import SamplingParams
    from deepinfer.distributed.pd import PDRequest, parse_pd
    from deepinfer.distributed.pd_jobs import run_disaggregated
    from deepinfer.engine_args import EngineArgs

    num_prompt, num_decode = parse_pd(args.pd)
    eargs = EngineArgs(model=args.model, dtype=args.dtype, device=args.device,
                       max_num_seqs=args.max_num_seqs, max_model_len=2 * args.max_len + 16)
    reqs = [PDRequest(str(i), prompt_token_ids=p,
                      params=SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pd.jsonl")
        t0 = time.perf_counter()
        stats = run_disaggregated(eargs, reqs, out, num_prompt, num_decode)
        wall = time.perf_counter() - t0
        with open(out) as f:
            records = [json.loads(line) for line in f]
    bad = [r for r in records if "error" in r]
    if bad:
        raise RuntimeError(f"PD run: {len(bad)} request(s) failed, e.g. {bad[0]['error']}")
    tokens = sum(len(r["outputs"][0]["token_ids"]) for r in records)
    seconds = max(s["elapsed"] for s in stats)
    result = {"pd": f"{num_prompt}:{num_decode}", "seconds": seconds, "wall_seconds": wall,
              "tokens": tokens, "tok_per_s": tokens / seconds,
              "vs_normal": tokens / seconds / normal["tok_per_s"],
              "handed_off": sum(s["handed_off"] for s in stats),
              "credit_waits": sum(s["credit_waits"] for s in stats),
              "rounds": max(s["rounds"] for s in stats), "per_rank": stats}
    if args.device == "cpu" or not torch.cuda.is_available():
        result["note"] = (
            f"CPU: {num_prompt + num_decode} processes share the {os.cpu_count()} cores "
            "(which other jobs may also use) that the NORMAL engine had to itself, every KV "
            "hand-off is a gloo copy through local TCP, and rounds are lock-step, so a decode "
            "step waits for its round's prefill step. Slower than NORMAL here is expected: "
            "disaggregation pays off with one GPU per rank, where prefill and decode stop "
            "competing for one device (that path is untested)")
    return result


def run_deepinfer_dp(args: argparse.Namespace, wl: Workload, one_rank_tok_s: float) -> dict:
    """The same workload split round-robin over ``args.dp`` ranks (deepinfer.distributed's
    launcher; one GPU per rank on CUDA, CPU processes with gloo otherwise)."""
    from deepinfer.distributed.ranks import spawn_ranks

    per_rank = spawn_ranks(_bench_rank, args.dp, (vars(args).copy(), wl))
    wall = max(r["seconds"] for r in per_rank)
    tokens = sum(r["tokens"] for r in per_rank)
    scaling = tokens / wall / one_rank_tok_s
    out = {"ranks": args.dp, "seconds": wall, "tokens": tokens, "tok_per_s": tokens / wall,
           "per_rank": per_rank, "scaling_vs_1_rank": scaling}
    if per_rank[0]["device_type"] == "cpu":
        out["note"] = (
            f"CPU: {args.dp} ranks x {per_rank[0]['threads']} thread(s) vs 1 rank x "
            f"{torch.get_num_threads()} thread(s) on {os.cpu_count()} cores that other jobs "
            "may share; the ratio measures torch CPU threading and contention on this "
            "machine as much as DP (compare with OMP_NUM_THREADS=1 set for both). DP is "
            "meant for one GPU per rank")
    return out


def _bench_rank(info, args: dict, wl: Workload) -> list[dict] | None:
    """One DP rank of the throughput run: its round-robin share, timed after a warm-up;
    rank 0 returns every rank's figures."""
    import torch.distributed as dist

    from deepinfer import SamplingParams
    from deepinfer.distributed.ranks import init_distributed, select_device
    from deepinfer.engine import LLMEngine
    from deepinfer.engine_args import EngineArgs

    device = select_device(args["device"], info.local_rank)
    init_distributed(info, device, timeout_s=600)
    engine = LLMEngine(EngineArgs(model=args["model"], dtype=args["dtype"], device=device,
                                  max_num_seqs=args["max_num_seqs"],
                                  max_model_len=2 * args["max_len"] + 16),
                       dp_group=dist.group.WORLD)

    def drain(engine: LLMEngine) -> float:
        """Step until no rank has work; seconds until this rank's own work was done."""
        t0 = time.perf_counter()
        mine = t0
        while engine.scheduler.has_unfinished_dp():
            engine.step()
            if engine.has_unfinished():
                mine = time.perf_counter()
        return mine - t0

    engine.add_request("warmup", None, wl.prompts[0],
                       SamplingParams(max_tokens=4, ignore_eos=True))
    drain(engine)
    dist.barrier()
    for i in range(info.rank, len(wl.prompts), info.world_size):
        engine.add_request(str(i), None, wl.prompts[i],
                           SamplingParams(temperature=0.0, max_tokens=wl.max_tokens[i],
                                          ignore_eos=True))
    tokens0 = engine.stats.generated_tokens
    t0 = time.perf_counter()
    own = drain(engine)
    wall = time.perf_counter() - t0
    tokens = engine.stats.generated_tokens - tokens0
    mine = {"rank": info.rank, "seconds": wall, "busy_seconds": own, "tokens": tokens,
            "tok_per_s": tokens / wall, "device_type": engine.device.type,
            "threads": torch.get_num_threads()}
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    del engine  # it holds the group: free both before exit (see deepinfer.distributed.ranks)
    gc.collect()
    dist.destroy_process_group()
    return everyone if info.rank == 0 else None


# ---------------------------------------------------------------------------- --tp N
_DONE = re.compile(r"done: (\d+) requests ok, (\d+) failed \| prompt (\d+) tok, "
                   r"generated (\d+) tok in ([\d.]+)s \(([\d.]+) tok/s out")


def _device_type(device: str) -> str:
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
    dev = _device_type(args.device)
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


def load_hf_model(path: str, dtype: torch.dtype, device: torch.device):
    """The same weights in transformers. A GGUF file loads in float32 whatever ``dtype``:
    transformers (5.x) keeps its weights packed and computes in float32, so any other
    dtype only adds a cast around every matmul (its own warning says so): float32 is its
    fastest."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def _batch_sizes(spec: int | str) -> list[int]:
    """``16`` or ``"16,32,64"`` -> ``[16, 32, 64]``."""
    return [int(x) for x in str(spec).split(",") if x.strip()]


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
    rows = [("deepinfer", result["deepinfer"])]
    hf_dtype = result.get("transformers_dtype", "")
    rows += [(f"transformers, batch {r['batch_size']}" + (f", {hf_dtype}" if hf_dtype else ""),
              r) for r in result.get("transformers_sweep", [])]
    for label, r in rows:
        lines.append(f"| {label} | {r['seconds']:.2f} | {r['tokens']} | {r['tok_per_s']:.1f} |")
    if "speedup" in result:
        lines += ["", f"deepinfer / transformers at its best batch size "
                      f"({result['transformers']['batch_size']}): **{result['speedup']:.2f}x**"]
    if "deepinfer_dp" in result:
        d = result["deepinfer_dp"]
        lines += ["", f"## Data parallel: {d['ranks']} ranks vs 1 rank", "",
                  "| run | seconds | tokens | tok/s |", "|---|---|---|---|",
                  f"| 1 rank | {result['deepinfer']['seconds']:.2f} | "
                  f"{result['deepinfer']['tokens']} | {result['deepinfer']['tok_per_s']:.1f} |",
                  f"| {d['ranks']} ranks, total | {d['seconds']:.2f} | {d['tokens']} | "
                  f"{d['tok_per_s']:.1f} |"]
        lines += [f"| rank {r['rank']} | {r['seconds']:.2f} | {r['tokens']} | "
                  f"{r['tok_per_s']:.1f} |" for r in d["per_rank"]]
        lines += ["", f"{d['ranks']} ranks / 1 rank: **{d['scaling_vs_1_rank']:.2f}x**"]
        if "note" in d:
            lines += ["", d["note"] + "."]
    if "deepinfer_pd" in result:
        d, n = result["deepinfer_pd"], result["deepinfer"]
        lines += ["", f"## Disaggregated prefill/decode ({d['pd']}) vs NORMAL", "",
                  "| run | seconds | tokens | tok/s |", "|---|---|---|---|",
                  f"| NORMAL, 1 engine | {n['seconds']:.2f} | {n['tokens']} | "
                  f"{n['tok_per_s']:.1f} |",
                  f"| PD {d['pd']} | {d['seconds']:.2f} | {d['tokens']} | "
                  f"{d['tok_per_s']:.1f} |", "",
                  f"PD / NORMAL: **{d['vs_normal']:.2f}x** ({d['handed_off']} hand-offs in "
                  f"{d['rounds']} rounds, {d['credit_waits']} rounds waiting for credits; "
                  f"{d['wall_seconds']:.1f}s wall with process start-up and model loading)"]
        if "note" in d:
            lines += ["", d["note"] + "."]
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default 64 (16 with --tp)")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=None, help="default 256 (64 with --tp)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--hf-batch-size", default="16,32,64",
                   help="transformers batch size(s), comma-separated; the best one counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=None, help="overlapped scheduling (default: on for CUDA)")
    p.add_argument("--name", default=None, help="results file stem")
    p.add_argument("--dp", type=int, default=1,
                   help="also run the workload over N data-parallel ranks (spawned)")
    p.add_argument("--pd", default=None, metavar="P:D",
                   help="also run it disaggregated: P prompt + D completion processes")
    p.add_argument("--tp", type=int, default=1,
                   help="instead: the workload through deepinfer-generate with --tp 1, "
                        "then --tp N (no transformers run, no --dp/--pd)")
    p.add_argument("--threads", type=int, default=None,
                   help="with --tp: OMP_NUM_THREADS of every process of both runs (0: "
                        "inherit). Default 1 on CPU (with more torch threads than free "
                        "cores, OpenMP's spinning makes runs many times slower and "
                        "erratic), inherited on CUDA")
    args = p.parse_args(argv)
    if args.tp > 1:
        if args.dp > 1 or args.pd:
            p.error("--tp runs alone: give --dp / --pd in another run")
        args.num_requests = args.num_requests or 16
        if args.threads is None:
            args.threads = 1 if _device_type(args.device) == "cpu" else 0
        args.max_len = args.max_len or 64
        result = run_tp(args)
        name = args.name or f"throughput-tp-{result['device_type']}"
        write_tp_results(result, name)
        print(json.dumps(result, indent=2))
        return 0 if result["outputs_equal"]["equal"] else 1
    args.num_requests = args.num_requests or 64
    args.max_len = args.max_len or 256
    result = run(args)
    name = args.name or (f"throughput-{result['device_type']}"
                         + (f"-dp{args.dp}" if args.dp > 1 else "")
                         + (f"-pd{args.pd.replace(':', '-')}" if args.pd else ""))
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


def test_throughput_tp_smoke(tmp_path, monkeypatch) -> None:
    """A tiny random checkpoint through ``deepinfer-generate --tp 1`` and ``--tp 2``: every
    requested token, the same tokens, and the results file."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from deepinfer.random_model import build_bpe_tokenizer

    monkeypatch.setattr(sys.modules[__name__], "RESULTS", str(tmp_path))
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    model_dir = str(tmp_path / "tiny")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    build_bpe_tokenizer().save_pretrained(model_dir)
    args = argparse.Namespace(model=model_dir, dtype="auto", device="cpu", num_requests=3,
                              min_len=4, max_len=8, max_num_seqs=4, seed=0, tp=2, threads=1)
    result = run_tp(args)
    wanted = sum(make_workload(3, 4, 8, 300, 0).max_tokens)
    assert result["tp1"]["tokens"] == result["tp2"]["tokens"] == wanted
    assert result["outputs_equal"]["equal"], result["outputs_equal"]
    write_tp_results(result, "throughput-tp-test")
    assert "equal token for token: **yes**" in (tmp_path / "throughput-tp-test.md").read_text()


if __name__ == "__main__":
    sys.exit(main())
