"""A checkpoint's ``generation_config.json`` sampling defaults (issue 28, part 3): taken
for the fields a request leaves out; the request's own value, then a command-line flag,
come first; ``generation_config="none"`` / ``--generation-config none`` ignores them; bad
values are dropped with a warning; the run summary names what was taken."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.generate import main
from deepinfer.hf_config import generation_sampling_keys
from deepinfer.sampling.params import MODEL_DEFAULTABLE, checked_defaults

GEN = {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.05,
       "max_new_tokens": 3, "do_sample": True}


@pytest.fixture(scope="module")
def model_with_defaults(tiny_checkpoints, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gen_defaults") / "llama3"
    shutil.copytree(tiny_checkpoints["llama3"].path, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **GEN}))
    return str(path)


def test_params_tell_unset_from_set():
    p = SamplingParams(temperature=1.0)
    assert "temperature" not in p.unset and p.unset == set(MODEL_DEFAULTABLE) - {"temperature"}
    assert p.max_tokens == 16 and p.top_p == 1.0  # built-in values until a model's apply
    q = p.replace(top_p=0.5)
    assert q.unset == p.unset - {"top_p"}
    d = q.with_defaults({"temperature": 0.2, "top_p": 0.7, "top_k": 3})
    assert (d.temperature, d.top_p, d.top_k) == (1.0, 0.5, 3)  # own values win
    assert p.with_defaults({}) is p
    # A format's default (greedy records) stays below the model's.
    fmt = SamplingParams.defaults(temperature=0.0, max_tokens=128)
    assert fmt.with_defaults({"temperature": 0.6}).temperature == 0.6
    assert fmt.replace(temperature=0.0).with_defaults({"temperature": 0.6}).temperature == 0
    with pytest.raises(ValueError, match="min_tokens=5.*generation_config.json"):
        SamplingParams(min_tokens=5).with_defaults({"max_tokens": 3})


def test_file_keys_map_and_bad_values_are_dropped():
    assert generation_sampling_keys(GEN) == {
        "temperature": 0.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.05,
        "max_tokens": 3}
    assert generation_sampling_keys({"temperature": None}) == {}
    with pytest.warns(UserWarning, match=r"generation_config.json: top_p=5.*ignored"):
        ok = checked_defaults({"top_p": 5, "temperature": 0.7})
    assert ok == {"temperature": 0.7}


def test_llm_takes_them_unless_told_not_to(model_with_defaults):
    llm = LLM(model_with_defaults, device="cpu", kv_cache_memory=8 << 20)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (
        0.0, 5, 0.9, 1.05, 3)
    [out] = llm.generate(["hello world"], SamplingParams(ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    [own] = llm.generate(["hello world"], SamplingParams(ignore_eos=True, max_tokens=5),
                         use_tqdm=False)
    assert len(own.outputs[0].token_ids) == 5
    off = LLM(model_with_defaults, device="cpu", kv_cache_memory=8 << 20,
              generation_config="none")
    assert off.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config='some'"):
        LLM(model_with_defaults, device="cpu", generation_config="some")


def _run(tmp_path, model: str, name: str, *flags: str) -> tuple[dict[str, int], str]:
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.out.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in (
        {"id": "left_out", "prompt": "hello world", "ignore_eos": True},
        {"id": "own", "prompt": "hello world", "ignore_eos": True, "max_tokens": 5},
    )) + "\n")
    rc = main(["--input", str(inp), "--output", str(out), "--model", model, "--device",
               "cpu", "--kv-cache-memory", str(8 << 20), "--no-progress", *flags])
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    return {r["id"]: len(r["outputs"][0]["token_ids"]) for r in recs}, name


def test_precedence_in_a_job(tmp_path, model_with_defaults, capsys):
    got, _ = _run(tmp_path, model_with_defaults, "auto")
    assert got == {"left_out": 3, "own": 5}  # the file's max_new_tokens, the line's own
    err = capsys.readouterr().err
    assert "model sampling defaults (generation_config.json): temperature=0.0" in err
    assert "max_tokens=3" in err
    got, _ = _run(tmp_path, model_with_defaults, "flag", "--max-tokens", "4")
    assert got == {"left_out": 4, "own": 5}  # the flag over the file, the line over both
    capsys.readouterr()
    got, _ = _run(tmp_path, model_with_defaults, "none", "--generation-config", "none")
    assert got["left_out"] > 3 and got["own"] == 5  # deepinfer records' own default
    assert "model sampling defaults" not in capsys.readouterr().err


def test_an_unknown_choice_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--input", "x.jsonl", "--output", "o.jsonl", "--generation-config", "vllm"])
    assert exc.value.code == 2 and "--generation-config" in capsys.readouterr().err
