"""nano-vllm's host loop for ``bench_host.py``: its real scheduler and the three
ModelRunner methods of a decode step, loaded from its source (``$NANOVLLM_SRC``) with
their tensors kept on the CPU, and the time per step of that loop (no model)."""

from __future__ import annotations

import ast
import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from host_fixtures import PROMPT_LEN, random_prompts


@dataclass
class NanoLoop:
    """nano-vllm's classes, loaded from its source, and what was changed to load them."""

    Scheduler: type
    Sequence: type
    SamplingParams: type
    Config: type
    runner_cls: type
    notes: list[str]


class _CpuTensors(ast.NodeTransformer):
    """``x.cuda(...)`` -> ``x``; ``pin_memory=True`` dropped (no CUDA here)."""

    def __init__(self) -> None:
        self.cuda_calls = 0
        self.pin_memory = 0

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
            self.cuda_calls += 1
            return node.func.value
        kept = [k for k in node.keywords if k.arg != "pin_memory"]
        self.pin_memory += len(node.keywords) - len(kept)
        node.keywords = kept
        return node


_RUNNER_METHODS = ("prepare_block_tables", "prepare_decode", "prepare_sample")


def load_nanovllm(src: str) -> NanoLoop:
    """Import nano-vllm's scheduler side from ``src`` and rebuild the three ModelRunner
    methods of its decode host loop as CPU-only functions on a stand-in runner."""
    import importlib

    pkg_dir = Path(src) / "nanovllm"
    if not (pkg_dir / "engine" / "scheduler.py").is_file():
        raise FileNotFoundError(f"NANOVLLM_SRC={src!r}: no nanovllm/engine/scheduler.py")
    notes = []
    # nanovllm/__init__ imports LLM -> ModelRunner -> the Qwen3 model -> flash_attn and
    # triton kernels: skip it with an empty package shell over the same folder.
    if "nanovllm" not in sys.modules:
        shell = types.ModuleType("nanovllm")
        shell.__path__ = [str(pkg_dir)]
        sys.modules["nanovllm"] = shell
        notes.append("nanovllm/__init__.py not run (it imports the CUDA model); its "
                     "submodules imported directly")
    try:
        import xxhash  # noqa: F401
    except ImportError:
        import hashlib

        class _Xxh64:  # same interface; only hashes full 256-token blocks
            def __init__(self) -> None:
                self._h = hashlib.blake2b(digest_size=8)

            def update(self, b: bytes) -> None:
                self._h.update(b)

            def intdigest(self) -> int:
                return int.from_bytes(self._h.digest(), "little")

        sys.modules["xxhash"] = types.SimpleNamespace(xxh64=_Xxh64)
        notes.append("xxhash missing: stubbed with hashlib.blake2b (used only when a "
                     "256-token block fills; never within the timed window here)")
    seq_mod = importlib.import_module("nanovllm.engine.sequence")
    sched_mod = importlib.import_module("nanovllm.engine.scheduler")
    cfg_mod = importlib.import_module("nanovllm.config")
    sp_mod = importlib.import_module("nanovllm.sampling_params")
    ctx_mod = importlib.import_module("nanovllm.utils.context")

    # ModelRunner.__init__ needs NCCL + CUDA: take the methods' source instead.
    tree = ast.parse((pkg_dir / "engine" / "model_runner.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    defs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in _RUNNER_METHODS]
    if {d.name for d in defs} != set(_RUNNER_METHODS):
        raise RuntimeError(f"nano-vllm ModelRunner lacks one of {_RUNNER_METHODS}")
    fix = _CpuTensors()
    module = ast.fix_missing_locations(fix.visit(ast.Module(body=defs, type_ignores=[])))
    ns = {"torch": torch, "Sequence": seq_mod.Sequence, "set_context": ctx_mod.set_context,
          "get_context": ctx_mod.get_context, "reset_context": ctx_mod.reset_context}
    exec(compile(module, str(pkg_dir / "engine" / "model_runner.py"), "exec"), ns)
    runner_cls = type("NanoCpuRunner", (), {n: ns[n] for n in _RUNNER_METHODS})
    notes.append(f"ModelRunner.{{{', '.join(_RUNNER_METHODS)}}} exec'd from its source with "
                 f"{fix.cuda_calls} `.cuda(non_blocking=True)` calls removed and "
                 f"{fix.pin_memory} `pin_memory=True` arguments dropped (tensors stay on the "
                 "CPU), bound to a stand-in runner with block_size (ModelRunner() needs "
                 "NCCL + CUDA)")
    return NanoLoop(sched_mod.Scheduler, seq_mod.Sequence, sp_mod.SamplingParams,
                    cfg_mod.Config, runner_cls, notes)


def nano_running(nano: NanoLoop, model_dir: str, prompts: list[list[int]], max_len: int,
                 block: int = 256):
    """nano-vllm's scheduler with ``prompts`` admitted and prefilled (untimed), all of
    them decoding. ``block``: its KV block size (a multiple of 256 there; 256 is its
    default)."""
    # Config.__post_init__ reads config.json (AutoConfig): the tiny model's folder works.
    cfg = nano.Config(model=model_dir, max_num_seqs=len(prompts), max_model_len=max_len,
                      kvcache_block_size=block,
                      num_kvcache_blocks=len(prompts) * -(-max_len // block) + 1)
    sched = nano.Scheduler(cfg)
    sp = nano.SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True)
    for p in prompts:
        sched.add(nano.Sequence(p, sp))
    toks = [5] * len(prompts)
    while sched.waiting:
        seqs, is_prefill = sched.schedule()
        sched.postprocess(seqs, toks[:len(seqs)], is_prefill)
    assert len(sched.running) == len(prompts)
    return sched


def time_nano_scheduler(nano: NanoLoop, model_dir: str, prompts: list[list[int]],
                        steps: int, warmup: int = 5) -> float:
    """Seconds per decode step of nano-vllm's ``schedule()`` + ``postprocess()`` alone (its
    scheduler side, what ``bench_scheduler.py`` times of ours), all ``prompts`` decoding."""
    sched = nano_running(nano, model_dir, prompts, max(map(len, prompts)) + steps + 64)
    toks = [5] * len(prompts)

    def step() -> None:
        seqs, is_prefill = sched.schedule()
        sched.postprocess(seqs, toks, is_prefill)

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def time_nano(nano: NanoLoop, model_dir: str, num_seqs: int, steps: int, vocab: int,
              seed: int, between: Callable[[], None] | None = None) -> float:
    """Seconds per decode step of nano-vllm's host loop with ``num_seqs`` sequences.
    ``between``: run (untimed) before each timed step, e.g. a forward, so that the loop
    meets caches in the state a real run leaves them."""
    block = 256
    sched = nano_running(nano, model_dir, random_prompts(num_seqs, vocab, seed),
                         PROMPT_LEN + steps + 16, block)
    runner = nano.runner_cls()
    runner.block_size = block
    toks = [5] * num_seqs

    def step() -> None:
        seqs, is_prefill = sched.schedule()
        runner.prepare_decode(seqs)
        runner.prepare_sample(seqs)
        sched.postprocess(seqs, toks, is_prefill)

    for _ in range(3):
        step()
    assert len(sched.running) == num_seqs
    if between is None:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    total = 0.0
    for _ in range(steps):
        between()
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
    return total / steps


def nano_from_env(log: Callable[[str], None] = print) -> tuple[NanoLoop | None, str]:
    """nano-vllm's loop from ``$NANOVLLM_SRC`` and the note on how it was loaded;
    ``(None, why)`` when the variable is unset."""
    src = os.environ.get("NANOVLLM_SRC")
    if not src:
        return None, "skipped: NANOVLLM_SRC is not set (path to a nano-vllm checkout)"
    nano = load_nanovllm(src)
    note = f"from {src}; " + "; ".join(nano.notes)
    log(f"nano-vllm: loaded from {src}")
    return nano, note
