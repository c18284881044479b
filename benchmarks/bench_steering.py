"""Token steering's cost in the sampler: ``Sampler.sample`` over one decode step's logits
with no steering, then with ``logit_bias`` / ``allowed_token_ids`` rows gathered from the
per-slot ``SteeringTable`` (on every row, and on one row of the batch), same logits, same
run. Reported: ms per step and the ratio to the unsteered step (the steered rows' extra
work; an unsteered batch runs nothing of it).

Greedy and temperature rows, fp32 logits of SmolLM2's 49k vocabulary (CPU) or Qwen's 152k
(CUDA, ``triton.testing.do_bench`` through ``bench_moe.time_ms``).

    python benchmarks/bench_steering.py [--save] [--out DIR]
    python -m pytest benchmarks/bench_steering.py -q -s

Results: ``steering-<device>.{json,md}`` in ``--out`` / ``$DEEPINFER_BENCH_OUT``, or
benchmarks/results with ``--save`` / ``DEEPINFER_BENCH_SAVE=1``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from bench_moe import IS_CUDA, cli, out_dir, time_ms, write  # noqa: E402
from results_meta import git_commit, header_lines, table_lines, utc_now  # noqa: E402

from deepinfer.sampling.params import SamplingParams  # noqa: E402
from deepinfer.sampling.sampler import Sampler, SamplingTensors  # noqa: E402
from deepinfer.sampling.steering import SteeringTable, resolve_steering  # noqa: E402

DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
VOCAB = 151936 if IS_CUDA else 49152
ROWS = (64, 256)
PREFIX = "steering"


def _steering(kind: str, g: torch.Generator):
    if kind == "logit_bias x300":
        ids = torch.randperm(VOCAB, generator=g)[:300].tolist()
        params = SamplingParams(logit_bias={t: 5.0 for t in ids})
    else:  # allowed_token_ids x1000
        params = SamplingParams(allowed_token_ids=torch.randperm(VOCAB, generator=g)[:1000]
                                .tolist())
    return resolve_steering("bench", params, None, VOCAB)


def case(rows: int, temperature: float, kind: str, steered_rows: int) -> dict:
    g = torch.Generator().manual_seed(rows + steered_rows)
    logits = (torch.randn(rows, VOCAB, generator=g) * 3).to(DEVICE)
    params = [SamplingParams(temperature=temperature, max_tokens=8)] * rows
    st = SamplingTensors.from_params(params, VOCAB, DEVICE)
    sampler = Sampler(generator=torch.Generator(DEVICE).manual_seed(0))
    # owned=True as the model runner samples (no copy of the logits): the steered runs
    # write into them again each time, which changes values, not the work.
    plain_ms = time_ms(lambda: sampler.sample(logits, st, owned=True))
    table = SteeringTable(rows, DEVICE)
    for slot in range(steered_rows):
        table.write(slot, _steering(kind, g))
    slots = np.arange(rows, dtype=np.int64)
    steered = SamplingTensors.from_params(params, VOCAB, DEVICE)
    steered.steering = table.gather(slots, torch.from_numpy(slots).to(DEVICE))
    ms = time_ms(lambda: sampler.sample(logits, steered, owned=True))
    return {"rows": rows, "vocab": VOCAB, "temperature": temperature, "steering": kind,
            "steered_rows": steered_rows, "plain_ms": round(plain_ms, 3),
            "steered_ms": round(ms, 3), "ratio": round(ms / plain_ms, 2)}


def run() -> tuple[dict, list[dict]]:
    rows = [case(n, t, kind, k)
            for n in ROWS for t in (0.0, 1.0)
            for kind in ("logit_bias x300", "allowed_token_ids x1000")
            for k in (1, n)]
    import triton

    name = torch.cuda.get_device_name() if IS_CUDA else "cpu"
    meta = {"device": name, "commit": git_commit(), "date": utc_now(),
            "torch": torch.__version__, "triton": triton.__version__,
            "threads": torch.get_num_threads()}
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    cols = ["rows", "vocab", "temperature", "steering", "steered_rows", "plain_ms",
            "steered_ms", "ratio"]
    lines = header_lines("Token steering in the sampler", meta, "fp32 logits")
    lines += ["plain = Sampler.sample with no steering; steered = the same step with the "
              "rows' steering gathered from the per-slot table; ratio = steered / plain.",
              ""]
    lines += table_lines(cols, rows)
    return "\n".join(lines) + "\n"


def test_bench_steering(tmp_path):
    """Smoke test (no timing assertions): every case runs and the files are written."""
    meta, rows = run()
    assert all(r["plain_ms"] > 0 and r["steered_ms"] > 0 for r in rows)
    path = write(meta, rows, out_dir(False, None) or tmp_path, PREFIX, markdown)
    print("\n" + path.read_text())


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, run, markdown, PREFIX)


if __name__ == "__main__":
    sys.exit(main())
