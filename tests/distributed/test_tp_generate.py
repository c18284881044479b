"""``deepinfer-generate --tp N`` (and ``--dp M --tp N``, ``LLM(tensor_parallel_size=N)``)
over real gloo ranks on CPU with real weights.

Greedy decoding: a TP run must give the one-rank output token for token (the tiny
checkpoints and SmolLM2 have clear top-2 margins on these prompts; near-ties are the
model-level tests' business, test_tp_models.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from deepinfer.distributed.ranks import EXIT_RANK_FAILED
from deepinfer.generate import main
from deepinfer.jobs.parts import list_part_files
from tests.distributed.run_files import (
    ENV,
    ROOT,
    check_completed,
    children,
    long_run_input,
    read_lines,
    valid_part_lines,
    wait_for_record,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

PROMPTS = ["the quick brown fox", "hello world", "once upon a time", "a b c d e",
           "lazy dog", "paged attention"]


@pytest.fixture(scope="module")
def model_args(tiny_checkpoints) -> list[str]:
    # qwen2: q/k/v biases (sharded with their rows), tied embeddings (vocab-parallel
    # embedding doubles as the LM head).
    return ["--model", tiny_checkpoints["qwen2"].path, "--device", "cpu",
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--max-model-len", "64",
            "--no-progress"]


def _run(tmp_path, name: str, inp, args: list[str]) -> tuple[int, list[str]]:
    out = tmp_path / name
    rc = main(["--input", str(inp), "--output", str(out), *args])
    return rc, read_lines(out)


def _by_id(lines: list[str]) -> dict[str, list[int]]:
    return {r["id"]: r["outputs"][0]["token_ids"] for r in map(json.loads, lines)}


@pytest.fixture
def prompts_file(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(PROMPTS) + "\n")
    return inp


def test_dp2_tp2_equals_one_rank(tmp_path, prompts_file, model_args):
    """Four ranks: two replicas of two TP ranks each; the merged output equals one rank's,
    in input order, and no part file is left."""
    rc1, one = _run(tmp_path, "one.jsonl", prompts_file, model_args)
    rc, both = _run(tmp_path, "dptp.jsonl", prompts_file,
                    [*model_args, "--dp", "2", "--tp", "2"])
    assert (rc1, rc) == (0, 0)
    assert [json.loads(x)["id"] for x in both] == [str(i) for i in range(1, 7)]
    assert _by_id(both) == _by_id(one)
    assert list_part_files(str(tmp_path / "dptp.jsonl")) == []


def test_tp4_replicates_kv_heads(tmp_path, prompts_file, model_args):
    """4 ranks over 2 KV heads: each KV head is held by two ranks."""
    _, one = _run(tmp_path, "one.jsonl", prompts_file, model_args)
    rc, four = _run(tmp_path, "tp4.jsonl", prompts_file, [*model_args, "--tp", "4"])
    assert rc == 0
    assert _by_id(four) == _by_id(one)


def test_smollm2_tp3_equals_tp1(tmp_path, prompts_file, smollm2_path):
    """The default model's 9 heads / 3 KV heads over 3 ranks, with the chat template. In
    float32 (dtype auto would be bf16 on a CPU with native bf16, whose rounding of the
    split sums may flip a near-tie)."""
    args = ["--device", "cpu", "--dtype", "float32", "--max-tokens", "8", "--max-model-len", "128",
            "--kv-cache-memory", str(16 << 20), "--no-progress", "--chat"]
    _, one = _run(tmp_path, "one.jsonl", prompts_file, args)
    rc, three = _run(tmp_path, "tp3.jsonl", prompts_file, [*args, "--tp", "3"])
    assert rc == 0
    assert _by_id(three) == _by_id(one)


def test_tp_size_that_does_not_divide_exits_2(tmp_path, prompts_file, smollm2_path, capsys):
    rc = main(["--input", str(prompts_file), "--output", str(tmp_path / "o.jsonl"),
               "--device", "cpu", "--tp", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "num_attention_heads=9 is not divisible by 2" in err
    assert "Sizes that work: 1, 3\n" in err  # 9 splits heads, not intermediate_size 1536
    assert not (tmp_path / "o.jsonl").exists()


def test_tp_with_pd_exits_2(tmp_path, prompts_file, model_args, capsys):
    rc = main(["--input", str(prompts_file), "--output", str(tmp_path / "o.jsonl"),
               *model_args, "--tp", "2", "--pd", "1:1"])
    assert rc == 2
    assert "--pd 1:1 and --tp 2 cannot be combined" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tp_rank_killed_ends_run_then_rerun_resumes(tmp_path, model_args):
    """SIGKILL the TP follower once the leader wrote a record: the run ends with status 3
    in bounded time, naming the rank; a rerun finishes the file, one record per id."""
    inp = long_run_input(tmp_path)
    out = tmp_path / "out.jsonl"
    long_args = ["--max-model-len", "256", "--max-num-seqs", "1", "--dp-timeout", "20"]
    argv = [sys.executable, "-m", "deepinfer.generate", "--input", str(inp), "--output",
            str(out), "--tp", "2", *model_args, *long_args]
    launcher = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_for_record(tmp_path / "out.jsonl.part0", [launcher])
        ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        launcher.kill()
    assert launcher.returncode == EXIT_RANK_FAILED, err
    assert "rank 1 exited with code -9 (SIGKILL)" in err
    kept = valid_part_lines(out)
    assert kept
    assert main(["--input", str(inp), "--output", str(out), *model_args, "--tp", "2",
                 "--max-model-len", "256"]) == 0
    check_completed(out, kept)


def test_llm_tensor_parallel_size(tmp_path, tiny_checkpoints):
    """``LLM(..., tensor_parallel_size=2)`` in a fresh process (it joins a process group,
    so not in the test process): greedy outputs equal ``tensor_parallel_size=1``, and
    ``close()`` ends the followers; they outwait a caller idle past ``tp_timeout_s``; an
    engine that fails to build leaves no follower behind; a follower that dies is named
    by the next call."""
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_checkpoints["llama3"].path, f), no_tok / f)
    script = tmp_path / "llm_tp.py"
    script.write_text(textwrap.dedent(f"""
        import json, multiprocessing, time
        from deepinfer import LLM, SamplingParams

        if __name__ == "__main__":
            prompts = {PROMPTS!r}
            sp = SamplingParams(max_tokens=6, temperature=0)
            kw = dict(device="cpu", kv_cache_memory=8 << 20, max_model_len=64)
            path = {tiny_checkpoints["llama3"].path!r}
            with LLM(path, tensor_parallel_size=2, **kw) as llm:
                two = [o.outputs[0].token_ids for o in llm.generate(prompts, sp,
                                                                   use_tqdm=False)]
            left = len(multiprocessing.active_children())
            one = [o.outputs[0].token_ids
                   for o in LLM(path, **kw).generate(prompts, sp, use_tqdm=False)]
            # Idle past the collectives' timeout between calls: the followers still wait.
            with LLM(path, tensor_parallel_size=2, tp_timeout_s=2, **kw) as llm:
                time.sleep(4)
                late = [o.outputs[0].token_ids for o in llm.generate(prompts, sp,
                                                                    use_tqdm=False)]
            # The engine fails to build on the leader (no tokenizer): raised at once, the
            # followers gone.
            t0 = time.monotonic()
            try:
                LLM({str(tmp_path / "no_tokenizer")!r}, tensor_parallel_size=2, **kw)
                build_error = None
            except Exception as e:
                build_error = type(e).__name__
            build_s = time.monotonic() - t0
            left_after_error = len(multiprocessing.active_children())
            # A follower that dies: the next generate names it instead of gloo's words.
            llm = LLM(path, tensor_parallel_size=2, **kw)
            (follower,) = multiprocessing.active_children()
            follower.kill()
            follower.join()
            try:
                llm.generate(prompts, sp, use_tqdm=False)
                error = None
            except RuntimeError as e:
                error = str(e)
            llm.close()
            print(json.dumps({{"one": one, "two": two, "left": left, "error": error,
                              "late": late, "build_error": build_error,
                              "build_s": build_s, "left_after_error": left_after_error}}))
    """))
    res = subprocess.run([sys.executable, str(script)], env=ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["two"] == got["one"]
    assert all(len(t) == 6 for t in got["one"])
    assert got["left"] == 0
    assert got["error"].startswith("tensor-parallel rank 1 exited with code -9"), got
    assert got["late"] == got["one"]
    assert got["build_error"] is not None and got["left_after_error"] == 0, got
    assert got["build_s"] < 25, got  # not the followers' 30 s join, nor a timeout


def test_torchrun_tp_group_must_fit_on_one_node(tmp_path, prompts_file, model_args,
                                                monkeypatch, capsys):
    """Two nodes of 2 ranks cannot hold a 4-rank TP group: exit 2 before any rank
    starts (and no check of this node's GPU count against the whole world)."""
    for k, v in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    rc = main(["--input", str(prompts_file), "--output", str(tmp_path / "o.jsonl"),
               *model_args, "--tp", "4"])
    assert rc == 2
    assert "LOCAL_WORLD_SIZE=2 is not a multiple of it" in capsys.readouterr().err
