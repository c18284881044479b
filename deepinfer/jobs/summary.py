"""``RunSummary``: the counters of a run and the closing line that reports them.

One engine, a DP group and a PD run all report through it: each rank fills one from its
engine, ranks are summed (``+`` or ``sum_over``; the elapsed time is the slowest rank's),
and ``format()`` is the ``done: ...`` line.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields


@dataclass
class RunSummary:
    """Counters of one run (or one rank of it)."""

    num_ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    weight_bytes: int = 0  # resident model weights (summed over ranks: each holds its own)
    elapsed: float = 0.0
    # The generation_config.json sampling defaults the engine took ("" if none): the
    # same on every rank (one model), so a sum keeps the first.
    model_defaults: str = ""

    @classmethod
    def of_engine(cls, engine, num_ok: int, failed: int, elapsed: float) -> RunSummary:
        """The counters of one ``LLMEngine`` after a run of ``elapsed`` seconds."""
        st, sst = engine.stats, engine.scheduler.stats
        taken = " ".join(f"{k}={v}" for k, v in engine.sampling_defaults.items())
        return cls(num_ok, failed, st.prompt_tokens, st.generated_tokens,
                   sst.num_preemptions, sst.prefix_cache_hits, sst.prefix_cache_queries,
                   engine.weight_bytes, elapsed, taken)

    @classmethod
    def from_dict(cls, d: dict) -> RunSummary:
        """The fields found in ``d`` (e.g. a PD rank's counters); the others are 0."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def counts(self) -> list[int]:
        """The integer counters in field order (for an all-reduce)."""
        return [int(v) for v in astuple(self)[:-2]]

    @classmethod
    def from_counts(cls, counts: list[int], elapsed: float, model_defaults: str = ""
                    ) -> RunSummary:
        """Inverse of ``counts``."""
        return cls(*counts, elapsed=elapsed, model_defaults=model_defaults)

    def __add__(self, other: RunSummary) -> RunSummary:
        names = [f.name for f in fields(self)][:-2]
        summed = {n: getattr(self, n) + getattr(other, n) for n in names}
        return RunSummary(**summed, elapsed=max(self.elapsed, other.elapsed),
                          model_defaults=self.model_defaults or other.model_defaults)

    @classmethod
    def sum_over(cls, parts: list[RunSummary]) -> RunSummary:
        """Counters summed over ranks; elapsed is the slowest rank's."""
        total = cls()
        for p in parts:
            total = total + p
        return total

    def format(self) -> str:
        """The end-of-run line."""
        elapsed = max(self.elapsed, 1e-9)
        gen, prompt = self.generated_tokens, self.prompt_tokens
        rate = self.prefix_cache_hits / max(self.prefix_cache_queries, 1)
        return (
            f"done: {self.num_ok} requests ok, {self.failed} failed | prompt {prompt} tok, "
            f"generated {gen} tok in {elapsed:.1f}s "
            f"({gen / elapsed:.1f} tok/s out, {(prompt + gen) / elapsed:.1f} tok/s total) | "
            f"preemptions {self.preemptions} | prefix-cache hit rate {rate:.1%} | "
            f"weights {self.weight_bytes / 1e6:.1f} MB"
            + (f" | model sampling defaults (generation_config.json): {self.model_defaults}"
               if self.model_defaults else "")
        )
