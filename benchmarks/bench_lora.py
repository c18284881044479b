"""LoRA adapters' cost on the CPU, on the default model (SmolLM2-135M-Instruct, Q4_1
GGUF), in one process: batched offline generation (generated tok/s, greedy,
``ignore_eos``) of one seeded workload through

1. an engine without LoRA (the baseline),
2. an ``enable_lora`` engine with no request naming an adapter (the idle hooks' cost),
3. that engine with every request on one rank-8 adapter,
4. requests spread round robin over 4 rank-8 adapters,
5. every request on one rank-64 adapter,

then single-stream decode tok/s (one request, 128 tokens), baseline vs one rank-8
adapter. Each is reported with its ratio to the baseline of the same run. Two engines
(``LLM()`` and ``LLM(enable_lora=True)``) serve every case; the cases run in turn, round
after round (the median round counts), so that a busy machine slows them alike.

The workload is small (16 requests of 16-64 tokens in and as many out, 2 rounds) so
that the whole run stays near 5 minutes on 2 cores of a CPU with AVX2 only, where the
default model generates ~30-40 tok/s batched (``--num-requests`` and ``--reps`` for
more).

The adapters are PEFT's own (``get_peft_model`` on a transformers Llama of the default
model's shapes, A and B drawn from N(0, 0.05), ``save_pretrained``) on all seven
projections, ``lora_alpha = 2 r``; the base weights under them do not matter to the
files, so they are left uninitialised. The prefix cache is off in both engines: every
round sends the same prompts, and a cached prompt would make later rounds cheaper.

    python benchmarks/bench_lora.py              # prints the table
    python benchmarks/bench_lora.py --save       # results/lora-cpu.{json,md}

The ``test_`` function at the bottom checks correctness on a tiny run (never timing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
from results_meta import save_cpu_table, table_lines
from throughput_workload import Workload, make_workload

NUM_REQUESTS, MIN_LEN, MAX_LEN, SEED = 16, 16, 64, 0
REPS, SINGLE_REPS = 2, 2
SINGLE_TOKENS = 128
#: (case, adapters it spreads its requests over: keys of ``ADAPTERS``; () for none)
CASES = [("no LoRA (baseline)", None), ("enable_lora, no adapter", ()),
         ("1 adapter, rank 8", ("r8a",)),
         ("4 adapters, rank 8 (round robin)", ("r8a", "r8b", "r8c", "r8d")),
         ("1 adapter, rank 64", ("r64",))]
#: name -> (lora_int_id, rank, seed)
ADAPTERS = {"r8a": (1, 8, 1), "r8b": (2, 8, 2), "r8c": (3, 8, 3), "r8d": (4, 8, 4),
            "r64": (5, 64, 5)}


def save_adapter(model_config, path: str, rank: int, seed: int, std: float = 0.05) -> str:
    """A PEFT LoRA adapter of rank ``rank`` (alpha 2 r) on all seven projections of a
    Llama of ``model_config``'s shapes (the engine's ``ModelConfig``), A and B from
    N(0, ``std``), saved under ``path``; returns ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepinfer.testing.lora_adapters import save_random_peft_adapter

    mc = model_config
    cfg = LlamaConfig(hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                      num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                      num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                      vocab_size=16, tie_word_embeddings=True)
    with torch.device("meta"):  # the base weights are not saved: skip their init
        base = LlamaForCausalLM(cfg)
    base.to_empty(device="cpu")
    save_random_peft_adapter(base, path, seed, rank, 2 * rank, std=std)
    return path


def generate(llm, wl: Workload, lora) -> tuple[float, int, list[list[int]]]:
    """Seconds, generated tokens and each request's token ids for the whole workload
    (greedy, ``ignore_eos``), ``lora`` as ``LLM.generate``'s ``lora_request``."""
    from deepinfer import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in wl.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False, lora_request=lora)
    elapsed = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return elapsed, sum(map(len, ids)), ids


def requests_for(names, reqs: dict, n: int):
    """``lora_request`` for ``n`` requests spread round robin over ``names``."""
    if not names:
        return None
    return [reqs[names[i % len(names)]] for i in range(n)]


def engines(adapter_dir: str, names=tuple(ADAPTERS), **kw):
    """The baseline engine, the ``enable_lora`` one, and a ``LoRARequest`` per adapter
    ``names`` of ``ADAPTERS``, saved under ``adapter_dir``."""
    from deepinfer import LLM, LoRARequest

    base = LLM(device="cpu", enable_prefix_caching=False, **kw)
    lora = LLM(device="cpu", enable_prefix_caching=False, enable_lora=True,
               max_loras=len(ADAPTERS), max_lora_rank=64, **kw)
    mc = lora.engine.model_config
    reqs = {}
    for name in names:
        lid, rank, seed = ADAPTERS[name]
        reqs[name] = LoRARequest(name, lid, save_adapter(mc, f"{adapter_dir}/{name}", rank,
                                                         seed))
    return base, lora, reqs


def batched_rows(base, lora, reqs: dict, wl: Workload, reps: int) -> list[dict]:
    """Every case of ``CASES`` over ``wl``, ``reps`` rounds (after one warm-up round on
    the first requests, which also loads every adapter): median seconds, tok/s and the
    ratio to the baseline."""
    warm = Workload(wl.prompts[:4], [4] * 4)
    runs = []
    for label, names in CASES:
        llm = base if names is None else lora
        runs.append((label, llm, names))
        generate(llm, warm, requests_for(names, reqs, 4))
    times: dict[str, list[float]] = {label: [] for label, *_ in runs}
    tokens: dict[str, int] = {}
    for rnd in range(reps):
        for label, llm, names in runs:
            s, tok, _ = generate(llm, wl, requests_for(names, reqs, len(wl.prompts)))
            times[label].append(s)
            tokens[label] = tok
            print(f"round {rnd}: {label}: {s:.2f} s, {tok / s:.1f} tok/s", flush=True)
    rows = []
    for label, *_ in runs:
        s = statistics.median(times[label])
        rows.append({"case": label, "requests": len(wl.prompts), "tokens": tokens[label],
                     "seconds": round(s, 2), "tok/s": round(tokens[label] / s, 1)})
    return _with_ratios(rows)


def single_stream_rows(base, lora, reqs: dict, prompt: list[int], reps: int) -> list[dict]:
    """Single-stream greedy decode tok/s, baseline and one rank-8 adapter:
    ``(tokens - 1) / (t(tokens) - t(1))`` (the prompt's step taken out), median of
    ``reps`` rounds, the two interleaved."""
    runs = [("single stream, no LoRA (baseline)", base, None),
            ("single stream, 1 adapter, rank 8", lora, reqs["r8a"])]
    n = SINGLE_TOKENS

    def once(llm, req, tokens: int) -> float:
        return generate(llm, Workload([prompt], [tokens]), req)[0]

    for _, llm, req in runs:
        once(llm, req, 8)  # warm-up
    decode: dict[str, list[float]] = {label: [] for label, *_ in runs}
    for _ in range(reps):
        for label, llm, req in runs:
            decode[label].append(once(llm, req, n) - once(llm, req, 1))
    rows = []
    for label, *_ in runs:
        s = statistics.median(decode[label])
        rows.append({"case": label, "requests": 1, "tokens": n, "seconds": round(s, 2),
                     "tok/s": round((n - 1) / s, 1)})
    return _with_ratios(rows)


def _with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its tok/s over the first row's (the baseline)."""
    for r in rows:
        r["vs baseline"] = f"{r['tok/s'] / rows[0]['tok/s']:.2f}x"
    return rows


def run(num_requests: int = NUM_REQUESTS, reps: int = REPS, single_reps: int = SINGLE_REPS
        ) -> list[dict]:
    """The table's rows: the batched cases, then the single-stream ones."""
    with tempfile.TemporaryDirectory() as tmp:
        base, lora, reqs = engines(tmp)
        vocab = base.engine.model_config.vocab_size
        wl = make_workload(num_requests, MIN_LEN, MAX_LEN, vocab, SEED)
        rows = batched_rows(base, lora, reqs, wl, reps)
        rows += single_stream_rows(base, lora, reqs, wl.prompts[0][:MIN_LEN], single_reps)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--reps", type=int, default=REPS, help="rounds of the batched cases")
    ap.add_argument("--single-reps", type=int, default=SINGLE_REPS,
                    help="rounds of the single-stream cases")
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/lora-cpu.{json,md}")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args.num_requests, args.reps, args.single_reps)
    total = time.perf_counter() - t0
    print("\n".join(table_lines(list(rows[0]), rows)))
    print(f"total {total:.0f} s", file=sys.stderr)
    if not args.save:
        return
    out = save_cpu_table(
        "lora-cpu", "LoRA adapters on the default model, CPU",
        "python benchmarks/bench_lora.py --save", rows,
        "SmolLM2-135M-Instruct (Q4_1 GGUF, served as by default: GGUF blocks, the default "
        "dtype: bf16 where the CPU has native bf16, else float32), prefix cache off. "
        f"Batched: {args.num_requests} seeded random "
        f"requests ({MIN_LEN}-{MAX_LEN} tokens in and as many out, greedy, ignore_eos) "
        f"in one `generate`, median of {args.reps} rounds of every case in turn; "
        "seconds = the whole call. Single stream: one 16-token prompt, "
        f"{SINGLE_TOKENS} tokens, decode tok/s = (tokens - 1) / (t(tokens) - t(1)), "
        f"median of {args.single_reps} rounds. PEFT adapters on all seven projections "
        "(alpha 2 r); the baseline is an engine without LoRA in the same process. A step "
        "with an adapter runs the decoder layer by layer (the CPU's fused C decode step "
        "declines it), adding x A^T B^T to every projection. torch's CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}; the whole run took {total:.0f} s.",
        args.reps)
    print(f"wrote {out}.json/.md", file=sys.stderr)


def test_lora_outputs_tiny():
    """Correctness only: an ``enable_lora`` engine without adapters gives the plain
    engine's tokens; a rank-8 adapter changes every request's, and spreading the
    requests over four adapters changes them again."""
    import pytest

    pytest.importorskip("peft")
    from deepinfer.loading.loader import resolve_model_path

    try:
        resolve_model_path(None)
    except (OSError, ValueError, RuntimeError) as exc:
        pytest.skip(f"default model not installed: {exc}")
    with tempfile.TemporaryDirectory() as tmp:
        four_r8 = ("r8a", "r8b", "r8c", "r8d")
        base, lora, reqs = engines(tmp, four_r8, kv_cache_memory=64 << 20)
        wl = make_workload(4, 4, 8, base.engine.model_config.vocab_size, SEED)
        wl = Workload(wl.prompts, [8] * 4)
        _, tok, plain = generate(base, wl, None)
        assert tok == 32
        assert generate(lora, wl, None)[2] == plain
        one = generate(lora, wl, requests_for(("r8a",), reqs, 4))[2]
        assert all(a != b for a, b in zip(one, plain))
        four = generate(lora, wl, requests_for(four_r8, reqs, 4))[2]
        assert all(a != b for a, b in zip(four, plain))
        assert any(a != b for a, b in zip(four[1:], one[1:]))


if __name__ == "__main__":
    main()
