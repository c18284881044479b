"""Tensor parallelism on the tiny checkpoints: real gloo ranks on the CPU, real weights.

Every rank loads only its shard and runs the same paged-cache script (packed prefill,
teacher-forced decode, a prefill on top of a cached prefix, more decode); the leader's
full-vocabulary logits and every rank's KV cache must equal a one-rank run. Shard loading
is checked against the HF model's weights, and the size checks against their messages.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from deepinfer.config import ModelConfig
from deepinfer.distributed.ranks import RankInfo, destroy_group, init_distributed, spawn_ranks
from deepinfer.loading.loader import load_model
from deepinfer.loading.safetensors_files import iter_safetensors, safetensors_files
from deepinfer.models.tensor_parallel import TPGroup, check_tp_size
from tests.models.paged_sim import PagedSim

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

# qkv bias + tied embeddings (qwen2), q/k norm with head_dim 32 != hidden / heads
# (qwen3), untied LM head with llama3 RoPE scaling (llama3).
MODELS = ("llama3", "qwen2", "qwen3")
BLOCK_SIZE = 4
NUM_BLOCKS = 16
# The tiny checkpoints: 4 query heads in GQA groups of 2 over 2 KV heads.
HEADS, GROUP = 4, 2

# fp32 tolerance. TP changes only the summation order: o_proj, down_proj and the
# embedding add tp partial results (each over a 1/tp slice) instead of one dot product,
# and everything downstream inherits that rounding. Measured worst case over these
# checkpoints, steps and tp in {2, 4}: 2e-6 absolute on logits up to ~3.2, the same on the
# KV caches (~16 ulps). 1e-5 absolute, no relative term, leaves 5x headroom and is 10x
# tighter than the 1e-4 the model itself is held to against transformers; a skipped
# all-reduce or a wrong KV head moves logits by O(0.1..1).
ATOL, RTOL = 1e-5, 0.0
ARGMAX_MARGIN = 1e-3


# ---------------------------------------------------------------------------- the script
def _script(vocab: int, seed: int = 0) -> list[tuple[bool, dict[int, list[int]]]]:
    """``(is_prompt, {seq_id: new tokens})`` per step: prefill of two prompts of different
    lengths, three decode steps, a prefill continuing seq 0 after its cached prefix
    together with a new seq 2, two decode steps over all three."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    steps = [(True, {0: toks(9), 1: toks(5)})]
    steps += [(False, {0: toks(1), 1: toks(1)}) for _ in range(3)]
    steps.append((True, {0: toks(3), 2: toks(6)}))
    steps += [(False, {0: toks(1), 1: toks(1), 2: toks(1)}) for _ in range(2)]
    return steps


def _run_script(model, cfg: ModelConfig, tp: TPGroup,
                script) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Run ``script`` through a paged cache of this rank's KV heads; blocks come from a
    fixed shuffled free list (the same on every rank), so logical != physical order.
    Returns the logits of every step (all rows; None off the leader) and the cache."""
    sim = PagedSim(cfg, NUM_BLOCKS, BLOCK_SIZE, seed=1, tp=tp)
    out = [sim.step(model, chunks, is_prompt) for is_prompt, chunks in script]
    return out, sim.cache


def _tp_rank(info: RankInfo, paths: dict[str, str], script, out_file: str) -> int:
    """One spawned TP rank: every model in turn, on this rank's shard. Rank 0 saves
    ``{name: (logits per step, every rank's cache)}`` to ``out_file`` and returns how
    many models it ran (the tensors go through a file: torch.load keeps their dtypes)."""
    torch.set_num_threads(1)  # tp ranks share 2 cores
    init_distributed(info, "cpu", timeout_s=120)
    try:
        tp = TPGroup(info.rank, info.world_size, dist.group.WORLD)
        result = {}
        for name, path in paths.items():
            model, cfg = load_model(path, dtype="float32", device="cpu", tp=tp)
            logits, cache = _run_script(model, cfg, tp, script)
            if tp.leader:
                assert all(x is not None for x in logits)
                caches = [torch.empty_like(cache) for _ in range(tp.size)]
            else:  # only the leader gets the gathered vocabulary
                assert all(x is None for x in logits), "a follower computed logits"
                caches = None
            dist.gather(cache, caches, dst=0)
            if tp.leader:
                result[name] = (logits, caches)
        if tp.leader:
            torch.save(result, out_file)
        return len(result)
    finally:
        destroy_group()


@pytest.fixture(scope="module")
def script(tiny_checkpoints):
    return _script(ModelConfig.from_hf_folder(tiny_checkpoints["llama3"].path).vocab_size)


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoints, script):
    """The tp=1 run of the script in this process (no process group)."""
    out = {}
    for name in MODELS:
        model, cfg = load_model(tiny_checkpoints[name].path, dtype="float32", device="cpu")
        out[name] = _run_script(model, cfg, TPGroup(), script)
    return out


def _kv_heads(tp: int, rank: int) -> list[int]:
    """The KV heads rank ``rank`` of ``tp`` must hold: those its query heads read."""
    q_per_rank = HEADS // tp
    return sorted({h // GROUP for h in range(rank * q_per_rank, (rank + 1) * q_per_rank)})


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_and_cache_match_one_rank(tp, tiny_checkpoints, script, single_rank,
                                            monkeypatch, tmp_path):
    """tp=4 replicates KV heads (2 over 4 ranks); tp=2 splits them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    paths = {name: tiny_checkpoints[name].path for name in MODELS}
    out_file = str(tmp_path / "rank0.pt")
    assert spawn_ranks(_tp_rank, tp, (paths, script, out_file)) == len(MODELS)
    result = torch.load(out_file)
    assert set(result) == set(MODELS)
    for name in MODELS:
        want_logits, want_cache = single_rank[name]
        got_logits, caches = result[name]
        assert len(got_logits) == len(script)
        for step, (got, want) in enumerate(zip(got_logits, want_logits)):
            assert got.shape == want.shape == (sum(map(len, script[step][1].values())), 300)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
            assert want.abs().max() > 0.05  # non-trivial logits
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > ARGMAX_MARGIN
            assert clear.any()
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), (name, step)
        # Each rank's cache is the one-rank cache restricted to the KV heads its query
        # heads read (catches a rank that loaded, or wrote, the wrong KV head).
        assert len(caches) == tp
        for rank, cache in enumerate(caches):
            heads = _kv_heads(tp, rank)
            want = want_cache[:, :, :, :, heads]
            torch.testing.assert_close(cache, want, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}")
            assert want.abs().max() > 0.05


# ---------------------------------------------------------------------------- loading
def _expected_shard(hf_model, cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Our parameter name -> the slice of the HF weights rank ``rank`` of ``tp`` holds,
    written out from the Megatron split (not from ``shard_slice``)."""
    sd = hf_model.state_dict()
    d, inter, vocab = cfg.head_dim, cfg.intermediate_size // tp, cfg.vocab_size // tp
    q_heads = list(range(rank * HEADS // tp, (rank + 1) * HEADS // tp))
    kv_heads = _kv_heads(tp, rank)

    def heads(t: torch.Tensor, which: list[int], dim: int = 0) -> torch.Tensor:
        return torch.cat([t.narrow(dim, h * d, d) for h in which], dim=dim)

    out = {}
    for name, t in sd.items():
        if "rotary_emb" in name:
            continue
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            prefix, kind = name.split(".q_proj.")
            k, v = sd[f"{prefix}.k_proj.{kind}"], sd[f"{prefix}.v_proj.{kind}"]
            out[f"{prefix}.qkv_proj.{kind}"] = torch.cat(
                [heads(t, q_heads), heads(k, kv_heads), heads(v, kv_heads)])
        elif name.endswith("o_proj.weight"):
            out[name] = heads(t, q_heads, dim=1)
        elif name.endswith("gate_proj.weight"):
            prefix = name.removesuffix(".gate_proj.weight")
            up = sd[f"{prefix}.up_proj.weight"]
            out[f"{prefix}.gate_up_proj.weight"] = torch.cat(
                [t[rank * inter:(rank + 1) * inter], up[rank * inter:(rank + 1) * inter]])
        elif name.endswith("down_proj.weight"):
            out[name] = t[:, rank * inter:(rank + 1) * inter]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[name] = t[rank * vocab:(rank + 1) * vocab]
        elif any(p in name for p in ("k_proj.", "v_proj.", "up_proj.")):
            continue  # fused above
        else:  # norms (incl. qwen3's per-head q/k norm): whole on every rank
            out[name] = t
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_shard_loading_takes_each_ranks_slice(name, tp, tiny_checkpoints):
    """Every rank of tp=2 and tp=4 (KV heads replicated: ranks 0,1 hold head 0 and 2,3
    head 1, i.e. r // 2, not r % 2), loaded in this process with no group behind the
    TPGroup: building and loading a shard must run no collective."""
    ck = tiny_checkpoints[name]
    cfg = ModelConfig.from_hf_folder(ck.path)
    for rank in range(tp):
        model, _ = load_model(ck.path, dtype="float32", device="cpu",
                              tp=TPGroup(rank, tp, None))
        got = dict(model.named_parameters())
        want = _expected_shard(ck.hf_model, cfg, tp, rank)
        assert set(got) == set(want)
        # Spelled-out shapes of the split dimensions (hidden 64, 4 heads, 2 KV heads).
        layer = "model.layers.0"
        hq, hkv = HEADS // tp, len(_kv_heads(tp, rank))
        assert got[f"{layer}.self_attn.qkv_proj.weight"].shape == (
            (hq + 2 * hkv) * cfg.head_dim, 64)
        assert got[f"{layer}.self_attn.o_proj.weight"].shape == (64, hq * cfg.head_dim)
        assert got[f"{layer}.mlp.gate_up_proj.weight"].shape == (2 * 128 // tp, 64)
        assert got[f"{layer}.mlp.down_proj.weight"].shape == (64, 128 // tp)
        assert got["model.embed_tokens.weight"].shape == (300 // tp, 64)
        for key, w in want.items():
            assert torch.equal(got[key], w), f"{name} tp={tp} rank {rank}: {key}"


def test_iter_safetensors_reads_the_slice(tiny_checkpoints):
    """The shard function's cut (along dim 0 or 1) is what comes out, named as stored."""
    ck = tiny_checkpoints["qwen3"]
    sd = ck.hf_model.state_dict()
    cuts = {"model.layers.1.self_attn.o_proj.weight": (1, 32, 64),
            "model.layers.0.mlp.up_proj.weight": (0, 96, 32)}
    seen = set()
    for name, t in iter_safetensors(safetensors_files(ck.path), cuts.get):
        if name in cuts:
            dim, start, length = cuts[name]
            assert torch.equal(t, sd[name].narrow(dim, start, length))
            seen.add(name)
        else:
            assert torch.equal(t, sd[name])
    assert seen == set(cuts)


# ---------------------------------------------------------------------------- sizes
@pytest.fixture(scope="module")
def tiny_cfg(tiny_checkpoints) -> ModelConfig:
    return ModelConfig.from_hf_folder(tiny_checkpoints["llama3"].path)


def test_sizes_that_split(tiny_cfg):
    for tp in (1, 2, 4):
        check_tp_size(tiny_cfg, tp)


def test_tp3_names_heads_and_lists_working_sizes(tiny_cfg):
    with pytest.raises(ValueError) as e:
        check_tp_size(tiny_cfg, 3)
    msg = str(e.value)
    assert "tensor_parallel_size=3" in msg
    assert "num_attention_heads=4" in msg
    assert "intermediate_size=128" in msg and "vocab_size=300" not in msg  # 300 % 3 == 0
    assert msg.endswith("Sizes that work: 1, 2, 4")


def test_more_ranks_than_heads(tiny_cfg):
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by 8"
                                         r".*Sizes that work: 1, 2, 4$"):
        check_tp_size(tiny_cfg, 8)


def test_odd_vocab_and_intermediate(tiny_cfg):
    odd = dataclasses.replace(tiny_cfg, vocab_size=301)
    with pytest.raises(ValueError, match=r"vocab_size=301 is not divisible by 2"
                                         r".*Sizes that work: 1$"):
        check_tp_size(odd, 2)
    check_tp_size(odd, 1)
    narrow = dataclasses.replace(tiny_cfg, intermediate_size=130)
    with pytest.raises(ValueError, match=r"intermediate_size=130 .*Sizes that work: 1, 2$"):
        check_tp_size(narrow, 4)


def test_kv_heads_not_replicable(tiny_cfg):
    """6 query heads over 2 KV heads at tp=3: each rank would need 2/3 of a KV head."""
    cfg = dataclasses.replace(tiny_cfg, num_heads=6, intermediate_size=192)
    with pytest.raises(ValueError, match=r"3 ranks cannot share num_key_value_heads=2"):
        check_tp_size(cfg, 3)
    check_tp_size(cfg, 2)
    check_tp_size(cfg, 6)  # 3 ranks per replicated KV head


def test_moe_expert_width(tiny_cfg):
    """An MoE config also splits its experts' intermediate size."""
    moe = dataclasses.replace(tiny_cfg, architecture="Qwen3MoeForCausalLM", num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=30 is not divisible by 4"
                                         r".*Sizes that work: 1, 2$"):
        check_tp_size(moe, 4)
    check_tp_size(moe, 2)
    # intermediate_size only sizes dense MLPs: with every layer sparse it need not split.
    sparse = dataclasses.replace(moe, intermediate_size=97, moe_intermediate_size=32)
    check_tp_size(sparse, 2)
    one_dense = dataclasses.replace(sparse, mlp_only_layers=(0,))
    with pytest.raises(ValueError, match=r"intermediate_size=97 is not divisible by 2"):
        check_tp_size(one_dense, 2)


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2"])
def test_not_a_positive_int(tiny_cfg, bad):
    with pytest.raises(ValueError, match="expected a positive integer"):
        check_tp_size(tiny_cfg, bad)


def test_load_model_rejects_bad_size_before_building(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        load_model(tiny_checkpoints["qwen2"].path, dtype="float32",
                   tp=TPGroup(0, 3, None))

