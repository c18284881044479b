"""What a streamed job keeps of its whole input: one pass over the records indexes their
ids, and the records themselves are read again, lazily, while the job runs.

The index is what still grows with the input: the first position of each record id
(the order output files are merged and resumed in), the ids whose first record is an
error line, and the ``body.model`` names an OpenAI batch file gives. About 100-150
bytes a line for short ids (measured by ``benchmarks/bench_streaming.py``); the records,
their prompts and their request state are never all held.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from deepinfer.jobs.input_records import InputRecord, mark_duplicates


@dataclass
class InputIndex:
    """The ids of an input, in one pass (``of``).

    order       first input position of each id
    failing     ids whose first record is an error line (they run again on resume)
    models      ``body.model`` names of an OpenAI batch file's lines
    records     how many records (lines) the input holds
    """

    order: dict[str, int] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    records: int = 0

    @classmethod
    def of(cls, records: Iterable[InputRecord]) -> InputIndex:
        index = cls()
        for i, rec in enumerate(records):
            if rec.id not in index.order:
                index.order[rec.id] = i
                if rec.error is not None:
                    index.failing.add(rec.id)
            if rec.model:
                index.models.add(rec.model)
            index.records = i + 1
        return index

    def pending_count(self, done: set[str]) -> int:
        """How many records a run with ``done`` ids already written still has: every
        record but the first of each done id (error lines always run again)."""
        return self.records - sum(1 for rid in done
                                  if rid in self.order and rid not in self.failing)


def pending_stream(records: Iterable[InputRecord], done: set[str]) -> Iterator[InputRecord]:
    """The records still to run, lazily: repeated ids turned into error records (the
    first record of an id is the one that runs), those whose id is ``done`` skipped,
    error records always kept (their lines are written again)."""
    for rec in mark_duplicates(records):
        if rec.error is not None or rec.id not in done:
            yield rec
