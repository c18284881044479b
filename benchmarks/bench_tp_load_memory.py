"""Peak host memory of each tensor-parallel rank while it loads its shard (CPU).

A random-weight Llama checkpoint (safetensors, one file) is written once; then, for each
TP size, one spawned process per rank runs ``load_model(path, tp=TPGroup(rank, size,
None))`` (loading needs no process group: a rank reads its own slices) and reports:

* ``peak_delta``: the kernel's high-water mark of resident memory during the load minus
  the RSS before it (imports done): ``VmHWM`` after loading, reset to the current RSS by
  writing 5 to ``/proc/self/clear_refs`` just before (so the import peak drops out).
  ``peak_delta_ru_maxrss`` is the same from ``ru_maxrss``, which cannot be reset: it also
  holds the import peak and, in a spawned child, the parent's RSS at exec (the parent
  therefore imports no torch); equal to ``peak_delta`` when the load's peak is the
  highest.
* ``peak_anon`` / ``peak_file``: the largest ``RssAnon`` (private memory: the parameters
  and any temporary copies) and ``RssFile`` (pages of the memory-mapped safetensors file
  that this process touched) seen by a thread sampling ``/proc/self/status`` every few
  milliseconds while loading (a sampled peak: it can miss a peak shorter than that).
* ``shard_bytes``: the bytes of the rank's parameters (what it must hold in the end).
* ``touched_*``: the RSS after reading every parameter once (what the first forward
  does): equal to the load's anon figure when no parameter is a view of the file (the
  loader copies safetensors tensors; a view would become resident only then).

Safetensors files are memory-mapped, and a slice read through ``get_slice`` copies its
rows out of the mapping: the pages it touches count in RSS as file-backed, shared, clean
pages (the page cache, which the kernel can drop without writing anything; several ranks
reading the same file share them). A row-parallel weight (o_proj, down_proj) is cut along
its columns, so every row of the whole tensor is touched, and its whole size shows up in
``RssFile`` even though the rank keeps a quarter of it. ``RssAnon`` is what each rank
really pays in private memory.

    python benchmarks/bench_tp_load_memory.py                  # ~1 GB fp32, tp 1, 2, 4
    python benchmarks/bench_tp_load_memory.py --tp 1,2 --layers 4

Results: benchmarks/results/tp-load-memory-{cpu}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import threading
import time

from results_meta import git_commit, utc_now
from tree_state import commit_label, uncommitted_source

# torch is imported in the child processes only: a spawned child starts with its parent's
# resident size as its ru_maxrss (the kernel keeps the high-water mark across exec), so
# the parent stays small.

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 1 << 20


def make_checkpoint(out_dir: str, *, hidden: int, intermediate: int, layers: int,
                    heads: int, kv_heads: int, vocab: int, dtype: str,
                    seed: int = 0) -> str:
    """A random Llama checkpoint (config.json + one safetensors file) in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="50GB")
    del model
    return out_dir


def checkpoint_bytes(path: str) -> tuple[int, int]:
    """``(tensor bytes, file bytes)`` of the safetensors files in ``path``, from their
    headers (no torch in this process)."""
    tensors = files = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        full = os.path.join(path, name)
        files += os.path.getsize(full)
        with open(full, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        tensors += sum(end - start for key, meta in header.items() if key != "__metadata__"
                       for start, end in [meta["data_offsets"]])
    return tensors, files


def _in_child(fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)`` in a spawned process (this one stays small: see the note
    at the imports)."""
    import multiprocessing as mp

    proc = mp.get_context("spawn").Process(target=fn, args=args, kwargs=kwargs)
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{fn.__name__}{args}: exit {proc.exitcode}")


def _mapped_ranges(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files whose name ends with
    ``suffix``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(suffix):
                a, b = parts[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def _status_kib() -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile``, ``VmHWM`` of this process, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


class _Sampler(threading.Thread):
    """Polls ``/proc/self/status`` and keeps the largest value of each field."""

    def __init__(self, period_s: float) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for k, v in _status_kib().items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            self.samples += 1
            time.sleep(self.period_s)

    def stop(self) -> dict[str, int]:
        self._halt.set()
        self.join()
        return self.peak


def warmup_path(path: str) -> str:
    return path.rstrip("/") + "-warmup"


def measure_rank(path: str, rank: int, size: int, dtype: str, period_s: float,
                 queue) -> None:
    """Child process: load rank ``rank`` of ``size`` and put its figures on ``queue``.

    A tiny checkpoint of the same architecture is loaded (and dropped) first, so that the
    modules, shared libraries and allocator arenas the loader brings in on first use are
    in place before the measured load: what is left is the cost of the weights."""
    try:
        import gc

        import torch

        from deepinfer.loading.loader import load_model
        from deepinfer.models.tensor_parallel import TPGroup

        torch.set_num_threads(1)
        load_model(warmup_path(path), dtype=dtype, device="cpu", tp=TPGroup(rank, size, None))
        gc.collect()
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        # Reset VmHWM (the mm's peak RSS) to the current RSS: the import peak drops out.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib()
        sampler = _Sampler(period_s)
        sampler.start()
        t0 = time.perf_counter()
        model, _ = load_model(path, dtype=dtype, device="cpu", tp=TPGroup(rank, size, None))
        seconds = time.perf_counter() - t0
        peak = sampler.stop()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        after = _status_kib()
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        # Read every parameter once (what the first forward does): weights adopted from
        # the memory-mapped file (tp=1, see the module note) become resident only now.
        with torch.inference_mode():
            for t in [*model.parameters(), *model.buffers()]:
                t.sum()
        touched = _status_kib()
        # Diagnostic: which parameters are views of the mapping (they keep it, and every
        # page read through it, in this process), and the RSS once they are copied out
        # and the mapping is gone.
        mapped = _mapped_ranges(".safetensors")
        in_map = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                  if any(a <= t.data_ptr() < b for a, b in mapped)]
        mapped_bytes = 0
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if n in in_map:
                mapped_bytes += t.numel() * t.element_size()
                t.data = t.data.clone()
        gc.collect()
        released = _status_kib()
        still_mapped = bool(_mapped_ranges(".safetensors"))
        k = 1024
        queue.put({
            "rank": rank, "size": size, "seconds": seconds,
            "shard_bytes": shard, "buffer_bytes": buffers,
            "rss_before": before["VmRSS"] * k, "maxrss_before": maxrss_before * k,
            "maxrss_after": maxrss * k,
            # VmHWM after the reset: the load's own peak; ru_maxrss: the same unless an
            # earlier peak (imports, the parent at exec) was higher.
            "peak_delta": (after["VmHWM"] - before["VmRSS"]) * k,
            "peak_delta_ru_maxrss": (maxrss - before["VmRSS"]) * k,
            "peak_anon": (peak.get("RssAnon", 0) - before["RssAnon"]) * k,
            "peak_file": (peak.get("RssFile", 0) - before["RssFile"]) * k,
            "after_anon": (after["RssAnon"] - before["RssAnon"]) * k,
            "after_file": (after["RssFile"] - before["RssFile"]) * k,
            "touched_delta": (touched["VmRSS"] - before["VmRSS"]) * k,
            "touched_anon": (touched["RssAnon"] - before["RssAnon"]) * k,
            "touched_file": (touched["RssFile"] - before["RssFile"]) * k,
            "views_of_mapping": len(in_map), "views_of_mapping_bytes": mapped_bytes,
            "views_of_mapping_names": in_map[:4],
            "released_delta": (released["VmRSS"] - before["VmRSS"]) * k,
            "released_anon": (released["RssAnon"] - before["RssAnon"]) * k,
            "released_file": (released["RssFile"] - before["RssFile"]) * k,
            "mapping_left_after_release": still_mapped,
            "samples": sampler.samples,
        })
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put({"rank": rank, "size": size, "error": f"{type(e).__name__}: {e}"})


def measure(path: str, size: int, dtype: str, period_s: float) -> list[dict]:
    """Every rank of a ``size``-way split, each in its own spawned process, all at once
    (as a ``--tp`` launch loads them)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=measure_rank, args=(path, r, size, dtype, period_s, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"tp={size}: {errors}")
    return sorted(results, key=lambda r: r["rank"])


def run(args: argparse.Namespace) -> dict:
    sizes = [int(x) for x in str(args.tp).split(",") if x.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        tiny = dict(hidden=64, intermediate=128, layers=1, heads=8, kv_heads=8, vocab=256)
        spec = dict(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                    heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)
        for folder, shape in ((path, spec), (warmup_path(path), tiny)):
            if not os.path.isfile(os.path.join(folder, "config.json")):
                _in_child(make_checkpoint, folder, **shape, dtype=args.checkpoint_dtype)
        print(f"checkpoints ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        tensor_bytes, file_bytes = checkpoint_bytes(path)
        runs = {}
        for n in sizes:
            runs[str(n)] = measure(path, n, args.dtype, args.sample_ms / 1000)
            worst = max(r["peak_delta"] for r in runs[str(n)])
            print(f"tp={n}: worst rank peak {worst / MiB:.0f} MiB", file=sys.stderr)
    with open("/proc/meminfo") as f:
        mem_total = int(f.readline().split()[1]) * 1024
    whole = runs.get("1", [{}])[0].get("shard_bytes")
    summary = []
    for n, ranks in runs.items():
        shard = max(r["shard_bytes"] for r in ranks)
        summary.append({
            "tp": int(n), "shard_bytes": shard,
            "shard_vs_whole": shard / whole if whole else None,
            "max_peak_delta": max(r["peak_delta"] for r in ranks),
            "max_peak_delta_ru_maxrss": max(r["peak_delta_ru_maxrss"] for r in ranks),
            "max_peak_anon": max(r["peak_anon"] for r in ranks),
            "max_peak_file": max(r["peak_file"] for r in ranks),
            "peak_delta_vs_shard": max(r["peak_delta"] / r["shard_bytes"] for r in ranks),
            "peak_anon_vs_shard": max(r["peak_anon"] / r["shard_bytes"] for r in ranks),
            "max_touched_delta": max(r["touched_delta"] for r in ranks),
            "touched_vs_shard": max(r["touched_delta"] / r["shard_bytes"] for r in ranks),
            "max_touched_anon": max(r["touched_anon"] for r in ranks),
            "max_released_delta": max(r["released_delta"] for r in ranks),
            "released_vs_shard": max(r["released_delta"] / r["shard_bytes"] for r in ranks),
            "views_of_mapping": max(r["views_of_mapping"] for r in ranks),
            "views_of_mapping_bytes": max(r["views_of_mapping_bytes"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks),
        })
    return {
        "device": platform.processor() or platform.machine(),
        "device_type": "cpu",
        "cpu_cores": os.cpu_count(),
        "mem_total_bytes": mem_total,
        "commit": git_commit(),
        # Work in progress: the source that ran is HEAD plus these (see tree_state).
        "uncommitted_source": uncommitted_source(),
        "date": utc_now(),
        "checkpoint": {"arch": "LlamaForCausalLM (random weights)", "hidden": args.hidden,
                       "intermediate": args.intermediate, "layers": args.layers,
                       "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
                       "tied": False, "file_dtype": args.checkpoint_dtype,
                       "tensor_bytes": tensor_bytes, "file_bytes": file_bytes},
        "load_dtype": args.dtype,
        "whole_model_bytes": whole,
        "sample_ms": args.sample_ms,
        "summary": summary,
        "per_rank": runs,
    }


def write_results(result: dict, name: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    c = result["checkpoint"]

    def mib(x: int) -> str:
        return f"{x / MiB:.0f}"

    lines = [
        f"# Peak host memory per TP rank while loading ({result['device']}, "
        f"{result['cpu_cores']} cores, {result['mem_total_bytes'] / (1 << 30):.0f} GiB)", "",
        f"commit {commit_label(result['commit'], result.get('uncommitted_source', []))}, "
        f"{result['date']}; random Llama checkpoint (hidden "
        f"{c['hidden']}, intermediate {c['intermediate']}, {c['layers']} layers, "
        f"{c['heads']} heads / {c['kv_heads']} KV heads, vocab {c['vocab']}, untied), one "
        f"safetensors file of {mib(c['file_bytes'])} MiB ({c['file_dtype']}), loaded as "
        f"{result['load_dtype']}: the whole model is "
        f"{mib(result['whole_model_bytes'] or c['tensor_bytes'])} MiB of parameters. "
        "Each rank is a spawned process running `load_model(path, dtype, 'cpu', "
        "tp=TPGroup(rank, size, None))`; the ranks of one size load at the same time. "
        "Each rank first loads and drops a tiny checkpoint of the same architecture (one "
        "layer), so that what the loader imports or allocates on first use is not counted.",
        "", "## During the load", "",
        "| tp | shard MiB | shard / whole | peak RSS delta MiB | **peak / shard** "
        "| peak anon MiB | anon / shard | peak file-backed MiB | load s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["summary"]:
        ratio = f"{s['shard_vs_whole']:.3f}" if s["shard_vs_whole"] else "?"
        lines.append(
            f"| {s['tp']} | {mib(s['shard_bytes'])} | {ratio} | {mib(s['max_peak_delta'])} "
            f"| **{s['peak_delta_vs_shard']:.2f}** | {mib(s['max_peak_anon'])} | "
            f"{s['peak_anon_vs_shard']:.2f} | {mib(s['max_peak_file'])} | "
            f"{s['seconds']:.1f} |")
    lines += [
        "", "Worst rank of each size (a ratio is the worst rank's own).", "",
        "## After the load", "",
        "| tp | parameters that are views of the file mapping | RSS delta after a read of "
        "every weight MiB | / shard | RSS delta once those views are copied out and the "
        "mapping is gone MiB | / shard |", "|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(
            f"| {s['tp']} | {s['views_of_mapping']} ({mib(s['views_of_mapping_bytes'])} "
            f"MiB) | {mib(s['max_touched_delta'])} | {s['touched_vs_shard']:.2f} | "
            f"{mib(s['max_released_delta'])} | {s['released_vs_shard']:.2f} |")
    lines += ["", "## Per rank", "",
              "| tp | rank | shard MiB | load: peak RSS delta MiB | peak anon MiB | peak "
              "file MiB | after load: anon / file MiB | after a read of every weight: "
              "anon / file MiB | mapping released: anon / file MiB |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n, ranks in result["per_rank"].items():
        for r in ranks:
            lines.append(f"| {n} | {r['rank']} | {mib(r['shard_bytes'])} | "
                         f"{mib(r['peak_delta'])} | {mib(r['peak_anon'])} | "
                         f"{mib(r['peak_file'])} | {mib(r['after_anon'])} / "
                         f"{mib(r['after_file'])} | {mib(r['touched_anon'])} / "
                         f"{mib(r['touched_file'])} | {mib(r['released_anon'])} / "
                         f"{mib(r['released_file'])} |")
    lines += [
        "", "## What is measured", "",
        "*Peak RSS delta* is the kernel's high-water mark of resident memory during "
        "`load_model` (`VmHWM`, reset to the current RSS by writing 5 to "
        "`/proc/self/clear_refs` just before the call, so the import peak drops out) minus "
        "the resident memory just before it, after the imports. `ru_maxrss` minus the same "
        "gives the same figure here (`peak_delta_ru_maxrss` in the JSON; it cannot be "
        "reset, so it would also show an import peak, or the parent's RSS at exec: the "
        "parent process imports no torch). *Peak anon* and *peak file-backed* are the "
        "largest `RssAnon` / `RssFile` of `/proc/self/status` (minus their values before) "
        f"seen by a thread sampling every {result['sample_ms']} ms during the load.", "",
        "The safetensors file is memory-mapped (private, copy-on-write) and every page of "
        "the mapping a rank reads counts in its RSS as a file-backed page: page-cache "
        "pages, shared between the ranks and with the OS cache, clean, which the kernel can "
        "drop under memory pressure (and re-read if they are used again); not private "
        "memory. A column cut (o_proj, down_proj: row-parallel) reads every row of the "
        "whole tensor, so a rank reads more of the file than its shard. *Anon / shard* is "
        "the private memory: 1.0 means the rank never held more than its own parameters "
        "(plus one slice in flight).", "",
        "The loader copies every safetensors tensor into its parameter (only dequantized "
        "GGUF weights, which own their memory, are adopted as they are) and keeps no "
        "reference to the file, so the mapping is gone when `load_model` returns: the "
        "file-backed part of *peak* is the page cache of the slices being read, and what "
        "a rank keeps is *anon*: its shard. *Parameters that are views of the file "
        "mapping* counts what would keep the file mapped (0 is the expected figure); the "
        "last column is the footprint once any such view is copied out and the mapping "
        "unmapped.",
    ]
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", default="1,2,4", help="TP sizes, comma-separated")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--checkpoint-dtype", default="float32",
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--dtype", default="float32", help="load dtype")
    p.add_argument("--checkpoint", default=None,
                   help="folder to write the checkpoint to (or reuse, if it has one)")
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--name", default="tp-load-memory-cpu", help="results file stem")
    args = p.parse_args(argv)
    result = run(args)
    write_results(result, args.name)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
