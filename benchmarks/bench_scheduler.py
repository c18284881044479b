"""Scheduler overhead per step: ``schedule()`` + ``update()`` on the CPU, no model.

Decode steps with 64, 256 and 1024 running sequences (prompt lengths 128..191 so block
boundaries, i.e. new blocks and prefix-cache registrations, are spread over steps as in a
real run), and one prompt step admitting 256 sequences of 16 tokens.

With ``$NANOVLLM_SRC`` (a copy of GeeeekExplorer/nano-vllm), the same decode workload
(the same prompts) through nano-vllm's ``Scheduler.schedule()`` + ``postprocess()`` in
the same run, loaded as ``host_nanovllm.py`` does; its KV block is 256 tokens (a multiple
of 256 is what it takes), ours 16.

    NANOVLLM_SRC=/path/to/nano-vllm python benchmarks/bench_scheduler.py
    pytest benchmarks/bench_scheduler.py --benchmark-enable

In the normal suite (``--benchmark-disable``) each benchmark body runs once. ``--save``
records the figures (and the 1024-vs-256 cost ratio) under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pytest
from results_meta import git_commit, utc_now  # noqa: E402

from deepinfer_scheduler import Scheduler, SchedulerConfig  # noqa: E402

MAX_MODEL_LEN = 4096


def decode_prompts(num_seqs: int, seed: int = 0) -> list[list[int]]:
    """The decode workload's prompts: 128..191 random ids each."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 32000, int(rng.integers(128, 192))).tolist()
            for _ in range(num_seqs)]


def running_scheduler(num_seqs: int, seed: int = 0) -> Scheduler:
    """A scheduler with ``num_seqs`` sequences past their prompt, decoding."""
    s = Scheduler(SchedulerConfig(
        num_blocks=num_seqs * (MAX_MODEL_LEN // 16) // 4, block_size=16,
        max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN,
    ))
    for i, prompt in enumerate(decode_prompts(num_seqs, seed)):
        s.add_request(f"r{i}", prompt, 2048, stop_token_ids=[2])
    while s.num_running < num_seqs:
        out = s.schedule()
        s.update(out, [5] * out.num_samples)
    return s


def decode_step(s: Scheduler, toks: list[int]) -> None:
    out = s.schedule()
    assert not out.is_prompt
    s.update(out, toks)


def time_decode(num_seqs: int, steps: int = 200) -> float:
    """Mean seconds per decode step (schedule + update) over ``steps`` steps."""
    s = running_scheduler(num_seqs)
    toks = [5] * num_seqs
    for _ in range(5):
        decode_step(s, toks)
    t0 = time.perf_counter()
    for _ in range(steps):
        decode_step(s, toks)
    return (time.perf_counter() - t0) / steps


def prompt_setup(num_seqs: int = 256):
    rng = np.random.default_rng(1)
    s = Scheduler(SchedulerConfig(num_blocks=4096, block_size=16, max_num_seqs=num_seqs,
                                  max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN))
    for i in range(num_seqs):
        s.add_request(f"p{i}", rng.integers(0, 32000, 16).tolist(), 16)
    return (s, [5] * num_seqs), {}


def prompt_step(s: Scheduler, toks: list[int]) -> None:
    out = s.schedule()
    assert out.is_prompt and len(out.seqs) == len(toks)
    s.update(out, toks)


def time_prompt(num_seqs: int = 256, reps: int = 20) -> float:
    best = float("inf")
    for _ in range(reps):
        (s, toks), _ = prompt_setup(num_seqs)
        t0 = time.perf_counter()
        prompt_step(s, toks)
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------ pytest-benchmark
@pytest.mark.parametrize("num_seqs", [64, 256, 1024])
def test_bench_decode_step(benchmark, num_seqs):
    s = running_scheduler(num_seqs)
    toks = [5] * num_seqs
    benchmark.extra_info["num_seqs"] = num_seqs
    benchmark.pedantic(decode_step, args=(s, toks), rounds=300, iterations=1,
                       warmup_rounds=5)
    assert s.num_running == num_seqs


def test_bench_prompt_step_256(benchmark):
    benchmark.extra_info["num_seqs"] = 256
    benchmark.pedantic(prompt_step, setup=prompt_setup, rounds=30, iterations=1)


def nano_decode_times(steps: int, sizes: tuple[int, ...]) -> tuple[dict[int, float], str]:
    """nano-vllm's ``schedule()`` + ``postprocess()`` seconds per decode step per size (best
    of 3), on the same prompts; ``({}, why)`` without ``$NANOVLLM_SRC``."""
    import tempfile

    from host_fixtures import make_tiny_checkpoint
    from host_nanovllm import nano_from_env, time_nano_scheduler

    nano, note = nano_from_env()
    if nano is None:
        return {}, note
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(tmp)  # nano-vllm's Config reads its config.json
        times = {n: min(time_nano_scheduler(nano, model_dir, decode_prompts(n), steps)
                        for _ in range(3)) for n in sizes}
    return times, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/scheduler-cpu.{json,md}")
    args = ap.parse_args()
    sizes = (64, 256, 1024)
    rows: list[tuple[str, float, int]] = []
    for n in sizes:
        rows.append((f"decode, {n} seqs", min(time_decode(n, args.steps) for _ in range(3)), n))
    rows.append(("prompt, 256 seqs", min(time_prompt(256) for _ in range(3)), 256))
    nano, nano_note = nano_decode_times(args.steps, sizes)
    ratio = rows[2][1] / rows[1][1]
    lines = ["| step | us/step | us/seq | nano-vllm us/step | ours / nano-vllm |",
             "|---|---|---|---|---|"]
    for (name, t, n) in rows:
        theirs = nano.get(n) if name.startswith("decode") else None
        extra = (f"{theirs * 1e6:.1f} | {t / theirs:.2f}x" if theirs else "- | -")
        lines.append(f"| {name} | {t * 1e6:.1f} | {t * 1e6 / n:.3f} | {extra} |")
    lines.append(f"\ndecode cost 1024 vs 256 sequences: {ratio:.2f}x (linear would be 4x)")
    lines.append(f"\nnano-vllm: {nano_note}")
    print("\n".join(lines))
    if args.save:
        out = Path(__file__).resolve().parent / "results"
        out.mkdir(exist_ok=True)
        meta = {"commit": git_commit(), "date": utc_now(),
                "machine": platform.machine(), "cpus": os.cpu_count()}
        data = {**meta, "us_per_step": {name: t * 1e6 for name, t, _ in rows},
                "nano_vllm_us_per_step": {f"decode, {n} seqs": t * 1e6
                                          for n, t in nano.items()},
                "nano_vllm": nano_note, "decode_1024_vs_256": ratio}
        (out / "scheduler-cpu.json").write_text(json.dumps(data, indent=2) + "\n")
        head = (f"# Scheduler cost per step (CPU, {meta['cpus']} cores)\n\n"
                f"commit {meta['commit']}, {meta['date']}, "
                "`NANOVLLM_SRC=... python benchmarks/bench_scheduler.py --save`\n\n")
        (out / "scheduler-cpu.md").write_text(head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
