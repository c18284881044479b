"""Temperature sampling in one kernel: a draw from ``softmax(logits / T)`` by inverting the
row's cumulative distribution at a given uniform.

In torch that is a copy to fp32, a division, a softmax, a cumulative sum, a search and a
fallback check: six or more passes over ``[N, V]`` floats and three ``[N, V]``
temporaries (at 256 rows of a 152k vocabulary, ~150 MB each). Here one program per row
reads its logits twice (max and normaliser, then the scan) and writes one id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, run_launches
from deepinfer_kernels.sampling_reference import filter_logits
from deepinfer_kernels.validation import (
    FLOAT_DTYPES,
    check_runnable_device,
    check_sampling_args,
    check_shape,
    check_tensor,
)


@triton.jit
def _sample_tokens_kernel(
    logits_ptr, temp_ptr, u_ptr, out_ptr, vocab, stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temp_ptr + row)
    u = tl.load(u_ptr + row)
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")

    # Pass 1: the row's maximum (and its first index: the fallback) and the softmax
    # normaliser, rescaled online as the maximum grows.
    m = tl.full((), neg_inf, tl.float32)
    s = tl.full((), 0.0, tl.float32)
    arg = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        x = _scaled_logits(base, start + offs, vocab, t)
        cm = tl.max(x, 0)
        ci = tl.argmax(x, 0).to(tl.int32) + start
        new_m = tl.maximum(m, cm)
        arg = tl.where(cm > m, ci, arg)
        # exp(-inf - -inf) is NaN: a block (or a row so far) of -inf adds nothing.
        scale = tl.where(m == new_m, 1.0, tl.exp(m - new_m))
        e = tl.where(x == neg_inf, 0.0, tl.exp(x - new_m))
        s = s * scale + tl.sum(e, 0)
        m = new_m

    # Pass 2: the first token with nonzero probability whose cumulative mass passes
    # u * s. A zero is never drawn, even where the scan's rounding would let it pass.
    found, total = _scan(base, offs, vocab, t, m, u * s, BLOCK)
    if found == vocab:
        # The scan's own total rounded below pass 1's s, and u * s (u near 1) lies past
        # it. Scan again against u * total: the same sums, so a token is found. Rare.
        found, total = _scan(base, offs, vocab, t, m, u * total, BLOCK)
    # Only a row of NaN / +inf finds nothing: its most likely token, kept in range.
    tok = tl.minimum(tl.where(found < vocab, found, arg), vocab - 1)
    tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _scaled_logits(base, idx, vocab, t):
    """A block of ``logits / t`` in fp32; -inf past the end and for NaN (never drawn)."""
    x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) / t
    return tl.where((x == x) & (idx < vocab), x, float("-inf"))


@triton.jit
def _scan(base, offs, vocab, t, m, target, BLOCK: tl.constexpr):
    """(first index with nonzero ``exp(x - m)`` whose running sum passes ``target``, or
    ``vocab``; the running sum's total)."""
    c = tl.full((), 0.0, tl.float32)
    found = tl.full((), vocab, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        x = _scaled_logits(base, idx, vocab, t)
        e = tl.where(x == float("-inf"), 0.0, tl.exp(x - m))
        cs = tl.cumsum(e, 0) + c
        found = tl.minimum(found, tl.min(tl.where((cs > target) & (e > 0), idx, vocab), 0))
        # Carry the scan's own largest value (not c + sum(e), which may round above it),
        # so the next block's values never start below this one's.
        c = tl.max(cs, 0)
    return found, c


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``softmax(logits / temperature)``: the first token with
    nonzero probability whose cumulative probability exceeds ``uniform * total``.

    logits: ``[N, V]`` float (fp32/fp16/bf16; -inf marks tokens that cannot be drawn, NaN
    too), unit stride in the last dim; not modified. temperatures, uniforms: ``[N]``
    float32 (uniforms in ``[0, 1)``). Returns ``[N]`` int64 token ids. A row whose
    temperature is zero, or with no finite logit, gets some id in ``[0, V)`` (the caller
    replaces greedy rows).
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_runnable_device("logits", logits)
    n, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary, got shape {(n, vocab)}")
    for name, t in (("temperatures", temperatures), ("uniforms", uniforms)):
        check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=device, contiguous=True)
        check_shape(name, t, (n,))
    out = torch.empty(n, dtype=torch.int64, device=device)
    if n:
        run_launches(sample_tokens_launches(logits, temperatures, uniforms, out,
                                            Target.of(device)))
    return out


def sample_tokens_filtered(logits: torch.Tensor, temperatures: torch.Tensor,
                           uniforms: torch.Tensor, top_k: torch.Tensor | None = None,
                           top_p: torch.Tensor | None = None,
                           min_p: torch.Tensor | None = None,
                           max_top_k: int | None = None) -> torch.Tensor:
    """``sample_tokens`` after top-k (``[N]`` int64), top-p and min-p (``[N]`` fp32 each;
    None: off), as ``reference.sample_tokens_filtered``: the filters run in torch on a
    scaled float32 copy (``reference.filter_logits``: a sort per row for top-p), the draw
    in the kernel. ``max_top_k`` (a host bound on ``top_k``) keeps top-k alone from
    reading the device. ``logits`` ``[N, V]`` is not modified; returns ``[N]`` int64."""
    check_sampling_args(logits, temperatures=temperatures, uniforms=uniforms, top_k=top_k,
                        top_p=top_p, min_p=min_p)
    scaled = filter_logits(logits, temperatures, top_k, top_p, min_p, max_top_k)
    return sample_tokens(scaled, torch.ones_like(uniforms), uniforms)


def sample_tokens_launches(logits: torch.Tensor, temperatures: torch.Tensor,
                           uniforms: torch.Tensor, out: torch.Tensor,
                           target: Target) -> list[Launch]:
    """The launch of ``sample_tokens`` for validated, non-empty arguments (a pure function
    of shapes, strides, dtypes and ``target``)."""
    n, vocab = logits.shape
    # 4K-element blocks: 38 iterations a pass at a 152k vocabulary; the interpreter
    # prefers fewer, larger blocks. 16 warps: 8 values a thread per block (with 8 warps
    # sm_90 fp32 left an 8-byte stack frame under Triton 3.9; 2K blocks did at others).
    block = 16384 if target.interpret else 4096
    return [Launch(_sample_tokens_kernel, (n,), (
        logits, temperatures, uniforms, out, vocab, logits.stride(0),
    ), dict(BLOCK=block, num_warps=16))]
