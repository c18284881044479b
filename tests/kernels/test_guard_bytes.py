"""Writes stay inside the destination tensor: caches and states here are views into a
larger buffer of random guard bytes, so a write one row before the first block or past
the last block/row lands in the guard and shows up as changed guard bytes (instead of
silently corrupting the heap, or not at all when the test only compares the tensor).

Covers store_kv (negative padding slots, the last slot of the last block) and the copy
ops (clone_blocks into the last block, zero_states / clone_states on the last row), for
the Triton kernels, the reference and the CPU backend the engine runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import cpu_backend, reference
from tests.kernels.helpers import DEVICE, bits, generator, randn

BACKENDS = [pytest.param(deepinfer_kernels, id="triton"), pytest.param(reference, id="reference"),
            pytest.param(cpu_backend, id="cpu_backend")]
GUARD = 4096  # bytes each side: more than one cache row / state row below


def _guarded(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator):
    """(full buffer, view): a contiguous ``shape`` view in the middle of a random buffer."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    pad = GUARD // itemsize
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        full = (torch.rand(n + 2 * pad, generator=g) > 0.5).to(DEVICE)
    elif dtype.is_floating_point:
        full = randn((n + 2 * pad,), dtype, g)
    else:
        full = torch.randint(1, 1000, (n + 2 * pad,), generator=g).to(dtype=dtype, device=DEVICE)
    view = full[pad:pad + n].view(shape)
    assert view.is_contiguous() and view.storage_offset() == pad
    return full, view


def _guard_bits(full: torch.Tensor, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    off, n = view.storage_offset(), view.numel()
    return bits(full[:off]).clone(), bits(full[off + n:]).clone()


def _assert_guard(full: torch.Tensor, view: torch.Tensor, before, what: str) -> None:
    lo, hi = _guard_bits(full, view)
    assert torch.equal(lo, before[0]), f"{what}: bytes before the tensor were overwritten"
    assert torch.equal(hi, before[1]), f"{what}: bytes after the tensor were overwritten"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("ops", BACKENDS)
def test_store_kv_stays_inside_cache(ops, dtype):
    g = generator(21)
    num_blocks, bs, hkv, d = 6, 4, 2, 32
    shape = (num_blocks, bs, hkv, d)
    kfull, k_cache = _guarded(shape, dtype, g)
    vfull, v_cache = _guarded(shape, dtype, g)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    guards = [_guard_bits(kfull, k_cache), _guard_bits(vfull, v_cache)]
    last = num_blocks * bs - 1
    # Padding (negative) slots around real ones: the first slot, the last slot of the
    # last block, and the first slot of the last block.
    slots = torch.tensor([-1, 0, -1, last, -2, (num_blocks - 1) * bs, -bs, -1],
                         dtype=torch.int64, device=DEVICE)
    k = randn((slots.shape[0], hkv, d), dtype, g)
    v = randn((slots.shape[0], hkv, d), dtype, g)
    ops.store_kv(k, v, k_cache, v_cache, slots)
    for full, cache, guard, name in ((kfull, k_cache, guards[0], "k_cache"),
                                     (vfull, v_cache, guards[1], "v_cache")):
        _assert_guard(full, cache, guard, f"store_kv {name}")
    # Inside the cache: exactly the non-negative slots were written.
    keep = slots >= 0
    for cache, want, src in ((k_cache, k_want, k), (v_cache, v_want, v)):
        want.view(-1, hkv, d)[slots[keep]] = src[keep]
        assert torch.equal(bits(cache), bits(want))


@pytest.mark.parametrize("ops", BACKENDS)
def test_clone_blocks_stays_inside_cache(ops):
    g = generator(22)
    num_layers, num_blocks = 2, 5
    shape = (num_layers, 2, num_blocks, 4, 2, 16)
    full, cache = _guarded(shape, torch.bfloat16, g)
    guard = _guard_bits(full, cache)
    want = cache.clone()
    # Into the last block, and from the last block into the first one.
    pairs = torch.tensor([[1, num_blocks - 1], [num_blocks - 2, 0]], dtype=torch.int64,
                         device=DEVICE)
    ops.clone_blocks(cache, pairs)
    _assert_guard(full, cache, guard, "clone_blocks")
    want[:, :, num_blocks - 1] = want[:, :, 1]
    want[:, :, 0] = want[:, :, num_blocks - 2]
    assert torch.equal(bits(cache), bits(want))


def _states(g: torch.Generator):
    # Row sizes of 1, 3 (bool), 8 and 66 bytes (odd word sizes for the raw-bit copy).
    return [_guarded((7, 3, 5), torch.float32, g), _guarded((7, 3), torch.bool, g),
            _guarded((7,), torch.int64, g), _guarded((7, 33), torch.float16, g)]


@pytest.mark.parametrize("ops", BACKENDS)
def test_zero_states_stays_inside_states(ops):
    g = generator(23)
    pairs = _states(g)
    guards = [_guard_bits(full, view) for full, view in pairs]
    wants = [view.clone() for _, view in pairs]
    slots = torch.tensor([6, 0], dtype=torch.int64, device=DEVICE)  # last and first row
    ops.zero_states([view for _, view in pairs], slots)
    for (full, view), guard, want in zip(pairs, guards, wants):
        _assert_guard(full, view, guard, f"zero_states {view.dtype}")
        want[[6, 0]] = 0
        assert torch.equal(bits(view), bits(want))


@pytest.mark.parametrize("ops", BACKENDS)
def test_clone_states_stays_inside_states(ops):
    g = generator(24)
    pairs = _states(g)
    guards = [_guard_bits(full, view) for full, view in pairs]
    wants = [view.clone() for _, view in pairs]
    rows = torch.tensor([[2, 6], [5, 0]], dtype=torch.int64, device=DEVICE)  # to last/first
    ops.clone_states([view for _, view in pairs], rows)
    for (full, view), guard, want in zip(pairs, guards, wants):
        _assert_guard(full, view, guard, f"clone_states {view.dtype}")
        want[6] = want[2]
        want[0] = want[5]
        assert torch.equal(bits(view), bits(want))


def test_copy_ops_skip_negative_rows_triton():
    """The Triton copy kernels skip rows outside [0, rows) (the host cannot check device
    indices without a sync): a negative src, dst or slot changes nothing at all."""
    g = generator(25)
    full, cache = _guarded((1, 2, 3, 4, 1, 16), torch.float32, g)
    before = bits(full).clone()
    deepinfer_kernels.clone_blocks(cache, torch.tensor([[0, -1], [-1, 0], [2, 3]], device=DEVICE))
    assert torch.equal(bits(full), before), "clone_blocks wrote for a row out of range"
    states = _states(g)
    befores = [bits(f).clone() for f, _ in states]
    views = [view for _, view in states]
    deepinfer_kernels.zero_states(views, torch.tensor([-1, 7], device=DEVICE))
    deepinfer_kernels.clone_states(views, torch.tensor([[0, -1], [-1, 0], [7, 1]], device=DEVICE))
    for (f, _), b in zip(states, befores):
        assert torch.equal(bits(f), b), "zero/clone_states wrote for a row out of range"
