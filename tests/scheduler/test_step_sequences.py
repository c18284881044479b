"""What a step names: the sequences it admitted (``SchedulerOutputs.admitted``) and forked
(``forked``), which the engine reads instead of decoding the launch tensors."""

from __future__ import annotations

from deepinfer_scheduler import SequenceStatus
from tests.scheduler.helpers import FakeRunner, check_named_sequences, make


def _step(s, runner):
    out = s.schedule()
    check_named_sequences(out)
    fin = s.update(out, runner.execute(out))
    s.check_invariants()
    return out, fin


def test_admitted_and_forked_with_n_samples():
    s = make(block_size=4)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 4)
    s.add_request("b", list(range(10, 16)), 4, n=3)
    out = s.schedule()
    a, b = s.get_sequences("a")[0], s.get_sequences("b")[0]
    kids = [q for q in s.get_sequences("b") if q.sample_index > 0]
    assert out.admitted == (a, b)
    assert [k.sample_index for k in out.forked] == [1, 2] and list(out.forked) == kids
    # The same sequences as the launch tensors, in their order.
    assert out.zero_states.tolist() == [a.slot, b.slot]
    assert out.clone_states.tolist() == [[b.slot, k.slot] for k in kids]
    assert len({a.slot, b.slot, *(k.slot for k in kids)}) == 4
    s.update(out, r.execute(out))
    out, _ = _step(s, r)  # decode: nothing new
    assert not out.is_prompt and out.admitted == () and out.forked == ()
    assert out.zero_states.numel() == 0 and out.clone_states.numel() == 0


def test_outputs_own_their_lists():
    """Unlike the launch buffers, a step's named sequences survive the next schedule()."""
    s = make(max_num_batched_tokens=8, block_size=4)
    r = FakeRunner(s)
    s.add_request("a", [1, 2, 3], 2, n=2)
    first = s.schedule()
    named = (list(first.admitted), list(first.forked))
    s.update(first, r.execute(first))
    s.add_request("b", [4, 5, 6], 2, n=2)
    second = s.schedule()
    assert second.is_prompt and second.admitted == tuple(s.get_sequences("b")[:1])
    assert (list(first.admitted), list(first.forked)) == named


def test_chunked_prompt_admitted_at_first_chunk_forked_at_last():
    s = make(max_num_batched_tokens=8, max_model_len=64)
    r = FakeRunner(s)
    s.add_request("a", list(range(20)), 2, n=2)
    seq = s.get_sequences("a")[0]
    named = []
    while s.num_running == 0:
        out, _ = _step(s, r)
        named.append(([q.seq_id for q in out.admitted], [q.sample_index for q in out.forked]))
    assert named == [([seq.seq_id], []), ([], []), ([], [1])]


def test_recomputed_sequence_is_admitted_again():
    s = make(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=4)
    r = FakeRunner(s)
    for rid, base in (("a", 0), ("b", 10), ("c", 20)):
        s.add_request(rid, list(range(base, base + 7)), 10)
    first, _ = _step(s, r)
    assert [q.request_id for q in first.admitted] == ["a", "b", "c"]
    while s.stats.num_preemptions == 0:
        _step(s, r)
    victim = s.waiting[0]
    assert victim.status is SequenceStatus.WAITING and victim.output_token_ids
    while victim.slot < 0:
        out, _ = _step(s, r)
    # Its slot is zeroed again and it recomputes prompt and outputs: named as admitted.
    assert out.is_prompt and victim in out.admitted and out.forked == ()
