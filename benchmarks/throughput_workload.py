"""The throughput benchmarks' workload: random prompt token ids and output budgets drawn
from a seed (nano-vllm style), shared by the single-engine, DP/PD and TP runs."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    """Each request's prompt token ids and its output budget (``ignore_eos``: exactly
    that many tokens are generated)."""

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


def run_workload(num_requests: int, min_len: int, max_len: int, vocab: int,
                 seed: int) -> Workload:
    """The workload of one run of a series over request counts: drawn from ``seed +
    num_requests``, so that a run never finds an earlier run's prompts in the prefix
    cache (with one seed, the first prompts of every run would be the same)."""
    return make_workload(num_requests, min_len, max_len, vocab, seed + num_requests)
