"""Tensor parallelism over weights kept as GGUF blocks: real gloo ranks on the CPU, each
loading only its part of every block matrix (rows for q/k/v, gate/up and the vocabulary,
whole blocks of columns for o_proj and down_proj; fused layers whose parts differ in type
and experts too); the leader's logits must equal a one-rank run of the same file."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer.distributed.ranks import RankInfo, destroy_group, init_distributed, spawn_ranks
from deepinfer.loading.loader import load_model
from deepinfer.models.quantized import quantized_layers
from deepinfer.models.tensor_parallel import TPGroup
from deepinfer_kernels import cpu_gguf
from tests.models.paged_sim import PagedSim
from tests.models.quantized_gguf import write_quantized_gguf

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(not cpu_gguf.available(), reason="native CPU kernels not built"),
]

# TP changes only the order of fp32 sums (partial products all-reduced); as for float
# weights (tests/distributed/test_tp_models.py), well under 1e-5 of the largest logit.
RTOL_OF_MAX = 1e-5


def _script(vocab: int) -> list[tuple[bool, dict[int, list[int]]]]:
    g = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    return [(True, {0: toks(9), 1: toks(4)}), (False, {0: toks(1), 1: toks(1)}),
            (False, {0: toks(1), 1: toks(1)})]


def _logits(model, cfg, tp: TPGroup) -> list[torch.Tensor | None]:
    sim = PagedSim(cfg, num_blocks=16, block_size=4, seed=1, tp=tp)
    return [sim.step(model, chunks, is_prompt)
            for is_prompt, chunks in _script(cfg.vocab_size)]


def _rank(info: RankInfo, paths: list[str], out_file: str) -> int:
    torch.set_num_threads(1)  # the ranks share 2 cores
    init_distributed(info, "cpu", timeout_s=120)
    try:
        tp = TPGroup(info.rank, info.world_size, dist.group.WORLD)
        result = []
        for path in paths:
            model, cfg = load_model(path, dtype="float32", device="cpu", tp=tp)
            layers = {name.split("#")[0] for name in quantized_layers(model)}  # parts: one
            assert len(layers) == 1 + 4 * cfg.num_layers + (model.lm_head is not None)
            result.append(_logits(model, cfg, tp))
        if tp.leader:
            torch.save(result, out_file)
        return len(result)
    finally:
        destroy_group()


def test_two_ranks_over_block_matrices_match_one_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    paths = [write_quantized_gguf(str(tmp_path / "q8_tied.gguf"), "Q8_0"),
             write_quantized_gguf(str(tmp_path / "q41_untied.gguf"), "Q4_1", tied=False),
             write_quantized_gguf(str(tmp_path / "mixed.gguf"), "Q4_0",
                                  types={"attn_v": "Q8_0", "ffn_up": "Q6_K"})]
    out_file = str(tmp_path / "rank0.pt")
    assert spawn_ranks(_rank, 2, (paths, out_file)) == len(paths)
    got = torch.load(out_file)
    for path, ranks in zip(paths, got, strict=True):
        model, cfg = load_model(path, dtype="float32", device="cpu")
        want = _logits(model, cfg, TPGroup())
        for g, w in zip(ranks, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=RTOL_OF_MAX * w.abs().max().item())


def _tiny_moe_gguf(path: str, moe_intermediate: int) -> str:
    """A 2-layer Qwen3-MoE GGUF whose experts are Q8_0 blocks (the rest F32)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tests.models.tiny_gguf import write_tiny_gguf

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         vocab_size=300, max_position_embeddings=256, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=moe_intermediate,
                         norm_topk_prob=True, initializer_range=0.1, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    write_tiny_gguf(AutoModelForCausalLM.from_config(cfg), "qwen3moe", path,
                    expert_type="Q8_0")
    return path


def _moe_rank(info: RankInfo, path: str, out_file: str) -> int:
    torch.set_num_threads(1)
    init_distributed(info, "cpu", timeout_s=120)
    try:
        tp = TPGroup(info.rank, info.world_size, dist.group.WORLD)
        model, cfg = load_model(path, dtype="float32", device="cpu", tp=tp)
        stacks = [k for k in quantized_layers(model) if k.endswith((".w13", ".w2"))]
        assert len(stacks) == 2 * cfg.num_layers
        logits = _logits(model, cfg, tp)
        if tp.leader:
            torch.save(logits, out_file)
        return len(stacks)
    finally:
        destroy_group()


def test_two_ranks_over_quantized_experts_match_one_rank(tmp_path, monkeypatch):
    """Experts kept as blocks, split over 2 ranks: gate/up rows and whole Q8_0 blocks of
    the down projections' columns (moe_intermediate_size 64: 32 a rank)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = _tiny_moe_gguf(str(tmp_path / "moe_q8.gguf"), 64)
    out_file = str(tmp_path / "rank0.pt")
    assert spawn_ranks(_moe_rank, 2, (path, out_file)) == 4
    model, cfg = load_model(path, dtype="float32", device="cpu")
    want = _logits(model, cfg, TPGroup())
    for g, w in zip(torch.load(out_file), want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=RTOL_OF_MAX * w.abs().max().item())


def test_a_split_through_an_expert_block_is_refused(tmp_path):
    """moe_intermediate_size 32 over 2 ranks: 16 columns of each down projection, half a
    Q8_0 block: refused naming the tensor (no collective runs before it)."""
    path = _tiny_moe_gguf(str(tmp_path / "moe_q8_32.gguf"), 32)
    with pytest.raises(ValueError, match=r"experts\.\d+\.down_proj\.weight.*Q8_0 block"):
        load_model(path, dtype="float32", device="cpu", tp=TPGroup(0, 2, None))
