"""Resume: which records a killed or finished run already wrote.

A killed writer leaves at most its last line torn; ``records.valid_lines`` (the one rule
for a valid output line) stops there, and the torn tail is cut off before appending.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from deepinfer.jobs.parts import fold_part_files
from deepinfer.jobs.records import InputRecord, mark_duplicates, valid_lines


def load_done_ids(path: str, final: Callable[[dict], bool] | None = None) -> set[str]:
    """Ids already in the output file; a torn last line (killed run) is cut off the file.
    ``final(line)``: whether a line counts as done (default: every line); the others are
    removed from the file (through a temp file and ``os.replace``) to be written again."""
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    good_end = 0
    kept: list[bytes] = []  # the final lines, in order (rewritten only if some are not)
    dropped = False
    for offset, raw, rid, rec in valid_lines(path):
        if final is None or final(rec):
            done.add(rid)
            if final is not None:
                kept.append(raw)
        else:
            dropped = True
        good_end = offset + len(raw)
    if dropped:
        tmp = f"{path}.resume.tmp"
        with open(tmp, "wb") as dst:
            dst.writelines(kept)
        os.replace(tmp, path)
    elif good_end != os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def load_resume_state(output: str, inputs: list[InputRecord],
                      final: Callable[[dict], bool] | None = None) -> set[str]:
    """Prepare ``output`` for a run and return the ids already done: create its folder,
    fold in part files left by a killed DP/PD run (they hold finished records), cut a
    torn last line, drop lines that are not ``final`` (see ``load_done_ids``). Only one
    process of a run may call this (it rewrites the file)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fold_part_files(output, inputs)
    return load_done_ids(output, final)


def pending_records(inputs: list[InputRecord], done: set[str], output: str,
                    announce: bool = True) -> list[InputRecord]:
    """The records still to run, repeated ids turned into error records; ``announce``
    prints the resume line (one process of a run)."""
    pending = [r for r in inputs if r.id not in done]
    if announce and done:
        print(f"resuming: {len(inputs) - len(pending)} of {len(inputs)} records already in "
              f"{output}", file=sys.stderr)
    mark_duplicates(pending)
    return pending
