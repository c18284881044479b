"""deepinfer on Ray Data (issue 29, parts 2-3), on a real local Ray cluster (2 CPUs):
``deepinfer-generate --ray --replicas 2`` writes what a one-engine run writes, record for
record, error records included; a replica killed mid-run is restarted and its batches
run again, nothing lost or duplicated; a run resumes by skipping the ids written; bad
flag combinations exit 2. Skipped where Ray is not installed (``deepinfer[ray]``)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ray = pytest.importorskip("ray")

from deepinfer.generate import main  # noqa: E402
from deepinfer.jobs.ray_stage import EngineStage, ray_pipeline, record_of_row  # noqa: E402
from deepinfer.sampling.params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama_tied"].path


def _args(tiny: str) -> list[str]:
    return ["--model", tiny, "--device", "cpu", "--max-tokens", "4", "--kv-cache-memory",
            str(8 << 20), "--max-model-len", "64", "--no-progress"]


def _input(tmp_path, n: int = 24):
    lines = []
    for i in range(n):
        if i == 5:
            lines.append("{not json")
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"tell me about {i}",
                                     "max_tokens": 2 + i % 3}))
    lines.append(json.dumps({"id": "r1", "prompt": "a repeated id"}))
    lines.append(json.dumps({"id": "hot", "prompt": "x", "temperature": -1}))
    lines.append(json.dumps({"id": "seeded", "prompt": "once upon", "temperature": 1.0,
                             "seed": 7}))
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    return inp


def _one_engine(tmp_path, inp, tiny) -> list[str]:
    out = tmp_path / "one.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *_args(tiny)]) == 1
    return out.read_text().splitlines()


def test_two_replicas_write_what_one_engine_writes(tmp_path, tiny, cluster, capsys):
    inp = _input(tmp_path)
    want = _one_engine(tmp_path, inp, tiny)
    out = tmp_path / "ray.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *_args(tiny), "--ray",
                 "--replicas", "2"]) == 1
    got = out.read_text().splitlines()
    assert sorted(got) == sorted(want)  # greedy and seeded: the same records
    first = {}  # input position of each id
    for i, line in enumerate(inp.read_text().splitlines()):
        first.setdefault(json.loads(line)["id"] if line.startswith('{"') else str(i + 1), i)
    positions = [first[json.loads(x)["id"]] for x in got]
    assert positions == sorted(positions)  # merged in input order
    errors = {json.loads(x)["id"]: json.loads(x)["error"] for x in got
              if "error" in json.loads(x)}
    assert set(errors) == {"6", "r1", "hot"}  # the malformed line, the repeat, the value
    assert "done: 24 requests ok, 3 failed | ray: 2 replica(s)" in capsys.readouterr().err
    # Resume: the ids written are skipped; the output is whole and in order again.
    kept = got[:10]
    out.write_text("\n".join(kept) + "\n")
    assert main(["--input", str(inp), "--output", str(out), *_args(tiny), "--ray",
                 "--replicas", "2"]) == 1
    again = out.read_text().splitlines()
    assert sorted(again) == sorted(want)
    assert "resuming:" in capsys.readouterr().err


class DiesOnce(EngineStage):
    """A replica whose process dies at its first batch, once in the whole run (a marker
    file says it happened): Ray must restart it and run the batch again."""

    def __init__(self, *args, marker: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.marker = marker

    def __call__(self, batch):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return super().__call__(batch)


def test_a_killed_replica_is_retried(tmp_path, tiny, cluster):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    inp = _input(tmp_path, 16)
    want = {json.loads(x)["id"]: json.loads(x) for x in _one_engine(tmp_path, inp, tiny)
            if "duplicate id" not in x}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"lineno": i, "line": line}) + "\n"
                            for i, line in enumerate(inp.read_text().splitlines(), 1)
                            if i not in (6, 17)))  # the lines the driver writes itself
    marker = tmp_path / "died"
    stage = {"engine_args": {"model": tiny, "device": "cpu", "kv_cache_memory": 8 << 20,
                             "max_model_len": 64},
             "kind": "jsonl", "marker": str(marker),
             "default_params": SamplingParams.defaults(temperature=0.0, max_tokens=4)}
    bundles = ray_pipeline(str(rows), str(tmp_path / "out"), stage, replicas=2,
                           cpus_per_replica=0.5, batch_size=4, stage=DiesOnce)
    # The replicas ran in one placement group, a bundle each, freed at the end.
    assert bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert not [g for g in ray.util.placement_group_table().values()
                if g["state"] != "REMOVED"]
    assert marker.exists()  # a replica did die
    got = [json.loads(line) for f in sorted((tmp_path / "out").glob("*.json"))
           for line in f.read_text().splitlines()]
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(set(ids))  # nothing twice
    assert {r["id"]: record_of_row(r) for r in got} == {k: v for k, v in want.items()
                                                        if k in ids}
    assert len(ids) == 17  # every row sent came back (19 lines less the 2 written apart)


def test_bad_flags_exit_2(tmp_path, tiny, capsys):
    inp = _input(tmp_path, 2)
    out = str(tmp_path / "o.jsonl")
    for extra, flag in ((["--ray", "--dp", "2"], "--dp"),
                        (["--ray", "--pd", "1:1"], "--pd"),
                        (["--ray", "--replicas", "0"], "--replicas 0"),
                        (["--replicas", "2"], "--replicas 2: only with --ray")):
        assert main(["--input", str(inp), "--output", out, *_args(tiny), *extra]) == 2
        assert flag in capsys.readouterr().err
