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


def _greedy(llm: LLM, n: int = 12) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_cuda_fp32_matches_transformers(tiny_checkpoints):
    ckpt = tiny_checkpoints["llama3"]
    llm = LLM(ckpt.path, dtype="float32", device="cuda", max_num_seqs=4,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    assert llm.engine.runner.graphs is not None  # decode replays CUDA graphs
    got = _greedy(llm)
    for p, toks in zip(PROMPTS, got):
        with torch.inference_mode():
            want = ckpt.hf_model.generate(torch.tensor([p]), max_new_tokens=12,
                                          min_new_tokens=12, do_sample=False,
                                          pad_token_id=0)[0, len(p):].tolist()
        assert toks == want


def test_cuda_graphs_match_eager(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"].path
    kw = dict(dtype="bfloat16", device="cuda", max_num_seqs=4, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3)
    graphs = LLM(path, **kw)
    assert graphs.engine.runner.graphs is not None
    with_graphs = _greedy(graphs)
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    eager = LLM(path, enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    assert _greedy(eager) == with_graphs


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
