"""The GPU path of the engine: compiled Triton kernels, CUDA graphs, memory-sized KV cache.

Skipped without CUDA; ``scripts/gpu_ci.sh`` runs these whenever a GPU is lent.
"""

from __future__ import annotations

import gc

import pytest
import torch

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """Each engine sizes its KV cache from the memory left: free the last test's first."""
    yield
    gc.collect()
    torch.cuda.empty_cache()

PROMPTS = [[5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 41, 55, 61, 90,
            101, 11, 13, 150, 160, 170, 180, 190, 30, 44, 45, 46, 47], [9, 8, 7], [200, 100]]


def _greedy(llm: LLM, n: int = 12, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_cuda_fp32_matches_transformers(tiny_checkpoints):
    """Logits within fp32 tolerance of transformers on CPU at every step; greedy tokens
    equal wherever transformers' top-2 margin is clear (a different accumulation order on
    the GPU may flip a near-tie: that is not a bug, a wrong logit is)."""
    ckpt = tiny_checkpoints["llama3"]
    llm = LLM(ckpt.path, dtype="float32", device="cuda", max_num_seqs=4,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    assert llm.engine.runner.graphs is not None  # decode replays CUDA graphs
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    for p, out in zip(PROMPTS, outs):
        o = out.outputs[0]
        with torch.inference_mode():
            ref = ckpt.hf_model.generate(torch.tensor([p]), max_new_tokens=12,
                                         min_new_tokens=12, do_sample=False, pad_token_id=0,
                                         output_logits=True, return_dict_in_generate=True)
        want = ref.sequences[0, len(p):].tolist()
        for step, (tok, lps) in enumerate(zip(o.token_ids, o.logprobs)):
            ref_lp = torch.log_softmax(ref.logits[step][0].float(), -1)
            for t, lp in lps.items():
                assert abs(lp - float(ref_lp[t])) < 1e-3, (step, t)
            top2 = ref_lp.topk(2).values
            if float(top2[0] - top2[1]) < 1e-3:
                break  # a near-tie: the two runs may part ways from here
            assert tok == want[step], step
            if tok != want[step]:
                break


def test_cuda_graphs_match_eager(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"].path
    kw = dict(dtype="bfloat16", device="cuda", max_num_seqs=4, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3)
    # Four prompts: a graph bucket's exact size, so both runs do GEMMs of the same M
    # (cuBLAS may pick another kernel for M=3 than for the padded M=4, and a bf16 near-tie
    # would then flip; that is not what this test is about).
    prompts = PROMPTS + [[33, 66, 99, 132, 165]]
    graphs = LLM(path, **kw)
    assert graphs.engine.runner.graphs is not None
    with_graphs = _greedy(graphs, prompts=prompts)
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    eager = LLM(path, enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    assert _greedy(eager, prompts=prompts) == with_graphs


def test_released_graphs_leave_an_engine_that_runs_eagerly(tiny_checkpoints):
    """``release_graphs`` (what a TP rank does before its NCCL group is destroyed): the
    graphs and their pool are gone and decode steps run eagerly, with the same tokens
    (float32: no near-tie flips between a graph's padded batch and the eager one)."""
    llm = LLM(tiny_checkpoints["llama3"].path, dtype="float32", device="cuda",
              max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    runner = llm.engine.runner
    assert runner.graphs is not None
    with_graphs = _greedy(llm)
    runner.release_graphs()
    assert runner.graphs is None
    assert _greedy(llm) == with_graphs


def test_overlapped_scheduling_matches_the_plain_loop(tiny_checkpoints):
    """async_scheduling is on by default on CUDA (with CUDA graphs): placeholder inputs
    resolved on the device, ids copied on a side stream. Tokens equal the plain loop's
    wherever the plain run's top-2 margin is clear (batches differ between the two by
    the rows computed and dropped after a stop, so a near-tie may flip)."""
    path = tiny_checkpoints["llama3"].path
    kw = dict(dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3)
    params = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, logprobs=2,
                             stop_token_ids=[7, 8, 9, 10, 11, 12]),
              SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True)]
    runs = []
    for on in (True, False):
        llm = LLM(path, async_scheduling=on, **kw)
        assert llm.engine.async_scheduling is on
        runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    _assert_same_where_margin_clear(*runs)


def _assert_same_where_margin_clear(outs, ref_outs) -> None:
    """Tokens equal ``ref_outs``' (run with ``logprobs=2``) up to the first step where the
    reference's top-2 margin is under 1e-3 (a near-tie another summation order may flip);
    without such a step, the same length and finish reason too."""
    for out, ref in zip(outs, ref_outs):
        o, r = out.outputs[0], ref.outputs[0]
        for step, (a, b, lps) in enumerate(zip(o.token_ids, r.token_ids, r.logprobs)):
            top2 = sorted(lps.values(), reverse=True)[:2]
            if len(top2) == 2 and top2[0] - top2[1] < 1e-3:
                break
            assert a == b, (out.request_id, step)
        else:
            assert o.finish_reason == r.finish_reason
            assert len(o.token_ids) == len(r.token_ids)


def test_structured_output_keeps_the_overlap(tiny_checkpoints):
    """Constrained requests on CUDA (graphs, ids on the side stream): their steps are
    launched while the step before is in flight and sampled once it landed, and every
    output matches its constraint and ends complete, overlap on and off. (Token equality
    with the plain loop is checked exactly on CPU; here batch shapes differ by the rows
    dropped after a stop, so a near-tie may flip: the unconstrained overlap test above
    handles that with logprob margins.)"""
    import json
    import re

    import jsonschema

    from tests.structured.structured_cases import (
        TINY_PROMPTS,
        TINY_SCHEMA,
        record_overlap,
        tiny_params,
    )

    path = tiny_checkpoints["llama_tied"].path
    kw = dict(dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3)
    runs, events = [], []
    for on in (True, False):
        llm = LLM(path, async_scheduling=on, **kw)
        if on:
            events = record_overlap(llm.engine)
        runs.append(llm.generate(TINY_PROMPTS, tiny_params(), use_tqdm=False))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert sum(1 for in_flight, deferred in events if in_flight == 1 and deferred) > 10
    for outs in runs:
        for c in outs[0].outputs + outs[3].outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), TINY_SCHEMA)
        for c in outs[1].outputs:
            assert c.finish_reason == "stop" and re.fullmatch("[a-e]{12,20}", c.text), c
        assert outs[4].outputs[0].text in ("left", "right")


def test_warm_steps_request_no_new_device_memory(tiny_checkpoints):
    """Once warm, a run of the same workload (overlapped loop, decode graphs) asks the
    CUDA allocator for no new segment: no per-step device allocation grows the pool."""
    llm = LLM(tiny_checkpoints["qwen2"].path, dtype="bfloat16", device="cuda",
              max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    _greedy(llm, 24)  # warm: graphs captured, sampler and copy buffers sized
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["segment.all.allocated"]
    _greedy(llm, 24)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == before


def test_torch_backend_runs_eagerly_on_cuda(tiny_checkpoints):
    """The torch reference ops on a GPU: no decode graphs (they read the host, which
    capture forbids), and the profiling forward keeps its positions inside the RoPE table
    (the batch budget, 8192 tokens, is past this model's length)."""
    ckpt = tiny_checkpoints["qwen3"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = []
    for backend in ("torch", "triton"):
        llm = LLM(ckpt.path, dtype="float32", device="cuda", attention_backend=backend,
                  max_num_seqs=4, enforce_eager=backend == "triton",
                  gpu_memory_utilization=0.3)
        assert llm.engine.runner.graphs is None
        runs.append(llm.generate(PROMPTS, sp, use_tqdm=False))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    _assert_same_where_margin_clear(*runs)  # the two backends sum in other orders


def test_int8_kv_cache_with_graphs_matches_the_torch_backend(tiny_checkpoints):
    """``kv_cache_dtype="int8"`` on the GPU: the Triton store/decode/prefill kernels under
    CUDA graphs, against the torch reference over its own int8 cache (same bytes from
    both stores; fp32 math both ways, summed in other orders)."""
    ckpt = tiny_checkpoints["qwen3"]  # head_dim 32: whole scale groups
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = []
    for backend in ("triton", "torch"):
        llm = LLM(ckpt.path, dtype="float32", device="cuda", attention_backend=backend,
                  kv_cache_dtype="int8", max_num_seqs=4, gpu_memory_utilization=0.3)
        assert llm.engine.runner.kv_cache.dtype == torch.int8
        assert (llm.engine.runner.graphs is not None) == (backend == "triton")
        runs.append(llm.generate(PROMPTS, sp, use_tqdm=False))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    _assert_same_where_margin_clear(*runs)


def test_kv_cache_fits_the_memory_budget(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"].path
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(path, device="cuda", enforce_eager=True, max_num_seqs=256, max_model_len=256,
              gpu_memory_utilization=0.2)
    cache = llm.engine.runner.kv_cache
    assert cache.shape[2] >= 2
    assert cache.numel() * cache.element_size() <= 0.2 * total


def test_too_small_memory_budget_is_named(tiny_checkpoints):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(tiny_checkpoints["qwen2"].path, device="cuda", gpu_memory_utilization=0.0001)


@pytest.mark.slow
def test_largest_batch_at_high_memory_utilization_does_not_run_out(tmp_path):
    """KV sizing counts the sampler's peak at max_num_seqs rows, the per-slot state and
    the decode graphs' pool: a full batch of long prompts with every sampling feature on
    runs at gpu_memory_utilization=0.95 on a 150k-vocabulary model."""
    from deepinfer.testing.random_model import make_random_checkpoint

    path = make_random_checkpoint(str(tmp_path / "qwen3"), "qwen3-0.6b")
    # max_model_len 32768: the blocks 256 such sequences could use (~900 GB) are far more
    # than memory holds, so the cache is sized by memory, which is what this tests.
    llm = LLM(path, device="cuda", max_num_seqs=256, max_model_len=32768,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.95)
    runner = llm.engine.runner
    assert runner.kv_cache.shape[2] < 256 * 32768 // runner.block_size
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05,
                        repetition_penalty=1.1, presence_penalty=0.1, logprobs=5,
                        max_tokens=8, ignore_eos=True)
    prompts = [[(i * 7 + j) % 150000 + 10 for j in range(500)] for i in range(256)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
