"""Resume: which records a killed or finished run already wrote.

A killed writer leaves at most its last line torn; ``resume_keys.valid_lines`` (the one rule
for a valid output line) stops there, and the torn tail is cut off before appending. A
whole line that is not a record is dropped with a warning (its record runs again).

OpenAI batch lines (objects with a ``custom_id``) are held to "one output line per input
line, in input order" here, at the start of every run, so that it holds even when
nothing is left to run (a run killed after its last record but before its final
reorder): a status-200 line is keyed by its custom_id (``resume_keys.line_key``); a second
one for the same custom_id, or one whose custom_id no longer has an input line (the input
changed), is dropped, the latter with a warning; the kept lines are put in input order.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from deepinfer.jobs.input_index import InputIndex
from deepinfer.jobs.parts import fold_part_files
from deepinfer.jobs.resume_keys import strict_json, valid_lines


def lock_output(path: str) -> Any:
    """Take the exclusive lock of output ``path`` (``<path>.lock``, held until the returned
    file is closed or the process ends): two runs appending to one output would each
    resume from a file the other is writing. ``ValueError`` naming ``--output`` when
    another process holds it. Without ``fcntl`` (Windows) nothing is locked (None)."""
    try:
        import fcntl
    except ImportError:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(f"{path}.lock", "a")  # noqa: SIM115 (held open: the lock lives with it)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ValueError(f"--output {path!r}: another run is writing it (it holds "
                         f"{path}.lock); wait for it or stop it, then rerun") from None
    return f


def check_output_format(path: str, openai: bool) -> None:
    """``ValueError`` naming ``--output`` when it already holds records of the other
    format (resume would take none of them as done, and drop them all): judged by its
    first record."""
    if not os.path.isfile(path):
        return
    for _, _, _, rec in valid_lines(path):
        if ("custom_id" in rec) != openai:
            held, job = (("deepinfer's own records", "an OpenAI batch file") if openai
                         else ("OpenAI batch lines", "deepinfer's own records"))
            raise ValueError(f"--output {path!r} holds {held} and the input is {job}: "
                             "name another output file")
        return


def load_done_ids(path: str, final: Callable[[dict], bool] | None = None,
                  order: dict[str, int] | None = None) -> set[str]:
    """Keys (``resume_keys.line_key``) already in the output file; a torn last line (killed
    run) is cut off the file. ``final(line)``: whether a line counts as done (default:
    every line); the others are removed from the file (through a temp file and
    ``os.replace``) to be written again. ``order``: input position of each record id;
    given, OpenAI batch lines are also checked against it (see the module docstring)."""
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    good_end = 0
    # (input position, offset, length) of the kept lines: offsets, not the lines, so a
    # large output costs a few bytes a line here.
    kept: list[tuple[int, int, int]] = []
    dropped = False
    openai = False  # the file holds OpenAI batch lines: keep them in input order
    stale: list[str] = []
    unreadable: list[int] = []
    for offset, raw, key, rec in valid_lines(path, unreadable):
        good_end = offset + len(raw)
        # A line with NaN / Infinity (an older deepinfer wrote -Infinity logprobs) is not
        # JSON: not done, so it is dropped and its record runs again.
        keep = (final is None or final(rec)) and strict_json(raw)
        if keep and order is not None and "custom_id" in rec:
            openai = True
            if key in done:
                keep = False  # a second status-200 line of one custom_id
            elif key not in order:
                keep = False
                stale.append(str(rec["custom_id"]))
        if keep:
            done.add(key)
            kept.append((order.get(key, len(order)) if order is not None else 0, offset,
                         len(raw)))
        else:
            dropped = True
    if unreadable:
        dropped = True
        where = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        print(f"deepinfer-generate: warning: {path}: dropped {len(unreadable)} line(s) that "
              f"are not output records (line {where}); their records run again",
              file=sys.stderr)
    if stale:
        names = ", ".join(repr(c) for c in stale[:5]) + (", ..." if len(stale) > 5 else "")
        print(f"deepinfer-generate: warning: {path}: dropped {len(stale)} result line(s) "
              f"whose custom_id has no line in the input any more: {names}",
              file=sys.stderr)
    unordered = openai and any(a[0] > b[0] for a, b in zip(kept, kept[1:]))
    if dropped or unordered:
        if openai:
            kept.sort(key=lambda e: e[0])  # stable: file order within one position
        tmp = f"{path}.resume.tmp"
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            for _, offset, length in kept:
                src.seek(offset)
                dst.write(src.read(length))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    elif good_end != os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def load_resume_state(output: str, order: dict[str, int],
                      final: Callable[[dict], bool] | None = None) -> set[str]:
    """Prepare ``output`` for a run and return the ids already done: create its folder,
    fold in part files left by a killed DP/PD run (they hold finished records), cut a
    torn last line, drop lines that are not ``final`` and put OpenAI batch lines in input
    order (``order``: first input position of each id; see ``load_done_ids``). Only one
    process of a run may call this (it rewrites the file)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fold_part_files(output, order)
    open(output, "a").close()  # an empty input still leaves its (empty) output
    return load_done_ids(output, final, order)


def announce_resume(index: InputIndex, done: set[str], output: str) -> int:
    """The number of records still to run; prints the resume line when some are done
    (one process of a run)."""
    pending = index.pending_count(done)
    if pending < index.records:
        print(f"resuming: {index.records - pending} of {index.records} records already in "
              f"{output}", file=sys.stderr)
    return pending
