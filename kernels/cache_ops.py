"""Bulk block/slot copies for copy-on-write KV blocks and per-sequence state slots.

All copies move raw bits through an integer view of the data, so they are exact for every
dtype and one compiled kernel per word size serves them all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer_kernels.runtime import Launch, Target, int_view, run_launches
from deepinfer_kernels.validation import INDEX_DTYPES, check_runnable_device, check_tensor, fail


@triton.jit
def _copy_rows_kernel(
    data_ptr, pairs_ptr, num_rows, row_elems, group_stride,
    stride_pair, stride_col,
    BLOCK: tl.constexpr, ZERO: tl.constexpr,
):
    """Row copy/zero over the planes of grid axis 1 (one per program id).

    data is viewed as ``[planes, num_rows, row_elems]`` (group_stride elements apart);
    program (i, g) copies row ``pairs[i, 0]`` to row ``pairs[i, 1]`` of plane g (ZERO:
    zeroes row ``pairs[i]``). Rows outside [0, num_rows) are skipped, since the host
    cannot check device indices without a sync.
    """
    i = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    if ZERO:
        dst = tl.load(pairs_ptr + i * stride_pair).to(tl.int64)
        src = dst
    else:
        src = tl.load(pairs_ptr + i * stride_pair).to(tl.int64)
        dst = tl.load(pairs_ptr + i * stride_pair + stride_col).to(tl.int64)
    valid = (src >= 0) & (src < num_rows) & (dst >= 0) & (dst < num_rows)
    if valid:
        plane = g * group_stride
        src_base = data_ptr + plane + src * row_elems
        dst_base = data_ptr + plane + dst * row_elems
        for start in range(0, row_elems, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < row_elems
            if ZERO:
                vals = tl.zeros([BLOCK], dtype=data_ptr.dtype.element_ty)
            else:
                vals = tl.load(src_base + offs, mask=mask)
            tl.store(dst_base + offs, vals, mask=mask)


def _block_for(row_elems: int, target: Target) -> int:
    # GPU: 4K words per step keeps enough bytes in flight; interpreter: one big step.
    cap = 1 << 16 if target.interpret else 4096
    return min(cap, triton.next_power_of_2(max(row_elems, 16)))


def _check_pairs(name: str, pairs: object, device: torch.device) -> torch.Tensor:
    p = check_tensor(name, pairs, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if p.shape[1] != 2:
        fail(name, "shape [N, 2] of (src, dst) rows", f"shape {tuple(p.shape)}")
    return p


def clone_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy KV block ``src`` to ``dst`` in every layer, K and V, for each row of ``pairs``.

    kv_cache: ``[num_layers, 2, num_blocks, block_size, Hkv, D]``, contiguous, any dtype.
    pairs: ``[N, 2]`` int32/int64 (src, dst) on the cache's device. One launch covers all
    layers, K/V and pairs. A src may go to several dsts; a dst must not also be a src of
    another pair in the same call (copies run in parallel).
    """
    cache = check_tensor("kv_cache", kv_cache, ndim=6, contiguous=True)
    if cache.shape[1] != 2:  # the launch covers K and V of every layer
        raise ValueError("kv_cache: expected [num_layers, 2, num_blocks, block_size, Hkv, D], "
                         f"got shape {tuple(cache.shape)}")
    device = check_runnable_device("kv_cache", cache)
    p = _check_pairs("pairs", pairs, device)
    if p.shape[0] == 0 or cache.numel() == 0:
        return
    run_launches(clone_blocks_launches(cache, p, Target.of(device)))


def clone_blocks_launches(kv_cache: torch.Tensor, pairs: torch.Tensor, target: Target
                          ) -> list[Launch]:
    """The launch of ``clone_blocks`` for validated, non-empty arguments (a pure function of
    shapes, dtypes and ``target``; ``deepinfer_compile_grid.check`` (tools/) plans with it too)."""
    num_layers, _, num_blocks = kv_cache.shape[:3]
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    words = int_view(kv_cache, block_bytes)
    row_elems = block_bytes // words.element_size()
    return [Launch(_copy_rows_kernel, (pairs.shape[0], num_layers * 2), (
        words, pairs, num_blocks, row_elems, num_blocks * row_elems,
        pairs.stride(0), pairs.stride(1),
    ), dict(BLOCK=_block_for(row_elems, target), ZERO=False, num_warps=4))]


def _check_states(states: object, device: torch.device) -> list[torch.Tensor]:
    if isinstance(states, torch.Tensor) or not isinstance(states, Sequence):
        fail("states", "a list of tensors", type(states).__name__)
    assert isinstance(states, Sequence)
    checked = []
    for i, s in enumerate(states):
        t = check_tensor(f"states[{i}]", s, contiguous=True, device=device)
        if t.dim() == 0:
            fail(f"states[{i}]", "a tensor with the slot as dim 0", "a 0-d tensor")
        checked.append(t)
    return checked


def state_launches(states: Sequence[torch.Tensor], idx: torch.Tensor, zero: bool,
                   target: Target) -> list[Launch]:
    """The launches of ``zero_states`` (``zero``, idx ``[M]``) or ``clone_states`` (idx
    ``[P, 2]``) for validated arguments: one per non-empty state tensor (a pure function of
    shapes, dtypes and ``target``; ``deepinfer_compile_grid.check`` (tools/) plans with it too)."""
    launches = []
    for t in states:
        if t.numel() == 0:
            continue
        row_bytes = t[0].numel() * t.element_size()
        words = int_view(t, row_bytes)
        row_elems = row_bytes // words.element_size()
        launches.append(Launch(_copy_rows_kernel, (idx.shape[0], 1), (
            words, idx, t.shape[0], row_elems, 0,
            idx.stride(0), idx.stride(1) if idx.dim() == 2 else 0,
        ), dict(BLOCK=_block_for(row_elems, target), ZERO=zero, num_warps=4)))
    return launches


def zero_states(states: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
    """Zero row ``slots[i]`` (dim 0) of every tensor in ``states``.

    states: contiguous tensors of any trailing shape and dtype, all on one device.
    slots: ``[M]`` int32/int64 on that device. One launch per tensor.
    """
    sl = check_tensor("slots", slots, ndim=1, dtypes=INDEX_DTYPES)
    device = check_runnable_device("slots", sl)
    checked = _check_states(states, device)
    if sl.shape[0] == 0:
        return
    run_launches(state_launches(checked, sl, True, Target.of(device)))


def clone_states(states: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy row ``src`` to row ``dst`` (dim 0) of every tensor in ``states``.

    states: contiguous tensors of any trailing shape and dtype, all on one device.
    pairs: ``[P, 2]`` int32/int64 (src, dst). One launch per tensor.
    """
    p = check_tensor("pairs", pairs, ndim=2, dtypes=INDEX_DTYPES)
    device = check_runnable_device("pairs", p)
    p = _check_pairs("pairs", p, device)
    checked = _check_states(states, device)
    if p.shape[0] == 0:
        return
    run_launches(state_launches(checked, p, False, Target.of(device)))
