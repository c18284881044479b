"""Host cost per decode step (issue 10): deepinfer's loop vs nano-vllm's, a near-free model.

Per size (64 / 256 / 1024 sequences, all past their ~100-token prompt, decoding), through
the public ``LLM`` API with a 1-layer, 64-wide random Llama and a ~300-token BPE
tokenizer, in microseconds per sequence per decode step:

- ours: the whole ``engine.step()`` of a decode step, split into the forward (the model's
  ``forward`` + ``compute_logits``, timed inside the engine by wrapping them on the model
  instance) and the rest, the host work (scheduling, launch buffers, sampling, update,
  detokenization). Of the host part, the sampler's share is shown too.
- nano-vllm's host loop for the same step, same run: its real ``Scheduler.schedule()`` +
  ``ModelRunner.prepare_decode()`` + ``prepare_sample()`` + ``Scheduler.postprocess()``
  with its tensors kept on the CPU and the sampled ids given (no model). Its source comes
  from ``$NANOVLLM_SRC`` (a copy of GeeeekExplorer/nano-vllm); unset, the column is skipped.
- dense: the same model's decode step as plain torch over a dense ``[B, ctx]`` KV cache
  (embed, RMSNorm, qkv, RoPE, SDPA, o_proj, MLP, norm, lm head, argmax), with the loaded
  model's own weights: the least any CPU forward can cost.

Also, same run: start-up (``LLM()`` with the default GGUF vs transformers'
``from_pretrained`` of the same file, each in a fresh process) and, when ``EngineArgs``
has ``async_scheduling``, decode steps/s with it on and off over a simulated device whose
forward takes a fixed D ms.

    NANOVLLM_SRC=/path/to/nano-vllm python benchmarks/bench_host.py
    python benchmarks/bench_host.py --sizes 64,256 --steps 32 --no-startup
    python benchmarks/bench_host.py --save       # benchmarks/results/host-cpu.{json,md}

Sizes are interleaved and repeated (``--reps``, default 3); medians are reported. The
``test_`` function at the bottom runs one tiny configuration so the suite exercises this
file (sanity only, never timing).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_meta import git_commit, utc_now  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 100
# The near-free model of the issue: 1 layer, 64 wide, ~300-token tokenizer.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.1)


def make_tiny_checkpoint(out_dir: str, seed: int = 0) -> str:
    """config.json + model.safetensors + the BPE tokenizer of random_model, for the tiny
    Llama. The tensors are written directly under their HF names (building the HF model
    first only costs start-up)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from deepinfer.random_model import build_bpe_tokenizer

    tok = build_bpe_tokenizer(290)
    spec = dict(TINY_LLAMA)
    std = spec.pop("initializer_range")
    cfg = LlamaConfig(**spec, vocab_size=len(tok), architectures=["LlamaForCausalLM"],
                      dtype="float32")
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    weights = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h),
               "model.norm.weight": torch.ones(h)}
    for n in range(cfg.num_hidden_layers):
        pre = f"model.layers.{n}."
        weights.update({
            pre + "self_attn.q_proj.weight": rnd(q, h),
            pre + "self_attn.k_proj.weight": rnd(kv, h),
            pre + "self_attn.v_proj.weight": rnd(kv, h),
            pre + "self_attn.o_proj.weight": rnd(h, q),
            pre + "mlp.gate_proj.weight": rnd(i, h),
            pre + "mlp.up_proj.weight": rnd(i, h),
            pre + "mlp.down_proj.weight": rnd(h, i),
            pre + "input_layernorm.weight": torch.ones(h),
            pre + "post_attention_layernorm.weight": torch.ones(h),
        })
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out_dir)
    return out_dir


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------- ours
def _engine_arg_names() -> set[str]:
    from deepinfer.engine_args import EngineArgs

    return {f.name for f in fields(EngineArgs)}


def make_llm(path: str, num_seqs: int, steps: int, **extra):
    """An ``LLM`` on the CPU sized for ``num_seqs`` prompts of PROMPT_LEN + ``steps``
    tokens. The host table runs without async scheduling, when the engine has it, so
    that host + forward is the whole step."""
    from deepinfer import LLM

    if "async_scheduling" in _engine_arg_names():
        extra.setdefault("async_scheduling", False)
    max_len = -(-(PROMPT_LEN + steps + 8) // 64) * 64
    return LLM(path, device="cpu", max_num_seqs=num_seqs, max_model_len=max_len,
               max_num_batched_tokens=max(2048, 16 * PROMPT_LEN),
               kv_cache_memory=1 << 30, **extra)


def _prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    """Fresh random prompts per run: no prefix-cache hits between repetitions."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(num)]


class _Clock:
    """Accumulates the time spent inside wrapped callables (instance attributes)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._undo: list[tuple[object, str]] = []

    def wrap(self, obj: object, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)
        self._undo.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in reversed(self._undo):
            if name in vars(obj):
                delattr(obj, name)  # back to the class attribute
        self._undo.clear()


@dataclass
class OursRun:
    total: float = 0.0      # seconds in decode steps
    forward: float = 0.0    # of which model forward + logits
    sample: float = 0.0     # of which the sampler
    tokens: int = 0         # sequences x decode steps counted
    steps: int = 0
    stats_decode_time: float = float("nan")  # engine.stats' own decode_time, same steps
    driven: str = "LLM.generate"
    per_step: list[float] = field(default_factory=list)


def _model_of(engine):
    model = getattr(getattr(engine, "runner", None), "model", None)
    return engine.model if model is None else model


def time_ours(llm, num_seqs: int, steps: int, seed: int) -> OursRun:
    """One ``generate`` of ``num_seqs`` prompts, ``steps`` decode steps each; times every
    ``engine.step()`` and keeps the decode steps of the full batch in which no request
    finished (the finishing step builds the outputs: a per-request cost)."""
    from deepinfer import SamplingParams

    engine = llm.engine
    stats = engine.stats
    model = _model_of(engine)
    fwd, smp = _Clock(), _Clock()
    fwd.wrap(model, "forward")
    fwd.wrap(model, "compute_logits")
    sampler = getattr(getattr(engine, "runner", None), "sampler", None)
    if sampler is not None and hasattr(sampler, "sample"):
        smp.wrap(sampler, "sample")
    run = OursRun()
    steady = OursRun()
    has_pt = hasattr(stats, "prompt_time")
    has_dt = hasattr(stats, "decode_time")
    step = engine.step

    def timed_step():
        p0 = stats.prompt_time if has_pt else 0.0
        g0 = getattr(stats, "generated_tokens", 0)
        d0 = stats.decode_time if has_dt else float("nan")
        f0, s0 = fwd.seconds, smp.seconds
        t0 = time.perf_counter()
        done = step()
        dt = time.perf_counter() - t0
        # Without a token counter, a step without prompt time is taken as a full batch.
        ntok = (stats.generated_tokens - g0 if hasattr(stats, "generated_tokens")
                else num_seqs * (fwd.seconds > f0))
        is_decode = ntok > 0 and (stats.prompt_time == p0 if has_pt else ntok == num_seqs)
        if is_decode:
            # Steady: full-batch steps where no request finished. The finishing step also
            # builds every finished request's output (its text decoded once): a cost per
            # request, not per step, which nano-vllm's timed loop does not hold either.
            for r in ((run, steady) if ntok == num_seqs and not done else (run,)):
                r.total += dt
                r.forward += fwd.seconds - f0
                r.sample += smp.seconds - s0
                r.tokens += ntok
                r.steps += 1
                r.per_step.append(dt)
                if has_dt:
                    r.stats_decode_time = ((0.0 if math.isnan(r.stats_decode_time)
                                            else r.stats_decode_time)
                                           + stats.decode_time - d0)
        return done

    prompts = _prompts(num_seqs, engine.model_config.vocab_size, seed)
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine.step = timed_step  # drain() calls self.step(): the instance attribute wins
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if run.steps == 0:
            # generate() no longer goes through engine.step(): drive the engine ourselves.
            run.driven = "engine.add_request + step()"
            for i, p in enumerate(prompts):
                engine.add_request(f"hostbench-{seed}-{i}", None, p, sp)
            while engine.has_unfinished():
                timed_step()
        else:
            assert all(len(o.outputs[0].token_ids) == steps + 1 for o in outs)
    finally:
        del engine.step
        fwd.unwrap()
        smp.unwrap()
    best = steady if steady.steps else run
    best.driven = run.driven
    return best


# ---------------------------------------------------------------------------- nano-vllm
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


def time_nano(nano: NanoLoop, model_dir: str, num_seqs: int, steps: int, vocab: int,
              seed: int, between: Callable[[], None] | None = None) -> float:
    """Seconds per decode step of nano-vllm's host loop with ``num_seqs`` sequences.
    ``between``: run (untimed) before each timed step, e.g. a forward, so that the loop
    meets caches in the state a real run leaves them."""
    block = 256  # nano-vllm's default kvcache_block_size (must be a multiple of 256)
    max_len = PROMPT_LEN + steps + 16
    # Config.__post_init__ reads config.json (AutoConfig): the tiny model's folder works.
    cfg = nano.Config(model=model_dir, max_num_seqs=num_seqs, max_model_len=max_len,
                      kvcache_block_size=block,
                      num_kvcache_blocks=num_seqs * -(-max_len // block) + 1)
    sched = nano.Scheduler(cfg)
    runner = nano.runner_cls()
    runner.block_size = block
    sp = nano.SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True)
    for p in _prompts(num_seqs, vocab, seed):
        sched.add(nano.Sequence(p, sp))
    toks = [5] * num_seqs
    while sched.waiting:  # prefill (untimed)
        seqs, is_prefill = sched.schedule()
        sched.postprocess(seqs, toks[:len(seqs)], is_prefill)

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


# ---------------------------------------------------------------------------- dense floor
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_step(model, kc: list[torch.Tensor], vc: list[torch.Tensor], pos: int,
               tok: torch.Tensor) -> torch.Tensor:
    """One decode step of ``model`` as plain torch: tokens ``[B]`` at position ``pos``,
    dense caches ``[B, Hkv, ctx, D]`` per layer (this step's K/V written at ``pos``) ->
    greedy next tokens ``[B]``. Uses the model's own weights."""
    cfg = model.config
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = F.embedding(tok, model.model.embed_tokens.weight)
    cos, sin = model.rotary.cos_sin_cache[pos].chunk(2, dim=-1)
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        y = _rms(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = F.linear(y, a.qkv_proj.weight, a.qkv_proj.bias).split(
            [h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(-1, h, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if a.q_norm is not None:
            q = _rms(q, a.q_norm.weight, a.q_norm.eps)
            k = _rms(k, a.k_norm.weight, a.k_norm.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        kc[i][:, :, pos] = k
        vc[i][:, :, pos] = v
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc[i][:, :, :pos + 1], vc[i][:, :, :pos + 1],
            scale=a.attn.scale, enable_gqa=h != hkv)
        x = x + F.linear(o.reshape(-1, h * d), a.o_proj.weight)
        y = _rms(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        gate, up = F.linear(y, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    x = _rms(x, model.model.norm.weight, model.model.norm.eps)
    return F.linear(x, model.lm_head_weight).float().argmax(-1)


def dense_runner(model, num_seqs: int, steps: int, seed: int) -> Callable[[], None]:
    """A callable running one ``dense_step`` of ``num_seqs`` sequences per call, all at the
    same position, from PROMPT_LEN on (the cache before it holds random K/V); the position
    wraps back after ``steps + 2`` calls."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    ctx = PROMPT_LEN + steps + 4
    g = torch.Generator().manual_seed(seed)
    shape = (num_seqs, cfg.num_kv_heads, ctx, cfg.head_dim)
    kc = [torch.randn(shape, generator=g, dtype=dtype) for _ in model.model.layers]
    vc = [torch.randn(shape, generator=g, dtype=dtype) for _ in model.model.layers]
    state = {"tok": torch.randint(3, cfg.vocab_size, (num_seqs,), generator=g), "s": 0}

    @torch.inference_mode()
    def run() -> None:
        state["tok"] = dense_step(model, kc, vc, PROMPT_LEN + state["s"], state["tok"])
        state["s"] = (state["s"] + 1) % (steps + 2)

    return run


def time_dense(model, num_seqs: int, steps: int, seed: int) -> float:
    """Seconds per ``dense_step`` with ``num_seqs`` sequences (see ``dense_runner``)."""
    run = dense_runner(model, num_seqs, steps, seed)
    for _ in range(2):
        run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - t0) / steps


# ---------------------------------------------------------------------------- host table
@dataclass
class SizeResult:
    num_seqs: int
    ours_total: list[float] = field(default_factory=list)    # us / seq / step, per rep
    ours_forward: list[float] = field(default_factory=list)
    ours_sample: list[float] = field(default_factory=list)
    ours_stats_decode: list[float] = field(default_factory=list)
    ours_steps: list[int] = field(default_factory=list)
    ours_host_alone: list[float] = field(default_factory=list)  # forward skipped
    nano: list[float] = field(default_factory=list)
    nano_fwd: list[float] = field(default_factory=list)  # a dense forward between steps
    dense: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        tot, fw = _median(self.ours_total), _median(self.ours_forward)
        nano, dense = _median(self.nano), _median(self.dense)
        out = {"num_seqs": self.num_seqs, "ours_total_us": tot, "ours_forward_us": fw,
               "ours_host_us": tot - fw, "ours_sampler_us": _median(self.ours_sample),
               "ours_stats_decode_time_us": _median(self.ours_stats_decode),
               "ours_decode_steps_timed": self.ours_steps,
               "ours_host_alone_us": _median(self.ours_host_alone),
               "nano_host_us": nano if self.nano else None,
               "nano_host_forward_between_us": _median(self.nano_fwd) if self.nano else None,
               "dense_forward_us": dense,
               "reps_us": {"ours_total": self.ours_total, "ours_forward": self.ours_forward,
                           "nano_host": self.nano, "nano_host_forward_between": self.nano_fwd,
                           "dense_forward": self.dense}}
        if self.nano:
            out["total_vs_nano_plus_dense"] = tot / (nano + dense)
            out["host_vs_nano"] = (tot - fw) / nano
            out["host_vs_nano_forward_between"] = (tot - fw) / _median(self.nano_fwd)
            out["host_alone_vs_nano"] = _median(self.ours_host_alone) / nano
        return out


def run_host_table(model_dir: str, sizes: list[int], steps: int, reps: int,
                   nano: NanoLoop | None, log: Callable[[str], None] = print
                   ) -> list[SizeResult]:
    llms = {n: make_llm(model_dir, n, steps) for n in sizes}
    vocab = llms[sizes[0]].engine.model_config.vocab_size
    # Warm-up: the first generate pays one-off costs (allocator, lazy imports).
    for n, llm in llms.items():
        time_ours(llm, min(n, 16), 4, seed=10_000 + n)
    results = {n: SizeResult(n) for n in sizes}
    for rep in range(reps):
        for n in sizes:
            r = results[n]
            seed = 1000 * rep + n
            o = time_ours(llms[n], n, steps, seed)
            per = 1e6 / o.tokens
            r.ours_total.append(o.total * per)
            r.ours_forward.append(o.forward * per)
            r.ours_sample.append(o.sample * per)
            r.ours_stats_decode.append(o.stats_decode_time * per)
            r.ours_steps.append(o.steps)
            # The host loop as nano-vllm's is timed: no forward between two steps (the
            # forward's memory traffic evicts the host's data from the caches).
            with _zero_forward(_model_of(llms[n].engine)):
                z = time_ours(llms[n], n, steps, seed + 7)
            r.ours_host_alone.append((z.total - z.forward) * 1e6 / z.tokens)
            if nano is not None:
                r.nano.append(time_nano(nano, model_dir, n, steps, vocab, seed) * 1e6 / n)
                # Like for like with 'ours host': the same caches a forward leaves behind.
                fwd = dense_runner(llms[n].engine.model, n, steps, seed)
                r.nano_fwd.append(time_nano(nano, model_dir, n, steps, vocab, seed,
                                            between=fwd) * 1e6 / n)
            r.dense.append(time_dense(llms[n].engine.model, n, steps, seed) * 1e6 / n)
            log(f"  rep {rep + 1}/{reps}, {n} seqs: ours {r.ours_total[-1]:.1f} "
                f"(fwd {r.ours_forward[-1]:.1f}, {o.steps} steps, {o.driven})"
                + (f", nano {r.nano[-1]:.2f}" if r.nano else "")
                + f", dense {r.dense[-1]:.2f} us/seq/step")
    return [results[n] for n in sizes]


class _zero_forward:
    """Within the block the model's forward returns zeros at once (no CPU work)."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self) -> None:
        hidden = self.model.config.hidden_size
        dtype = next(self.model.parameters()).dtype
        self.model.forward = lambda ids, *a, **k: torch.zeros(ids.shape[0], hidden,
                                                              dtype=dtype)

    def __exit__(self, *exc) -> None:
        self.model.__dict__.pop("forward", None)


def host_table_lines(rows: list[dict], nano_note: str) -> list[str]:
    lines = ["| seqs | ours total | ours forward | ours host | (of host: sampler) | "
             "ours host, no forward between steps | nano-vllm host | nano-vllm host, "
             "forward between steps | dense forward | ours total / (nano + dense) | "
             "ours host / nano host, both with a forward between | "
             "ours host / nano host, neither | ours host (forward between) / nano host "
             "(none) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        have = r["nano_host_us"] is not None

        def fmt(key: str, unit: str = "", r: dict = r) -> str:
            # The nano-vllm figures and ratios exist only when it was measured.
            return f"{r[key]:.2f}{unit}" if r["nano_host_us"] is not None else "-"

        lines.append(f"| {r['num_seqs']} | {r['ours_total_us']:.2f} | "
                     f"{r['ours_forward_us']:.2f} | {r['ours_host_us']:.2f} | "
                     f"{r['ours_sampler_us']:.2f} | {r['ours_host_alone_us']:.2f} | "
                     f"{fmt('nano_host_us') if have else 'skipped'} | "
                     f"{fmt('nano_host_forward_between_us')} | "
                     f"{r['dense_forward_us']:.2f} | {fmt('total_vs_nano_plus_dense', 'x')} | "
                     f"{fmt('host_vs_nano_forward_between', 'x')} | "
                     f"{fmt('host_alone_vs_nano', 'x')} | {fmt('host_vs_nano', 'x')} |")
    lines.append("")
    lines.append("us per sequence per decode step (median of the repetitions). Targets: "
                 "ours total <= nano host + dense (ratio <= 1), ours host <= nano host. "
                 "'ours host' is a real run's step minus its forward (the forward's memory "
                 "traffic has evicted the host's data from the caches); 'no forward "
                 "between steps' times our host loop the way nano-vllm's is timed (the "
                 "model's forward returns zeros at once; logits and sampling stay real); "
                 "'nano-vllm host, forward between steps' runs the dense forward (untimed) "
                 "before each of nano-vllm's timed steps, the like-for-like peer of 'ours "
                 "host'. "
                 "Steps where requests finish (their outputs are built then, texts decoded "
                 "once) are left out of both, as nano-vllm's timed loop leaves out its "
                 "detokenization.")
    lines.append(f"nano-vllm: {nano_note}")
    return lines


# ---------------------------------------------------------------------------- start-up
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
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       env=env, timeout=600)
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


# ---------------------------------------------------------------------------- overlap
class _SimulatedDevice:
    """A device that takes ``delay`` seconds a step and runs asynchronously, as a GPU
    does: the model's forward returns zeros at once (no CPU work), and each launched
    step's sampled ids become ready ``delay`` after the device is free to start it
    (steps queue behind each other). ``result()`` on the step's handle sleeps until then.
    The host part of a step (scheduling, launch tensors, sampling, update) stays real, so
    with ``async_scheduling`` off a step costs host + D, with it on ideally max(host, D).
    """

    def __init__(self, engine, delay: float) -> None:
        self.runner = engine.runner
        self.delay = delay
        self.seconds, self.calls = 0.0, 0
        self.free_at = 0.0
        self.launches: list[tuple[float, bool, int]] = []  # (time, decode?, samples)
        launch = self.runner.launch

        def delayed_launch(out, *args, **kwargs):
            self.launches.append((time.perf_counter(), not out.is_prompt, out.num_samples))
            handle = launch(out, *args, **kwargs)
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + self.delay
            self.seconds += self.delay
            self.calls += 1
            return _ReadyAt(handle, self.free_at)

        self._zero = _zero_forward(_model_of(engine))
        self._zero.__enter__()
        self.runner.launch = delayed_launch

    def remove(self) -> None:
        self._zero.__exit__(None, None, None)
        del self.runner.launch


class _ReadyAt:
    """A launched step's handle whose ids are ready at ``ready_at`` (perf_counter)."""

    def __init__(self, handle, ready_at: float) -> None:
        self.handle, self.ready_at = handle, ready_at

    def finish_sampling(self) -> None:
        self.handle.finish_sampling()

    def result(self):
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.handle.result()


def run_overlap(model_dir: str, num_seqs: int, delay_ms: float, steps: int,
                reps: int) -> dict:
    """Decode step time with async_scheduling off and on over the simulated device.

    A step's time is the interval between two consecutive launches of full-batch decode
    steps (the loop's period in steady state), median over every such interval of
    ``reps`` runs of ``num_seqs`` prompts x ``steps`` tokens. Off, it is host + D; the
    host part of a step is that minus D. The whole runs' wall times are reported too:
    they also hold the prompt steps and the end of the run (texts decoded once at the
    end), which no device work hides."""
    if "async_scheduling" not in _engine_arg_names():
        return {"skipped": "async_scheduling not implemented"}
    from deepinfer import SamplingParams

    out: dict = {"num_seqs": num_seqs, "device_ms": delay_ms, "steps": steps}
    runs = {}
    for flag in (False, True):
        llm = make_llm(model_dir, num_seqs, steps, async_scheduling=flag)
        vocab = llm.engine.model_config.vocab_size
        dev = _SimulatedDevice(llm.engine, delay_ms / 1e3)
        try:
            llm.generate(_prompts(4, vocab, 7), SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
            intervals, walls = [], []
            for rep in range(reps):
                dev.launches.clear()
                sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate(_prompts(num_seqs, vocab, 100 * rep + 1), sp, use_tqdm=False)
                walls.append(time.perf_counter() - t0)
                full = [t for t, decode, n in dev.launches if decode and n == num_seqs]
                intervals += [b - a for a, b in zip(full, full[1:])]
        finally:
            dev.remove()
        runs[flag] = (_median(intervals), _median(walls))
    (off, wall_off), (on, wall_on) = runs[False], runs[True]
    dev_s = delay_ms / 1e3
    host = off - dev_s
    bound = max(host, dev_s)
    out.update(off_ms=off * 1e3, on_ms=on * 1e3, host_ms=host * 1e3,
               device_measured_ms=delay_ms, off_steps_per_s=1 / off,
               on_steps_per_s=1 / on, on_vs_max_host_device=on / bound,
               target_met=on <= 1.1 * bound, wall_off_s=wall_off, wall_on_s=wall_on)
    return out


def overlap_line(o: dict) -> str:
    if "skipped" in o:
        return f"overlap: skipped: {o['skipped']}"
    return (f"overlap ({o['num_seqs']} seqs, simulated device D = {o['device_ms']:g} ms, "
            "step = interval between full-batch decode launches, median): async off "
            f"{o['off_steps_per_s']:.1f} steps/s ({o['off_ms']:.2f} ms), on "
            f"{o['on_steps_per_s']:.1f} steps/s ({o['on_ms']:.2f} ms); host "
            f"{o['host_ms']:.2f} ms; on / max(host, D) = {o['on_vs_max_host_device']:.2f} "
            f"(target <= 1.10: {'met' if o['target_met'] else 'not met'}); whole runs of "
            f"{o['steps']} tokens: off {o['wall_off_s']:.2f} s, on {o['wall_on_s']:.2f} s")


# ---------------------------------------------------------------------------- main
def _nano_from_env(log: Callable[[str], None] = print) -> tuple[NanoLoop | None, str]:
    src = os.environ.get("NANOVLLM_SRC")
    if not src:
        return None, "skipped: NANOVLLM_SRC is not set (path to a nano-vllm checkout)"
    nano = load_nanovllm(src)
    note = f"from {src}; " + "; ".join(nano.notes)
    log(f"nano-vllm: loaded from {src}")
    return nano, note


def measure(sizes: list[int], steps: int, reps: int, log: Callable[[str], None] = print
            ) -> tuple[list[dict], str]:
    """The host table alone, on a fresh tiny checkpoint: (rows, nano-vllm note)."""
    nano, note = _nano_from_env(log)
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        make_tiny_checkpoint(tmp)
        rows = run_host_table(tmp, sizes, steps, reps, nano, log)
    return [r.summary() for r in rows], note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="sequence counts, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median)")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up comparison")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the tiny model's ops are too "
                    "small to split, and extra threads only add noise)")
    ap.add_argument("--overlap-seqs", type=int, default=256)
    ap.add_argument("--overlap-device-ms", type=float, default=5.0)
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/host-cpu.{json,md}")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    torch.set_num_threads(args.threads)

    nano, nano_note = _nano_from_env()
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        make_tiny_checkpoint(tmp)
        rows = [r.summary() for r in
                run_host_table(tmp, sizes, args.steps, args.reps, nano)]
        print("\n".join(host_table_lines(rows, nano_note)))
        overlap = run_overlap(tmp, args.overlap_seqs, args.overlap_device_ms, args.steps,
                              args.reps)
        print(overlap_line(overlap))
    startup = {"skipped": "--no-startup"} if args.no_startup else run_startup()
    print(startup_line(startup))

    if args.save:
        RESULTS.mkdir(exist_ok=True)
        meta = {"commit": git_commit(), "date": utc_now(), "device": "cpu",
                "machine": platform.machine(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
        data = {**meta, "model": {**TINY_LLAMA, "tokenizer": "BPE ~290 ids"},
                "prompt_len": PROMPT_LEN, "decode_steps": args.steps, "reps": args.reps,
                "nano_vllm": nano_note, "host": rows, "overlap": overlap,
                "startup": startup}
        (RESULTS / "host-cpu.json").write_text(json.dumps(data, indent=2) + "\n")
        head = (f"# Host cost per decode step (CPU, {meta['cpus']} cores)\n\n"
                f"commit {meta['commit']}, {meta['date']}, "
                "`NANOVLLM_SRC=... python benchmarks/bench_host.py --save`\n\n"
                "1-layer 64-wide random Llama, ~290-token BPE tokenizer, "
                f"{PROMPT_LEN}-token prompts, {args.steps} decode steps per run.\n\n")
        body = host_table_lines(rows, nano_note) + ["", overlap_line(overlap), "",
                                                    startup_line(startup)]
        (RESULTS / "host-cpu.md").write_text(head + "\n".join(body) + "\n")
    return 0


def test_host_loop_smoke() -> None:
    """One tiny configuration end to end: every figure positive and finite (no timing
    assertion). nano-vllm only when NANOVLLM_SRC is set; no start-up, no overlap."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, _ = measure([16], steps=4, reps=1, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    (r,) = rows
    keys = ["ours_total_us", "ours_forward_us", "dense_forward_us"]
    keys += (["nano_host_us", "nano_host_forward_between_us"]
             if r["nano_host_us"] is not None else [])
    for k in keys:
        assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])
    assert r["ours_total_us"] > r["ours_forward_us"]


def test_overlap_smoke() -> None:
    """The simulated-device overlap measurement end to end on a tiny batch: both loops
    run, every figure positive and finite (no timing assertion)."""
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        make_tiny_checkpoint(tmp)
        o = run_overlap(tmp, 8, 1.0, 6, 1)
    for k in ("off_ms", "on_ms", "wall_off_s", "wall_on_s"):
        assert math.isfinite(o[k]) and o[k] > 0, (k, o[k])


if __name__ == "__main__":
    sys.exit(main())
