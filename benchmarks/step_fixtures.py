"""The steps ``bench_step_broadcast.py`` hands from the leader to the followers: step sizes
(``Shape``), a deterministic scheduler-output-like step of each (a real ``LaunchBatch``
with the dtypes of ``scheduler/batch.py``), and the followers' check of a received step
against the leader's."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_scheduler.batch import LaunchBatch


@dataclass(frozen=True)
class Shape:
    """One step size: T tokens, B sequences, W block-table width, S samples, N
    copy-on-write pairs."""

    name: str
    t: int
    b: int
    w: int
    s: int
    max_q: int
    is_prompt: bool
    n_clone: int = 0

    @property
    def payload_words(self) -> int:
        return 3 * self.t + self.b * self.w + 2 * self.b + 1 + self.s + 2 * self.n_clone


def step_seed(shape: Shape) -> int:
    """The same seed in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(shape.name.encode())


def decode_shape(b: int, w: int) -> Shape:
    """A decode step: ``b`` sequences of one token each, block tables ``w`` wide."""
    return Shape(f"decode B={b} W={w}", t=b, b=b, w=w, s=b, max_q=1, is_prompt=False)


def default_shapes() -> list[Shape]:
    """The step sizes of a full run: decode steps of 1 to 256 sequences, then a prefill."""
    shapes = [decode_shape(b, w) for w in (8, 64) for b in (1, 16, 64, 256)]
    # 2048 prompt tokens over 8 sequences of 256 (block size 16: 16 blocks each), two
    # copy-on-write pairs (a prefix-cache hit on a partly filled block).
    shapes.append(Shape("prefill T=2048 B=8 W=16", t=2048, b=8, w=16, s=8, max_q=256,
                        is_prompt=True, n_clone=2))
    return shapes


@dataclass
class SchedOut:
    """What ``StepChannel.send_step`` reads of a scheduler output."""

    batch: LaunchBatch
    is_prompt: bool
    clone_blocks: torch.Tensor


def make_step(shape: Shape, seed: int = 0) -> SchedOut:
    """A deterministic step of ``shape`` with realistic values and the dtypes of
    ``scheduler/batch.py``."""
    g = torch.Generator().manual_seed(seed)
    b, t, w = shape.b, shape.t, shape.w
    block = 16
    if shape.is_prompt:
        q = torch.full((b,), t // b, dtype=torch.int64)
        q[-1] += t - int(q.sum())
        cached = torch.zeros(b, dtype=torch.int64)
    else:
        q = torch.ones(b, dtype=torch.int64)
        cached = torch.randint(1, w * block, (b,), generator=g)
    seq_lens = cached + q
    qsl = torch.zeros(b + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q, 0)
    seq_of = torch.repeat_interleave(torch.arange(b), q)
    positions = cached[seq_of] + (torch.arange(t) - qsl[:-1][seq_of])
    tables = torch.randint(1, 50_000, (b, w), generator=g, dtype=torch.int32)
    slots = tables[seq_of, (positions // block).clamp(max=w - 1)].long() * block \
        + positions % block
    batch = LaunchBatch(
        input_ids=torch.randint(0, 150_000, (t,), generator=g),
        positions=positions, slot_mapping=slots, block_tables=tables,
        seq_lens=seq_lens.to(torch.int32), query_start_loc=qsl.to(torch.int32),
        logits_indices=qsl[1:] - 1, state_slots=torch.arange(b),
        sample_state_slots=torch.arange(shape.s),
        max_query_len=shape.max_q, max_seq_len=int(seq_lens.max()), num_tokens=t)
    clone = torch.randint(1, 50_000, (shape.n_clone, 2), generator=g)
    return SchedOut(batch, shape.is_prompt, clone)


# The launch tensors of a step: the ones checked, and the ones handed back.
STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
           "query_start_loc", "logits_indices")


def step_mismatch(got: Any, want: SchedOut) -> str | None:
    """None when follower step ``got`` holds exactly ``want``'s launch tensors (values,
    shapes, dtypes), scalars and clone pairs; else what differs."""
    for f in STEP_FIELDS:
        a, b = getattr(got.batch, f), getattr(want.batch, f)
        if a.dtype != b.dtype or not torch.equal(a, b):
            return f"{f}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)} or values"
    for f in ("max_query_len", "max_seq_len", "num_tokens"):
        if getattr(got.batch, f) != getattr(want.batch, f):
            return f"{f}: {getattr(got.batch, f)} != {getattr(want.batch, f)}"
    if bool(got.is_prompt) != want.is_prompt:
        return "is_prompt"
    if got.clone_blocks.dtype != torch.int64 or not torch.equal(got.clone_blocks,
                                                                 want.clone_blocks):
        return "clone_blocks"
    return None


def step_arrays(step: Any) -> dict[str, Any]:
    """A received step as plain numpy / python values (to hand back to the parent)."""
    d: dict[str, Any] = {f: getattr(step.batch, f).numpy().copy() for f in STEP_FIELDS}
    d.update(max_query_len=step.batch.max_query_len, max_seq_len=step.batch.max_seq_len,
             num_tokens=step.batch.num_tokens, is_prompt=bool(step.is_prompt),
             clone_blocks=step.clone_blocks.numpy().copy())
    return d
