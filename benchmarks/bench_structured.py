"""Structured output cost: tokens/s of a JSON-schema batch against the same batch
unconstrained, same run, same engine.

The constrained run goes first (greedy, a nested schema with enums, bounded integers,
maxLength strings and a maxItems array); each request's output length is then given to
the unconstrained run as ``max_tokens`` with ``ignore_eos``, so both runs generate the
same number of tokens per request over the same steps: the difference is the per-step
cost of structured output (bitmask filled on the host for every row, applied to the
logits, tokens fed to the matchers). Where the engine overlaps steps (CUDA), two more
rows run both batches with overlap off: what the overlap is worth to each (a constrained
step keeps it: its forward is enqueued before the step in flight lands, and the mask is
filled while the forward runs). Grammar compilation
is warmed up first and reported on its own (cached by key after that). Rounds are
interleaved and the median is reported.

    python benchmarks/bench_structured.py                      # default model, batch 16 on CPU
    python benchmarks/bench_structured.py --batch 64 --reps 3  # the issue's GPU case
    python benchmarks/bench_structured.py --save               # results/structured-<device>.*
    python benchmarks/bench_structured.py --save-to DIR        # the same files in DIR

Saved files are rewritten after each round, so a run cut short keeps the rounds it did.

The ``test_`` function at the bottom runs a tiny model through it (no timing assertion).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results_meta import git_commit, utc_now

RESULTS = Path(__file__).resolve().parent / "results"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
}
JOBS = ["airline pilot", "chef", "retired teacher", "programmer", "nurse", "farmer",
        "painter", "firefighter"]


def prompts_for(llm, batch: int) -> list[list[int]]:
    """``batch`` chat prompts asking for a person as JSON (token ids)."""
    from deepinfer.tokenizer import apply_chat_template

    return [apply_chat_template(llm.tokenizer, [{
        "role": "user",
        "content": f"Describe person #{i}, a fictional {JOBS[i % len(JOBS)]}, as JSON."}])
        for i in range(batch)]


def timed(llm, prompts: list[list[int]], params) -> tuple[float, int, list]:
    """Seconds, generated tokens and outputs of one ``generate`` call."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for o in outs for c in o.outputs), outs


def measure(llm, batch: int, max_tokens: int, reps: int,
            on_round: Callable[[dict], object] | None = None) -> dict:
    """The figures of one configuration: compile (warm-up) seconds, then per mode the
    median seconds and tokens/s over ``reps`` interleaved rounds, and how many
    constrained outputs were complete, valid JSON (``finish_reason "stop"``).
    ``on_round`` gets the figures of the rounds done so far after each round."""
    from deepinfer import SamplingParams, StructuredOutputsParams

    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = prompts_for(llm, batch)
    t0 = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2,
                                             structured_outputs=so), use_tqdm=False)
    warmup = time.perf_counter() - t0
    constrained = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                  structured_outputs=so)] * batch
    engine = llm.engine
    overlap = engine.async_scheduling
    modes = ["constrained", "unconstrained"]
    if overlap:  # what the overlap is worth to each (constrained steps keep it)
        modes += ["constrained, no overlap", "unconstrained, no overlap"]
    threads = engine.structured.fill_threads
    if threads > 1:  # what filling the masks on xgrammar's thread pool is worth
        modes.append("constrained, 1 fill thread")
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}
    valid = 0
    fill = engine.structured.stats
    fill_s, fill_steps, fill_rows = [], [], []
    for r in range(reps):
        before = (fill.fill_seconds, fill.fills, fill.filled_rows)
        dt, n, outs = timed(llm, prompts, constrained)
        times["constrained"].append(dt)
        tokens["constrained"] = n
        fill_s.append(fill.fill_seconds - before[0])
        fill_steps.append(fill.fills - before[1])
        fill_rows.append(fill.filled_rows - before[2])
        if r == 0:
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            valid = sum(_valid(o.outputs[0]) for o in outs)
        plain = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                 for m in lengths]
        for mode in modes[1:]:
            engine.async_scheduling = overlap and not mode.endswith("no overlap")
            engine.structured.fill_threads = 1 if mode.endswith("1 fill thread") else threads
            try:
                dt, n, _ = timed(llm, prompts,
                                 constrained if mode.startswith("constrained") else plain)
            finally:
                engine.async_scheduling = overlap
                engine.structured.fill_threads = threads
            times[mode].append(dt)
            tokens[mode] = n
        res = _figures(times, tokens, (fill_s, fill_steps, fill_rows), threads)
        res = {"batch": batch, "max_tokens": max_tokens, "reps": r + 1,
               "compile_warmup_s": warmup, "valid_outputs": valid, **res}
        if on_round is not None:
            on_round(res)
    return res


def _figures(times: dict[str, list[float]], tokens: dict[str, int],
             fills: tuple[list[float], list[int], list[int]], threads: int) -> dict:
    """Per mode the median seconds and tokens/s, and the mask fill of the median
    constrained run (``median_low``: a round that ran, with an even count too)."""
    rows = {m: {"seconds": statistics.median(t), "tokens": tokens[m],
                "tok_s": tokens[m] / statistics.median(t)} for m, t in times.items()}
    i = times["constrained"].index(statistics.median_low(times["constrained"]))
    fill_s, fill_steps, fill_rows = fills
    mask = {"seconds": fill_s[i], "steps": fill_steps[i], "rows": fill_rows[i],
            "threads": threads, "share_of_run": fill_s[i] / times["constrained"][i]}
    return {"modes": rows, "mask_fill": mask}


def mask_fill_line(res: dict) -> str:
    """The host's mask-fill time of the median constrained run, in words."""
    m = res["mask_fill"]
    per_step = m["seconds"] / max(m["steps"], 1)
    per_row = m["seconds"] / max(m["rows"], 1)
    return (f"mask fill (host, median constrained run): {per_step * 1e3:.2f} ms a step, "
            f"{per_row * 1e6:.1f} us a row, {m['share_of_run']:.1%} of the run "
            f"({m['threads']} thread{'s' if m['threads'] > 1 else ''})")


def _valid(c) -> bool:
    if c.finish_reason != "stop":
        return False
    try:
        value = json.loads(c.text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)


def table_lines(res: dict) -> list[str]:
    """The markdown table of ``measure``'s result."""
    base = res["modes"]["unconstrained"]["tok_s"]
    lines = [f"| mode (batch {res['batch']}) | tokens | seconds | tok/s | vs unconstrained |",
             "|---|---|---|---|---|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:.1f} | "
                     f"{r['tok_s'] / base - 1:+.1%} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=None, help="requests (16 CPU, 64 CUDA)")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/structured-<device>.{json,md}")
    ap.add_argument("--save-to", type=Path, default=None, metavar="DIR",
                    help="write structured-<device>.{json,md} into DIR instead")
    args = ap.parse_args()
    from deepinfer import LLM

    llm = LLM(args.model, device=args.device)
    device = llm.engine.device.type
    batch = args.batch or (64 if device == "cuda" else 16)
    out = args.save_to or (RESULTS if args.save else None)
    meta = {"commit": git_commit(), "date": utc_now(), "device": device,
            "device_name": (torch.cuda.get_device_name() if device == "cuda"
                            else platform.processor() or platform.machine()),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "model": llm.engine.model_path}
    save = None if out is None else (lambda res: write_results(out, meta, res))
    res = measure(llm, batch, args.max_tokens, args.reps, on_round=save)
    print(report(res))
    return 0


def report(res: dict) -> str:
    """The table of ``measure``'s result and the notes under it, in markdown."""
    return ("\n".join(table_lines(res))
            + f"\n\nvalid JSON outputs: {res['valid_outputs']}/{res['batch']}; grammar "
            f"compile + first constrained request: {res['compile_warmup_s']:.2f} s; median "
            f"of {res['reps']} rounds; {torch.get_num_threads()} threads.\n"
            f"{mask_fill_line(res)}.")


def write_results(out: Path, meta: dict, res: dict) -> None:
    """``out/structured-{cuda,cpu}.{json,md}``: ``meta`` and ``res`` (``measure``'s)."""
    name = "cuda" if meta["device"] == "cuda" else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"structured-{name}.json").write_text(
        json.dumps({**meta, "schema": SCHEMA, **res}, indent=2) + "\n")
    head = (f"# Structured output cost ({meta['device_name']}, {meta['device']})\n\n"
            f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, "
            f"`python benchmarks/bench_structured.py --save`\n\n"
            f"model {os.path.basename(meta['model'].rstrip('/'))}; greedy; JSON schema of "
            f"benchmarks/bench_structured.py; the unconstrained rows generate the "
            f"constrained run's lengths (ignore_eos).\n\n")
    (out / f"structured-{name}.md").write_text(head + report(res) + "\n")


def test_bench_structured_smoke(tmp_path):
    """A tiny random model through ``measure``: figures positive and finite, the
    unconstrained run generates exactly the constrained run's tokens, every output is
    complete, valid JSON (no timing assertion)."""
    from bench_host import make_tiny_checkpoint

    from deepinfer import LLM

    llm = LLM(make_tiny_checkpoint(str(tmp_path)), dtype="float32", device="cpu",
              max_num_seqs=4, kv_cache_memory=16 << 20)
    saved = []
    res = measure(llm, batch=3, max_tokens=400, reps=2, on_round=saved.append)
    assert [r["reps"] for r in saved] == [1, 2] and saved[-1] is res
    meta = {"commit": "c", "date": "d", "device": "cpu", "device_name": "x", "torch": "t",
            "model": "m"}
    write_results(tmp_path / "out", meta, saved[0])  # what a run cut after one round keeps
    assert "median of 1 rounds" in (tmp_path / "out" / "structured-cpu.md").read_text()
    assert json.loads((tmp_path / "out" / "structured-cpu.json").read_text())["reps"] == 1
    modes = res["modes"]
    assert set(modes) == {"constrained", "unconstrained"}  # CPU: no overlap by default
    assert modes["constrained"]["tokens"] == modes["unconstrained"]["tokens"] > 0
    for r in modes.values():
        assert math.isfinite(r["tok_s"]) and r["tok_s"] > 0
    assert res["valid_outputs"] == 3
    assert len(table_lines(res)) == 4
    m = res["mask_fill"]
    assert m["rows"] >= m["steps"] > 0 and 0 < m["share_of_run"] < 1
    assert "us a row" in mask_fill_line(res)
    # With overlap (the CUDA default) the no-overlap rows join, and with fill threads (8+
    # cores) the one-thread row; the greedy constrained batch generates the same tokens
    # every way.
    llm.engine.async_scheduling = True
    llm.engine.structured.fill_threads = 2
    res = measure(llm, batch=3, max_tokens=400, reps=1)
    modes = res["modes"]
    assert len({r["tokens"] for r in modes.values()}) == 1 and len(modes) == 5
    assert llm.engine.async_scheduling and llm.engine.structured.fill_threads == 2
    assert len(table_lines(res)) == 7 and res["mask_fill"]["threads"] == 2


if __name__ == "__main__":
    sys.exit(main())
