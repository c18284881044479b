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

The workload comes from ``throughput_workload.py``, the ``--dp`` / ``--pd`` runs from
``throughput_parallel.py`` and the ``--tp`` mode from ``throughput_tp.py``. The tests at the
bottom run a tiny workload so the suite exercises this file and those.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from results_meta import git_commit, utc_now
from throughput_parallel import run_deepinfer_dp, run_deepinfer_pd
from throughput_tp import device_type, run_tp, write_tp_results
from throughput_workload import Workload, make_workload

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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
    """The workload through deepinfer, then (unless ``--no-hf``) transformers at each
    batch size, then over DP ranks and disaggregated if asked: the results record."""
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
    """``RESULTS/{name}.json`` (``result`` as is) and ``RESULTS/{name}.md`` (the tables)."""
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
    """The command line (see the module docstring); exit status 1 when ``--tp N``'s
    outputs differ from ``--tp 1``'s."""
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
            args.threads = 1 if device_type(args.device) == "cpu" else 0
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
    import throughput_tp
    from transformers import AutoModelForCausalLM, LlamaConfig

    from deepinfer.testing.random_model import build_bpe_tokenizer

    # write_tp_results writes into its own module's RESULTS.
    monkeypatch.setattr(throughput_tp, "RESULTS", str(tmp_path))
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
