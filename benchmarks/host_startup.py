"""Start-up for ``bench_host.py``: ``LLM()`` with the default GGUF vs transformers'
``from_pretrained`` of the same file, each in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

_OURS_STARTUP = textwrap.dedent("""
    import json, time
    t0 = time.perf_counter()
    from deepinfer import LLM
    t1 = time.perf_counter()
    llm = LLM(device="cpu")
    t2 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
""")

_HF_STARTUP = textwrap.dedent("""
    import json, os, sys, time
    path = sys.argv[1]
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t1 = time.perf_counter()
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    t2 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
""")


def _subprocess_json(code: str, *argv: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       timeout=600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def run_startup() -> dict:
    """Default model ready: ``LLM()`` vs transformers, each in a fresh process."""
    from deepinfer.loading.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        return {"skipped": str(e)}
    return {"model": os.path.basename(path), "ours": _subprocess_json(_OURS_STARTUP),
            "transformers": _subprocess_json(_HF_STARTUP, path)}


def startup_line(s: dict) -> str:
    """The start-up result (``run_startup``'s dict) as one line of the report."""
    if "skipped" in s:
        return f"startup: skipped: {s['skipped']}"

    def fmt(d: dict) -> str:
        if "error" in d:
            return f"failed ({d['error']})"
        return (f"{d['load_s']:.2f} s (+ {d['import_s']:.2f} s import; "
                f"{d['process_s']:.2f} s whole process)")

    return (f"startup ({s['model']}, CPU, fresh process): LLM() {fmt(s['ours'])}; "
            f"transformers from_pretrained model + tokenizer {fmt(s['transformers'])}. "
            "Target: LLM() <= 3 s.")
