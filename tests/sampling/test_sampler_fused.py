"""The sampler's draw: rows are drawn by its ops (here the Triton package, through the
interpreter on a CPU machine): ``sample_tokens`` straight from the logits when they only
scale by a temperature, ``sample_tokens_filtered`` (the torch filters, then the kernel)
when top-k/top-p/min-p are on. Either way the ids are the torch sampler's (``Sampler()``:
``deepinfer_kernels.reference``) for the same uniforms."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import deepinfer_kernels
from deepinfer.sampling.params import SamplingParams as SP
from deepinfer.sampling.sampler import Sampler, SamplingTensors

V = 300


class CountingOps(SimpleNamespace):
    """An ops provider whose draws are the Triton package's, counting the calls of each."""

    def __init__(self) -> None:
        super().__init__(calls=0, filtered_calls=0)

    def sample_tokens(self, logits, temperatures, uniforms):
        self.calls += 1
        return deepinfer_kernels.sample_tokens(logits, temperatures, uniforms)

    def sample_tokens_filtered(self, logits, temperatures, uniforms, **filters):
        self.filtered_calls += 1
        return deepinfer_kernels.sample_tokens_filtered(logits, temperatures, uniforms,
                                                        **filters)


def params(top_p: float = 1.0) -> list[SP]:
    """Six rows: temperatures 0.7 / 1.3, half of them seeded, one greedy."""
    return [SP(temperature=0.7, top_p=top_p, seed=11), SP(temperature=1.3, top_p=top_p),
            SP(temperature=1.3, top_p=top_p, seed=5), SP(temperature=0.7, top_p=top_p),
            SP(temperature=0.0), SP(temperature=0.7, top_p=top_p, seed=7)]


def sample_both(logits: torch.Tensor, st: SamplingTensors,
                ops: CountingOps) -> tuple[torch.Tensor, torch.Tensor]:
    """``Sampler(ops)`` and ``Sampler()`` on the same logits; ``torch.manual_seed`` before
    each so that the unseeded rows' ``torch.rand`` uniforms are the same."""
    before = logits.clone()
    torch.manual_seed(1234)
    fused, _ = Sampler(ops).sample(logits, st)
    assert torch.equal(logits, before), "the sampler modified the logits"
    torch.manual_seed(1234)
    ref, _ = Sampler().sample(logits, st)
    return fused, ref


def test_temperature_rows_use_the_ops_sample_tokens():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g) * 3
    st = SamplingTensors.from_params(params(), V, "cpu")
    assert not (st.do_top_k or st.do_top_p or st.do_min_p) and st.any_seeded
    ops = CountingOps()
    fused, ref = sample_both(logits, st, ops)
    assert ops.calls == 1
    assert fused.dtype == torch.int64 and fused.shape == (6,)
    assert torch.equal(fused, ref), (fused.tolist(), ref.tolist())
    assert fused[4] == logits[4].argmax()  # the greedy row
    # Seeded rows do not depend on torch's generator: the same ids under another seed.
    torch.manual_seed(999)
    again, _ = Sampler(ops).sample(logits, st)
    seeded = [0, 2, 5]
    assert torch.equal(again[seeded], fused[seeded])


def test_bf16_logits_and_banned_tokens_take_the_fused_path():
    """bf16 logits (cast to fp32 first), and EOS banned (a copy with -inf): still fused,
    the banned token never drawn."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, V, generator=g) * 3).bfloat16()
    logits[:, 2] = 20.0  # the banned token would be drawn almost surely
    st = SamplingTensors.from_params(params(), V, "cpu", banned_token_ids=[[2]] * 6)
    ops = CountingOps()
    fused, ref = sample_both(logits, st, ops)
    assert ops.calls == 1
    assert torch.equal(fused, ref)
    assert not (fused == 2).any()


def test_filtered_batch_filters_in_torch_then_draws_with_the_ops():
    """top-p (and min-p) go to the ops' filtered draw (torch filters, then the kernel),
    with the torch sampler's ids."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, V, generator=g) * 3
    st = SamplingTensors.from_params(params(top_p=0.8), V, "cpu")
    assert st.do_top_p
    ops = CountingOps()
    fused, ref = sample_both(logits, st, ops)
    assert (ops.calls, ops.filtered_calls) == (0, 1)
    assert torch.equal(fused, ref)
    with_min_p = [SP(temperature=p.temperature, top_p=p.top_p, min_p=0.1, seed=p.seed)
                  for p in params(top_p=0.8)]
    st = SamplingTensors.from_params(with_min_p, V, "cpu")
    fused, ref = sample_both(logits, st, ops)
    assert (ops.calls, ops.filtered_calls) == (0, 2)
    assert torch.equal(fused, ref)
