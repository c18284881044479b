"""The prefill watermark is inclusive: a rank wants a prompt step while
``cache_usage() <= prefill_watermark``. Checked at usage exactly at the watermark and one
block on either side of it (a strict ``<`` differs only at equality)."""

from __future__ import annotations

import pytest

from tests.scheduler.helpers import FakeRunner, make


def step(s, runner):
    out = s.schedule()
    s.update(out, runner.execute(out))
    s.check_invariants()
    return out


@pytest.mark.parametrize("num_blocks, watermark", [(8, 0.5), (8, 0.25), (16, 0.75)])
@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["below", "at", "above"])
def test_prompt_step_iff_usage_at_or_below_watermark(num_blocks, watermark, delta):
    bs = 4
    at = round(watermark * num_blocks)  # blocks in use at exactly the watermark
    used = at + delta
    s = make(num_blocks=num_blocks, block_size=bs, prefill_watermark=watermark,
             max_model_len=bs * num_blocks + 8, max_num_batched_tokens=bs * num_blocks)
    r = FakeRunner(s)
    # A prompt of `used` full blocks: after its prompt step it holds exactly `used`
    # blocks and keeps running (the watermark is waived only when nothing runs).
    s.add_request("a", list(range(used * bs)), 4)
    assert step(s, r).is_prompt
    assert s.num_running == 1
    assert s.cache_usage() == used / num_blocks
    s.add_request("b", [1, 2], 2)
    out = step(s, r)  # decode_step 0: an ALL point (prefill_attempt_interval=1)
    want_prompt = used <= at
    assert out.is_prompt == want_prompt, (
        f"usage {used}/{num_blocks} vs watermark {watermark}: expected a "
        f"{'prompt' if want_prompt else 'decode'} step")
    if want_prompt:
        assert out.seq_ids == [1]
    else:
        assert s.num_waiting == 1
