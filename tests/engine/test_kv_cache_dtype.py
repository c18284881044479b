"""``kv_cache_dtype="int8"`` end to end on the default model (the C store and attention
kernels, the fused decode step): the same text scores and greedy outputs as the float
cache within what int8 rounding explains, about twice the tokens in the same memory, and
clear errors for what it does not take."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kv_cache_spec import kv_block_bytes

# Plain prose written for this test (a file of the project would change under it).
PASSAGES = (
    "The river town woke slowly on market days. Before the sun cleared the hills, the "
    "bakers had already pulled the first loaves from their ovens, and the smell of warm "
    "bread drifted down the narrow streets toward the docks. Fishermen unloaded crates of "
    "silver herring while their children argued over who would carry the lightest basket. "
    "By seven o'clock the square was crowded with farmers selling apples, cheese, honey "
    "and wool, and the old clock above the town hall struck the hour a little late, as it "
    "had for as long as anyone could remember. Nobody minded; the town had never been in "
    "a hurry, and visitors often said that was the best thing about it. In the afternoon "
    "the wind changed, clouds gathered over the western ridge, and the traders began to "
    "pack their stalls before the first drops of rain reached the cobblestones.",
    "A computer stores recently used data in small, fast memories called caches. When a "
    "program reads a value, the processor first checks the nearest cache; if the value is "
    "there, the read takes only a few cycles. If it is not, the request travels to a "
    "larger and slower cache, and finally to main memory, which can take hundreds of "
    "cycles. Programs that touch memory in predictable patterns, such as walking through "
    "an array from start to end, make good use of caches because the hardware fetches "
    "neighbouring data before it is needed. Programs that jump around randomly, on the "
    "other hand, spend much of their time waiting. For this reason, engineers often "
    "rearrange data so that values used together are stored together, and they measure "
    "carefully before and after each change to be sure that it really helped.",
    "Learning to cook begins with a few simple habits. Read the whole recipe before you "
    "start, and set out every ingredient so that nothing is forgotten halfway through. "
    "Keep your knives sharp, because a dull blade slips and is more dangerous than a "
    "sharp one. Taste as you go and adjust the salt a little at a time, since it is easy "
    "to add more and impossible to take it away. Let meat rest after cooking so that its "
    "juices settle, and give vegetables enough room in the pan so that they brown instead "
    "of steaming. Above all, cook the same dish several times: each attempt teaches "
    "something new, and after a while the recipe becomes your own.",
)
MEMORY = 48 << 20


def _logprob(entry) -> float:
    return float(getattr(entry, "logprob", entry))


@pytest.fixture(scope="module")
def pair(smollm2_path):
    """The default model in float32 with a float cache and with an int8 one."""
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=MEMORY, max_num_seqs=8)
    return LLM(smollm2_path, **kw), LLM(smollm2_path, kv_cache_dtype="int8", **kw)


def test_int8_cache_scores_text_as_the_float_cache(pair):
    """Each prompt token's log-probability, read through K/V rounded to int8 (a scale per
    32 values): measured on these passages (460 tokens) a mean |difference| of 0.018
    nats (at most 0.17) and mean NLLs of 3.5056 and 3.5068 (0.03% apart); a wrong scale
    or a K/V row read from the wrong slot moves them by whole nats."""
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    runs = []
    for llm in pair:
        ids = [llm.tokenizer.encode(t) for t in PASSAGES]
        outs = llm.generate(ids, score, use_tqdm=False)
        runs.append([_logprob(o.prompt_logprobs[i][p[i]]) for o, p in zip(outs, ids)
                     for i in range(1, len(p))])
    exact, int8 = runs
    diffs = [abs(a - b) for a, b in zip(exact, int8)]
    assert len(diffs) > 400
    assert sum(diffs) / len(diffs) < 0.05
    nll_exact, nll_int8 = -sum(exact) / len(exact), -sum(int8) / len(int8)
    assert abs(nll_int8 - nll_exact) < 0.005 * nll_exact


def test_int8_cache_decodes_greedily_as_the_float_cache(pair):
    """Greedy chat outputs agree token for token; where they part, the float cache's top
    two tokens were within 0.2 nats (a near tie int8 rounding may tip: measured 0.01 and
    0.07 nats at the two places these prompts part, against log-probabilities moved by
    ~0.005 nats on average)."""
    chats = [[{"role": "user", "content": c}] for c in
             ("What is the capital of France?", "Write a haiku about autumn leaves.",
              "List three primary colors.", "Explain photosynthesis in two sentences.",
              "Tell me a joke about cats.")]
    exact, int8 = (llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=40,
                                                  logprobs=2), use_tqdm=False)
                   for llm in pair)
    agreed = 0
    for a, b in zip(exact, int8):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        i = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if i is None:
            assert len(ta) == len(tb)
            agreed += len(ta)
            continue
        top = sorted((_logprob(v) for v in a.outputs[0].logprobs[i].values()), reverse=True)
        assert top[0] - top[1] < 0.2, f"parted at token {i} where the margin was clear"
        agreed += i
    assert agreed >= 80


def test_int8_cache_holds_more_tokens_in_the_same_memory(pair):
    exact, int8 = pair
    cfg = exact.engine.runner.cfg
    assert int8.engine.runner.kv_cache.dtype.is_floating_point is False
    assert int8.engine.runner.kv_cache.shape[-1] == cfg.head_dim * 9 // 8
    for llm, kv in ((exact, "auto"), (int8, "int8")):
        runner = llm.engine.runner
        per_block = kv_block_bytes(cfg, runner.block_size, runner.dtype, kv_cache_dtype=kv)
        assert runner.num_blocks == MEMORY // per_block
        assert runner.kv_cache.numel() * runner.kv_cache.element_size() == (
            runner.num_blocks * per_block)
    # float32 rows of 64 values (256 bytes) against 72 bytes
    assert int8.engine.runner.num_blocks >= 3.5 * exact.engine.runner.num_blocks


def test_unknown_kv_cache_dtype_is_named(smollm2_path):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*auto, int8"):
        LLM(smollm2_path, device="cpu", kv_cache_dtype="fp8")


def test_triton_backend_reads_an_int8_cache_as_the_torch_backend(tiny_checkpoints):
    """The Triton store, decode and prefill kernels (interpreted here) on an int8 cache:
    prompt scores and greedy tokens as the torch backend's over the same int8 cache (the
    same codes and scales; both dequantize to float32 before the products)."""
    ckpt = tiny_checkpoints["qwen3"]  # head_dim 32: one scale a row
    kw = dict(dtype="float32", device="cpu", kv_cache_dtype="int8", kv_cache_memory=4 << 20,
              max_num_batched_tokens=16, max_num_seqs=2, block_size=8)
    runs = []
    for backend in ("triton", "torch"):
        llm = LLM(ckpt.path, attention_backend=backend, **kw)
        assert llm.engine.runner.kv_cache.dtype == torch.int8
        outs = llm.generate([list(range(3, 24)), [9, 8, 7]],
                            SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0,
                                           ignore_eos=True), use_tqdm=False)
        runs.append([(o.outputs[0].token_ids,
                      [_logprob(next(iter(e.values()))) for e in o.prompt_logprobs[1:]])
                     for o in outs])
    for (tokens_t, scores_t), (tokens_r, scores_r) in zip(*runs):
        assert tokens_t == tokens_r
        assert scores_t == pytest.approx(scores_r, abs=1e-4)


def test_int8_cache_needs_head_dims_of_whole_scale_groups(tiny_checkpoints):
    ckpt = tiny_checkpoints["llama_tied"]  # head_dim 16: less than one group of 32
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'.*multiple of 32.*16"):
        LLM(ckpt.path, dtype="float32", device="cpu", kv_cache_dtype="int8",
            kv_cache_memory=4 << 20)
