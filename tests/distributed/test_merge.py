"""Part-file merge and resume bookkeeping (no processes)."""

from __future__ import annotations

import json

from deepinfer.generate import main
from deepinfer.jobs.parts import list_part_files, merge_outputs, part_path


def _line(rid: str, text: str = "x") -> str:
    return json.dumps({"id": rid, "outputs": [{"text": text}]}) + "\n"


def test_merge_orders_dedups_and_drops_torn_lines(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with open(out, "w") as f:
        f.write(_line("c") + _line("a"))
    with open(part_path(out, 0), "w") as f:
        f.write(_line("b") + _line("a") + '{"id": "d", "outp')  # a kept once; torn d dropped
    with open(part_path(out, 1), "w") as f:
        f.write(_line("zz") + _line("e"))
    (tmp_path / "out.jsonl.partial").write_text("not a part file\n")
    parts = list_part_files(out)
    assert parts == [part_path(out, 0), part_path(out, 1)]
    merge_outputs(out, {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}, parts)
    with open(out) as f:
        ids = [json.loads(line)["id"] for line in f]
    assert ids == ["a", "b", "c", "e", "zz"]  # input order; unknown ids last
    assert list_part_files(out) == []
    assert (tmp_path / "out.jsonl.partial").exists()


def test_single_rank_resume_folds_part_files(tmp_path, tiny_checkpoints):
    """A DP run killed midway left part files: a --dp 1 rerun skips what they hold."""
    inp = tmp_path / "in.txt"
    inp.write_text("hello world\nthe quick brown fox\n")
    out = tmp_path / "out.jsonl"
    kept = _line("2", "from an earlier run")
    (tmp_path / "out.jsonl.part3").write_text(kept + '{"id": "1", "outp')
    args = ["--model", tiny_checkpoints["llama_tied"].path, "--device", "cpu",
            "--max-tokens", "3", "--max-model-len", "64", "--kv-cache-memory", str(8 << 20),
            "--no-progress"]
    assert main(["--input", str(inp), "--output", str(out), *args]) == 0
    lines = out.read_text().splitlines(keepends=True)
    assert sorted(json.loads(x)["id"] for x in lines) == ["1", "2"]
    assert kept in lines  # the earlier record, byte for byte
    assert list_part_files(str(out)) == []


def test_merge_keeps_identical_lines_of_one_run(tmp_path):
    """A run writes byte-identical lines for distinct input lines (the error line of each
    repeat of an id), in one part or in several: all are kept, as one engine keeps
    them. Only a part line already in the output (a kill between the move and the
    removal of the parts) is dropped."""
    out = str(tmp_path / "out.jsonl")
    dup = json.dumps({"id": "x", "error": "duplicate id 'x' in the input"}) + "\n"
    with open(out, "w") as f:
        f.write(_line("a") + dup + dup)  # an earlier run's two repeats of "x"
    with open(part_path(out, 0), "w") as f:
        f.write(_line("b") + _line("y") + _line("y"))
    with open(part_path(out, 1), "w") as f:
        f.write(_line("y") + _line("c"))
    order = {"a": 0, "x": 1, "b": 2, "y": 3, "c": 4}
    merge_outputs(out, order, list_part_files(out))
    with open(out) as f:
        merged = f.read()
    assert [json.loads(x)["id"] for x in merged.splitlines()] == \
        ["a", "x", "x", "b", "y", "y", "y", "c"]
    # Killed after the move, before part 1 was removed: merging again changes nothing.
    with open(part_path(out, 1), "w") as f:
        f.write(_line("y") + _line("c"))
    merge_outputs(out, order, list_part_files(out))
    with open(out) as f:
        assert f.read() == merged
