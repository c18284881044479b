"""``apply_token_mask``: xgrammar's bitmask layout applied to the constrained rows only,
on CPU and (when lent) on CUDA without a host sync."""

from __future__ import annotations

import pytest
import torch

from deepinfer.structured.bitmask import BitmaskStaging, TokenMask, apply_token_mask


def _case(seed: int, n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, words), generator=g, dtype=torch.int64)
    rows = sorted(torch.randperm(n, generator=g)[: max(1, n // 2)].tolist())
    return logits, bitmask.to(torch.int32), rows


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit j % 32 of word j // 32 set: token j allowed; other rows untouched."""
    vocab = logits.shape[1]
    out = logits.clone()
    bits = (bitmask.long().unsqueeze(-1) >> torch.arange(32)) & 1  # [n, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    for r in rows:
        out[r][~allowed[r]] = float("-inf")
    return out


@pytest.mark.parametrize("seed,n,vocab", [(0, 4, 290), (1, 7, 1000), (2, 3, 49152)])
def test_masks_only_the_constrained_rows_cpu(seed, n, vocab):
    logits, bitmask, rows = _case(seed, n, vocab)
    want = _reference(logits, bitmask, rows)
    got = apply_token_mask(logits.clone(), TokenMask(bitmask, rows))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    half = apply_token_mask(logits.clone().half(), TokenMask(bitmask, rows))
    assert half.dtype == torch.float32  # a 16-bit row is masked on a float32 copy
    assert torch.equal(torch.isinf(half), torch.isinf(want))
    same = logits.clone()
    assert apply_token_mask(same, None) is same
    assert apply_token_mask(same, TokenMask(bitmask, [])) is same


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_on_cuda_without_a_host_sync():
    logits, bitmask, rows = _case(3, 64, 49152)
    want = _reference(logits, bitmask, rows)
    dev = logits.cuda()
    apply_token_mask(dev.clone(), TokenMask(bitmask, rows))  # compile the kernel first
    torch.cuda.synchronize()
    fresh = torch.full_like(dev, float("nan"))
    fresh.copy_(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = apply_token_mask(fresh, TokenMask(bitmask, rows), BitmaskStaging())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_masks_do_not_wait_for_the_device():
    """Behind a long kernel (the forward the host overlaps with) each step's mask is
    queued and the call returns while the device is still busy; two steps in a row use
    both buffers and each step gets its own mask."""
    staging = BitmaskStaging()
    cases = [_case(10 + k, 64, 49152) for k in range(3)]
    for logits, bitmask, rows in cases[:1]:  # compile xgrammar's kernel first
        apply_token_mask(logits.cuda(), TokenMask(bitmask, rows), staging)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    outs = []
    for logits, bitmask, rows in cases:
        dev = torch.full_like(logits, float("nan"), device="cuda")
        dev.copy_(logits)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time
        outs.append(apply_token_mask(dev, TokenMask(bitmask, rows), staging))
        assert not stream.query(), "the mask's upload waited for the device"
        bitmask.fill_(0)  # the host refills its mask at once: the upload holds its copy
    for k, ((logits, _, rows), got) in enumerate(zip(cases, outs)):
        want = _reference(logits, _case(10 + k, 64, 49152)[1], rows)
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
