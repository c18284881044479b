"""Part files: each rank of a DP or PD run appends its records to ``OUTPUT.part{rank}``;
at the end (or when a killed run is resumed) they are merged into the output in input
order, through a temp file and ``os.replace``."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sys
from collections.abc import Iterable

from deepinfer.distributed.ranks import RankFailedError
from deepinfer.jobs.resume_keys import valid_lines

_PART_RE = re.compile(r"\.part(\d+)$")


def part_path(output: str, rank: int) -> str:
    """The part file of ``rank`` next to ``output``."""
    return f"{output}.part{rank}"


def list_part_files(output: str) -> list[str]:
    """Part files of ``output`` (any rank count), by rank."""
    paths = [p for p in glob.glob(glob.escape(output) + ".part*")
             if _PART_RE.search(p[len(output):])]
    return sorted(paths, key=lambda p: int(_PART_RE.search(p).group(1)))


def input_order(ids: Iterable[str]) -> dict[str, int]:
    """First input position of each id."""
    order: dict[str, int] = {}
    for i, rid in enumerate(ids):
        order.setdefault(rid, i)
    return order


def merge_outputs(output: str, order: dict[str, int], parts: list[str]) -> None:
    """Rewrite ``output`` as its records plus those of ``parts``, in input order; then
    remove the parts.

    ``order``: input position of each line key (``resume_keys.line_key``: the id, or for an
    OpenAI status-200 line the record id of its custom_id; keys not in it go last, in
    file order). Written to a temp file and moved into place, so a kill at any point
    leaves the old output and the parts, or the new output: never a half-written one.
    Records are copied byte for byte. A part line already in ``output`` is dropped: a
    kill between the move and the removal of the parts leaves parts whose lines the
    output holds. Identical lines within the output, or among the parts, are all kept:
    one run writes identical lines for distinct input lines (the error line of each
    repeat of an id, on one rank or on several).
    """
    has_output = os.path.exists(output)
    sources = ([output] if has_output else []) + parts
    entries: list[tuple[int, int, int, int, int]] = []  # key, seq, source, offset, length
    in_output: set[bytes] = set()
    for si, path in enumerate(sources):
        from_output = has_output and si == 0
        for offset, raw, rid, _ in valid_lines(path):
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if from_output:
                in_output.add(digest)
            elif digest in in_output:
                continue
            entries.append((order.get(rid, len(order)), len(entries), si, offset, len(raw)))
    entries.sort()
    tmp = f"{output}.merge.tmp"
    files = [open(p, "rb") for p in sources]
    try:
        with open(tmp, "wb") as out:
            for _, _, si, offset, length in entries:
                f = files[si]
                f.seek(offset)
                out.write(f.read(length))
            out.flush()
            os.fsync(out.fileno())
    finally:
        for f in files:
            f.close()
    os.replace(tmp, output)
    for p in parts:
        os.remove(p)


def fold_part_files(output: str, order: dict[str, int]) -> bool:
    """Merge part files left by a killed DP/PD run into ``output``; False if there were
    none. ``order``: first input position of each id (the merge order)."""
    parts = list_part_files(output)
    if not parts:
        return False
    print(f"resuming: merging {len(parts)} part file(s) of an earlier run into {output}",
          file=sys.stderr)
    merge_outputs(output, order, parts)
    return True


def merge_rank_parts(output: str, order: dict[str, int], world_size: int) -> None:
    """Rank 0, once every rank closed its part: merge all parts into ``output``.

    Raises ``RankFailedError`` if a part is not visible here (multi-node runs need the
    output folder on a filesystem every node shares).
    """
    parts = [part_path(output, r) for r in range(world_size)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise RankFailedError(
            f"rank 0 cannot see {missing[0]}: the output folder must be shared by all "
            "nodes; part files stay where they are")
    merge_outputs(output, order, parts)
