"""``deepinfer-generate --lora NAME=PATH``: lines name an adapter with ``"lora"``; each
runs with it (PEFT's greedy tokens), a line without runs the base model, and a line
naming an adapter that was not given, or one that cannot be served, fails alone. Also
across ``--dp 2`` replicas (gloo processes)."""

from __future__ import annotations

import json

import pytest

from deepinfer.generate import main
from tests.checkpoints import tiny_configs
from tests.lora.adapters import greedy, save_peft_adapter
from tests.models.hf_checkpoints import save_random_model

NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cli")
    hf = save_random_model(tiny_configs()["llama3"], str(root / "model"), 0)
    peft = {"a": save_peft_adapter(hf, str(root / "a"), 1),
            "b": save_peft_adapter(hf, str(root / "b"), 2, r=2, alpha=4)}
    (root / "broken").mkdir()
    args = ["--model", str(root / "model"), "--device", "cpu", "--dtype", "float32",
            "--max-tokens", str(NEW), "--kv-cache-memory", str(8 << 20), "--no-progress",
            "--lora", f"a={root / 'a'}", "--lora", f"b={root / 'b'}",
            "--lora", f"broken={root / 'broken'}"]
    return root, hf, peft, args


def _run(root, args, lines, extra=()):
    inp, out = root / "in.jsonl", root / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out.unlink(missing_ok=True)
    rc = main(["--input", str(inp), "--output", str(out), *args, *extra])
    with open(out) as f:
        return rc, {r["id"]: r for r in map(json.loads, f)}




@pytest.mark.parametrize("dp", [1, 2])
def test_lines_run_with_their_adapters(setup, dp):
    root, hf, peft, args = setup
    from deepinfer.tokenizer import load_tokenizer

    tok = load_tokenizer(str(root / "model"))
    texts = ["hello world", "the quick brown fox", "once upon a time"]
    lines = []
    for i, text in enumerate(texts):
        for name in ("a", "b", None):
            line = {"id": f"{i}-{name}", "prompt": text, "ignore_eos": True}
            if name:
                line["lora"] = name
            lines.append(line)
    lines += [{"id": "unknown", "prompt": "hi", "lora": "zzz"},
              {"id": "broken", "prompt": "hi", "lora": "broken"},
              {"id": "not-a-name", "prompt": "hi", "lora": 3}]
    rc, recs = _run(root, args, lines, ("--dp", str(dp)))
    assert rc == 1
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=True)
        for name in ("a", "b", None):
            want = greedy(peft[name] if name else hf, ids, NEW)
            assert recs[f"{i}-{name}"]["outputs"][0]["token_ids"] == want, (i, name)
    assert "lora 'zzz' is not one of the --lora names (a, b, broken)" in recs["unknown"]["error"]
    assert "LoRARequest 'broken'" in recs["broken"]["error"]
    assert "no adapter_config.json" in recs["broken"]["error"]
    assert "'lora' must be the name of a --lora adapter, got 3" in recs["not-a-name"]["error"]


@pytest.mark.parametrize("flags, message", [
    (["--lora", "nopath"], "--lora 'nopath': expected NAME=PATH"),
    (["--lora", "a=x", "--lora", "a=y"], "the name 'a' is given twice"),
    (["--lora", "a=x", "--pd", "1:1"], "--lora and --pd cannot be combined yet"),
    (["--max-lora-rank", "0"], "max_lora_rank=0: expected a positive integer"),
])
def test_bad_flags_exit_2(setup, flags, message, capsys):
    root, _, _, args = setup
    inp = root / "flags.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    base = args[:args.index("--lora")]
    assert main(["--input", str(inp), "--output", str(root / "flags_out.jsonl"),
                 *base, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_line_naming_an_adapter_without_any_given(setup):
    root, _, _, args = setup
    base = args[:args.index("--lora")]
    rc, recs = _run(root, base, [{"id": "x", "prompt": "hi", "lora": "a"},
                                 {"id": "y", "prompt": "hi"}])
    assert rc == 1 and "outputs" in recs["y"]
    assert "lora 'a': no adapters were given (--lora NAME=PATH)" in recs["x"]["error"]
