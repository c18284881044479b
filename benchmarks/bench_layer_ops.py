"""Decoder-layer elementwise ops: the fused Triton kernels (``add_rms_norm``, ``rotary_qk``
with the q/k norm, ``silu_and_mul``) against the torch ops they replace
(``deepinfer_kernels.reference``, op for op what the model ran before), same data, same run.

Per op and for a layer's whole chain (input norm with the residual add, q/k norm + RoPE,
post-attention norm with the residual add, SiLU-and-mul: what one decoder layer runs
besides its GEMMs and attention), at Qwen3-0.6B's shapes (hidden 1024, 16 q / 8 kv heads
of 128, intermediate 3072) for a decode batch (256 tokens) and a prefill chunk (8192).
Reported: ms, the fused kernel's bytes moved (each input read once, each output written
once) as GB/s and as a fraction of the measured copy bandwidth, and torch ms / fused ms.
A 28-layer model runs the chain 28 times a step, so at decode the chain's ms x 28 is what
the fusion saves or costs per step (CUDA graphs remove launch overhead, not kernel time).

CUDA: ``triton.testing.do_bench`` (bf16). CPU: the interpreter is far too slow to time,
so the torch ops are timed at tiny shapes and the Triton chain runs once, untimed, as a
correctness smoke check against them.

    python benchmarks/bench_layer_ops.py [--save] [--out DIR]
    python -m pytest benchmarks/bench_layer_ops.py -q -s

Results: ``layer-ops-<device>.{json,md}`` in ``--out`` / ``$DEEPINFER_BENCH_OUT``, or
benchmarks/results with ``--save`` / ``DEEPINFER_BENCH_SAVE=1``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from bench_moe import IS_CUDA, cli, copy_bandwidth, out_dir, time_ms, write  # noqa: E402
from results_meta import git_commit, header_lines, table_lines, utc_now  # noqa: E402

import deepinfer_kernels  # noqa: E402
from deepinfer_kernels import reference  # noqa: E402

DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
DTYPE = torch.bfloat16 if IS_CUDA else torch.float32
# (hidden, q heads, kv heads, head_dim, intermediate): Qwen3-0.6B; scaled down on CPU.
SHAPE = (1024, 16, 8, 128, 3072) if IS_CUDA else (64, 4, 2, 16, 96)
TOKENS = (256, 8192) if IS_CUDA else (4, 32)
EPS = 1e-6
PREFIX = "layer-ops"


def layer_tensors(tokens: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random inputs of one layer's elementwise ops at ``tokens`` tokens (norm weights
    near 1, as trained ones are)."""
    hidden, hq, hkv, d, inter = SHAPE

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        t = torch.randn(shape, generator=g, device="cpu") * scale + shift
        return t.to(device=DEVICE, dtype=DTYPE)

    return {
        "x": rnd(tokens, hidden), "residual": rnd(tokens, hidden),
        "w": rnd(hidden, scale=0.1, shift=1.0),
        "qkv": rnd(tokens, (hq + 2 * hkv) * d),
        "qw": rnd(d, scale=0.1, shift=1.0), "kw": rnd(d, scale=0.1, shift=1.0),
        "cache": rnd(40960, d), "positions": torch.randint(
            0, 40960, (tokens,), generator=g, device="cpu").to(DEVICE),
        "gate_up": rnd(tokens, 2 * inter),
    }


def op_calls(ops, t: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The ops of ``ops`` (``deepinfer_kernels`` or its ``reference``) on ``t``, and the
    chain."""
    _, hq, hkv, d, _ = SHAPE
    tokens = t["x"].shape[0]
    q = t["qkv"][:, :hq * d].view(tokens, hq, d)
    k = t["qkv"][:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    calls = {
        "add_rms_norm": lambda: ops.add_rms_norm(t["x"], t["residual"], t["w"], EPS),
        "rotary_qk+norm": lambda: ops.rotary_qk(q, k, t["cache"], t["positions"], t["qw"],
                                                 t["kw"], EPS),
        "silu_and_mul": lambda: ops.silu_and_mul(t["gate_up"]),
    }

    def chain() -> object:
        calls["add_rms_norm"]()
        calls["rotary_qk+norm"]()
        calls["add_rms_norm"]()
        return calls["silu_and_mul"]()

    calls["layer chain"] = chain
    return calls


def moved_bytes(tokens: int) -> dict[str, int]:
    """Bytes each fused op must move at least: inputs read once, outputs written once."""
    hidden, hq, hkv, d, inter = SHAPE
    e = torch.finfo(DTYPE).bits // 8
    per = {"add_rms_norm": 4 * tokens * hidden * e,
           "rotary_qk+norm": 2 * tokens * (hq + hkv) * d * e + tokens * d * e,
           "silu_and_mul": 3 * tokens * inter * e}
    per["layer chain"] = 2 * per["add_rms_norm"] + per["rotary_qk+norm"] + per["silu_and_mul"]
    return per


def run(tokens: tuple[int, ...] = TOKENS) -> tuple[dict, list[dict]]:
    import triton

    copy_gbs = copy_bandwidth()
    rows = []
    for m in tokens:
        t = layer_tensors(m, torch.Generator().manual_seed(m))
        fused, torch_ops = op_calls(deepinfer_kernels, t), op_calls(reference, t)
        if not IS_CUDA:  # the interpreted chain once, as a smoke check
            got, want = fused["layer chain"](), torch_ops["layer chain"]()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        nbytes = moved_bytes(m)
        for op in fused:
            ref_ms = time_ms(torch_ops[op])
            row = {"op": op, "tokens": m, "torch_ms": round(ref_ms, 4)}
            if IS_CUDA:
                ms = time_ms(fused[op])
                gbs = nbytes[op] / 1e9 / (ms * 1e-3)
                row.update(fused_ms=round(ms, 4), fused_GBps=round(gbs, 1),
                           bw_frac=round(gbs / copy_gbs, 3), speedup=round(ref_ms / ms, 2))
            rows.append(row)
    name = torch.cuda.get_device_name() if IS_CUDA else "cpu"
    meta = {"device": name, "commit": git_commit(), "date": utc_now(),
            "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE).replace("torch.", ""), "copy_GB/s": round(copy_gbs, 1),
            "shape": dict(zip(("hidden", "q_heads", "kv_heads", "head_dim", "inter"), SHAPE)),
            "timed_fused": IS_CUDA}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["op", "tokens", "torch_ms", "fused_ms", "speedup", "fused_GBps", "bw_frac"]
    lines = header_lines("Decoder-layer elementwise ops", meta,
                         f"dtype {meta['dtype']}, shape {meta['shape']}")
    lines += ["torch = the unfused torch ops (deepinfer_kernels.reference); "
              "fused = the Triton kernels; "
             "speedup = torch ms / fused ms; bw_frac = the fused op's minimum bytes / time / "
             f"copy bandwidth ({meta['copy_GB/s']} GB/s)."
             + ("" if meta["timed_fused"] else " CPU: fused not timed (interpreter)."), ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


def test_bench_layer_ops(tmp_path):
    """Smoke test (no timing assertions): every op runs at every size, the interpreted
    chain equals the torch one on CPU, and the results files are written."""
    meta, rows = run()
    assert len(rows) == 4 * len(TOKENS) and all(r["torch_ms"] > 0 for r in rows)
    path = write(meta, rows, out_dir(False, None) or tmp_path, PREFIX, markdown)
    print("\n" + path.read_text())


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, run, markdown, PREFIX)


if __name__ == "__main__":
    sys.exit(main())
