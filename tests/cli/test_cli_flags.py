"""``deepinfer-generate``'s engine flags come from ``EngineArgs``, one per field."""

from __future__ import annotations

from dataclasses import fields

import pytest

from deepinfer.cli import build_parser, engine_args_from
from deepinfer.engine_args import EngineArgs

BASE = ["--input", "in.txt", "--output", "out.jsonl"]


def test_every_user_field_has_a_flag_and_defaults_match():
    parser = build_parser()
    args = parser.parse_args(BASE)
    dests = {a.dest for a in parser._actions}  # argparse has no public list of actions
    for f in fields(EngineArgs):
        if f.metadata.get("cli", True):
            assert f.name in dests, f"EngineArgs.{f.name} has no command-line flag"
        else:
            assert f.name not in dests, f"EngineArgs.{f.name} is set by a mode, not a flag"
    assert engine_args_from(args) == EngineArgs()


def test_flags_reach_engine_args():
    args = build_parser().parse_args(BASE + [
        "--block-size", "32", "--no-prefix-caching", "--enforce-eager",
        "--max-model-len", "512", "--kv-cache-memory", "1234", "--attention-backend",
        "triton", "--gpu-memory-utilization", "0.5", "--model", "m.gguf",
        "--kv-cache-dtype", "int8"])
    ea = engine_args_from(args)
    assert ea.kv_cache_dtype == "int8"
    assert (ea.block_size, ea.enable_prefix_caching, ea.enforce_eager) == (32, False, True)
    assert (ea.max_model_len, ea.kv_cache_memory, ea.attention_backend) == (512, 1234, "triton")
    assert (ea.gpu_memory_utilization, ea.model) == (0.5, "m.gguf")
    assert ea.max_num_seqs is None  # tri-state: decided by the device


@pytest.mark.parametrize("flag, value", [("--block-size", "12"),
                                         ("--attention-backend", "cuda"),
                                         ("--kv-cache-dtype", "fp8")])
def test_bad_choice_is_rejected_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + [flag, value])
    assert flag in capsys.readouterr().err
