"""Phi-3 (``Phi3ForCausalLM``: Phi-3-mini, Phi-3.5-mini, Phi-4-mini) against
transformers on tiny random checkpoints: fused ``qkv_proj`` / ``gate_up_proj`` tensors
split at load, LongRoPE (short factors below ``original_max_position_embeddings``, long
ones from there), a partial rotary (q/k rows reordered at load, the pairs past the rotary
width left alone by the cos/sin cache), the sliding window past its length; and what a
bad config gets."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import ModelConfig
from deepinfer.loading.checkpoint_parts import rotary_row_order
from deepinfer.loading.loader import load_model
from deepinfer.models.layers import RotaryEmbedding
from tests.checkpoints import assert_greedy_matches_hf
from tests.models.hf_checkpoints import assert_prompt_logits_match
from tests.models.paged_sim import PagedSim, prefill_then_decode
from tests.models.test_models import hf_logits

HEAD_DIM = 16
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
ORIG = 32  # original_max_position_embeddings of the LongRoPE checkpoints


def _longrope(rot: int, g: torch.Generator) -> dict:
    pairs = rot // 2
    return {"rope_type": "longrope",
            "short_factor": (1 + torch.rand(pairs, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(pairs, generator=g)).tolist()}


def _phi3_config(variant: str):
    from transformers import Phi3Config

    g = torch.Generator().manual_seed(hash(variant) % 1000)
    kw: dict = dict(SHAPE, max_position_embeddings=256, rms_norm_eps=1e-5,
                    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if variant == "longrope":  # Phi-3.5-mini: LongRoPE, whole heads rotated
        kw.update(original_max_position_embeddings=ORIG, rope_scaling=_longrope(HEAD_DIM, g))
    elif variant == "partial":  # Phi-4-mini: LongRoPE on 3/4 of each head, tied embeddings
        kw.update(original_max_position_embeddings=ORIG, partial_rotary_factor=0.75,
                  tie_word_embeddings=True, rope_scaling=_longrope(12, g))
    elif variant == "window":  # Phi-3-mini-4k: a sliding window, no RoPE scaling
        kw.update(sliding_window=47)
    return Phi3Config(**kw)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """variant -> (path, HF model): Phi3 checkpoints saved by transformers."""
    from transformers import AutoModelForCausalLM

    from deepinfer.testing.random_model import build_bpe_tokenizer

    out = {}
    for i, variant in enumerate(("longrope", "partial", "window")):
        torch.manual_seed(300 + i)
        hf = AutoModelForCausalLM.from_config(_phi3_config(variant),
                                              dtype=torch.float32).eval()
        path = tmp_path_factory.mktemp(f"phi3-{variant}")
        hf.save_pretrained(str(path), safe_serialization=True)
        build_bpe_tokenizer().save_pretrained(str(path))
        out[variant] = (str(path), hf)
    return out


def test_checkpoint_stores_fused_projections(phi3):
    from safetensors import safe_open

    path, _ = phi3["partial"]
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


@pytest.mark.parametrize("variant", ["longrope", "partial", "window"])
def test_prefill_then_decode_matches_transformers(phi3, variant):
    """Prompts and decode steps that stay below the LongRoPE switch (31 positions), where
    transformers uses the short factors throughout, as the cache rows do."""
    path, hf = phi3[variant]
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert cfg.architecture == "Phi3ForCausalLM"
    g = torch.Generator().manual_seed(7)
    seqs = {0: torch.randint(3, cfg.vocab_size, (ORIG - 1,), generator=g).tolist(),
            1: torch.randint(3, cfg.vocab_size, (12,), generator=g).tolist()}
    ours = prefill_then_decode(model, cfg, seqs, {0: ORIG - 5, 1: 8})
    for s in seqs:
        got = ours[s]
        want = hf_logits(hf, seqs[s][: got.shape[0]])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert want.abs().max() > 0.05


@pytest.mark.parametrize("variant", ["longrope", "partial"])
def test_cache_rows_past_the_switch_use_the_long_factors(phi3, variant):
    """From ``original_max_position_embeddings`` on, each position's cos/sin row is
    transformers' long-factor one (what it uses for a forward that long), scaled by the
    LongRoPE attention factor; below, its short-factor one."""
    path, hf = phi3[variant]
    _, cfg = load_model(path, dtype="float32", device="cpu")
    rot = cfg.rotary_dim
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling,
                           rotary_dim=rot)
    rotary = hf.model.rotary_emb
    for length in (ORIG - 1, ORIG + 40):  # short factors, then long ones for all rows
        pos = torch.arange(length)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        rows = torch.arange(ORIG if length > ORIG else 0, length)
        half = cfg.head_dim // 2
        got = rope.cos_sin_cache[rows]
        torch.testing.assert_close(got[:, :rot // 2], cos[0, rows, :rot // 2], atol=1e-6,
                                   rtol=0)
        torch.testing.assert_close(got[:, half:half + rot // 2], sin[0, rows, :rot // 2],
                                   atol=1e-6, rtol=0)
    # the pairs past the rotary width: exactly cos 1, sin 0
    if rot < cfg.head_dim:
        assert torch.equal(rope.cos_sin_cache[:, rot // 2:half],
                           torch.ones(cfg.max_positions, half - rot // 2))
        assert torch.equal(rope.cos_sin_cache[:, half + rot // 2:],
                           torch.zeros(cfg.max_positions, half - rot // 2))
    assert cfg.rope_scaling["factor"] == 256 / ORIG  # sizes the attention factor


def test_rotary_row_order_pairs_what_transformers_pairs():
    order = rotary_row_order(16, 12)
    assert sorted(order.tolist()) == list(range(16))
    # rotated pair (i, i + 6) of transformers lands at (k, k + 8); passed values after
    for i in range(6):
        assert order[i] == i and order[i + 8] == i + 6
    assert set(order[6:8].tolist()) | set(order[14:].tolist()) == {12, 13, 14, 15}
    assert torch.equal(rotary_row_order(16, 16), torch.arange(16).view(2, 8).reshape(-1))


def test_engine_greedy_tokens_partial_rotary_and_sliding_window(phi3):
    """The engine (the CPU kernels; float32, where bfloat16 would round) gives
    transformers' greedy tokens on the partial-rotary model, and on the sliding-window
    model (window 47) past its window: prompts of 30-40 tokens, 40 more generated, with a
    prefill chunked at 16 tokens."""
    path, hf = phi3["partial"]
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory=4 << 20,
              block_size=8)
    # 12 tokens end at position 19 < ORIG: transformers keeps the short factors
    assert_greedy_matches_hf(llm, hf, [[5, 17, 42, 99, 3, 8, 250, 12], [9, 8, 7]], 12)
    window, hf = phi3["window"]
    llm = LLM(window, dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=8,
              max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 256  # max_position_embeddings, not the window
    g = torch.Generator().manual_seed(47)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (30, 40)]
    assert_greedy_matches_hf(llm, hf, prompts, 40)


BASE = {"architectures": ["Phi3ForCausalLM"], **SHAPE}


def test_config_reading_as_phi3config():
    """Old LongRoPE names (``su``, ``yarn``), the top-level
    ``original_max_position_embeddings``, the partial rotary factor at either level."""
    pairs = HEAD_DIM // 2
    su = {"type": "su", "short_factor": [1.0] * pairs, "long_factor": [2.0] * pairs}
    cfg = ModelConfig.from_hf_config({**BASE, "rope_scaling": su,
                                      "max_position_embeddings": 131072,
                                      "original_max_position_embeddings": 4096})
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.rope_scaling["factor"] == 32
    assert cfg.rotary_dim == HEAD_DIM and cfg.sliding_window is None
    six = {**su, "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
           "partial_rotary_factor": 0.75}
    assert ModelConfig.from_hf_config({**BASE, "rope_scaling": six}).rotary_dim == 12
    assert ModelConfig.from_hf_config({**BASE, "partial_rotary_factor": 0.5}).rotary_dim == 8


@pytest.mark.parametrize("change, message", [
    ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor=0.0 must be a number in \(0, 1\]"),
    ({"partial_rotary_factor": 0.05}, r"rotates 0 of head_dim 16"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3,
                       "long_factor": [1.0] * 8}},
     r"short_factor must list 8 positive numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}},
     r"long_factor must list 8 positive numbers"),
])
def test_bad_rotary_config_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**BASE, **change})


def _tp_rank(info, path: str, chunks: dict[int, list[int]], out_file: str) -> int:
    """One spawned tensor-parallel rank: load its shard, run one prefill; rank 0 saves
    the logits."""
    import torch.distributed as dist

    from deepinfer.distributed.ranks import destroy_group, init_distributed
    from deepinfer.models.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    init_distributed(info, "cpu", timeout_s=120)
    try:
        tp = TPGroup(info.rank, info.world_size, dist.group.WORLD)
        model, cfg = load_model(path, dtype="float32", device="cpu", tp=tp)
        logits = PagedSim(cfg, tp=tp).step(model, chunks, is_prompt=True)
        if tp.leader:
            torch.save(logits, out_file)
        return 1
    finally:
        destroy_group()


def test_tensor_parallel_splits_the_fused_tensors_per_rank(phi3, tmp_path, monkeypatch):
    """tp=2 (gloo ranks): each rank cuts its heads and its MLP share out of the fused
    qkv_proj / gate_up_proj parts; the logits are the one-rank ones."""
    import torch.distributed as dist

    from deepinfer.distributed.ranks import spawn_ranks

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path, _ = phi3["partial"]
    chunks = {0: [5, 17, 42, 99, 3, 8, 250, 12, 77], 1: [9, 8, 7, 6]}
    model, cfg = load_model(path, dtype="float32", device="cpu")
    want = PagedSim(cfg).step(model, chunks, is_prompt=True)
    out_file = str(tmp_path / "rank0.pt")
    assert spawn_ranks(_tp_rank, 2, (path, chunks, out_file)) == 1
    torch.testing.assert_close(torch.load(out_file), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("linear_type", [None, "Q8_0"], ids=["f32", "q8_0-kept"])
def test_gguf_file_matches_transformers(phi3, tmp_path, linear_type):
    """A Phi-3 GGUF as llama.cpp's converter writes it (``attn_qkv``, gate and up in one
    ``ffn_up``, ``rope_factors_long/short``, ``rope.dimension_count``, no q/k
    permutation): its config, and its logits. Q8_0 projections stay blocks (the fused
    tensors' rows split as blocks) and land near the float ones."""
    from deepinfer.models.parallel_layers import Linear
    from tests.models.tiny_gguf import write_tiny_gguf

    folder, hf = phi3["partial"]
    path = str(tmp_path / "phi3.gguf")
    write_tiny_gguf(hf, "phi3", path, linear_type=linear_type)
    model, cfg = load_model(path, dtype="float32", device="cpu")
    want_cfg = ModelConfig.from_hf_folder(folder)
    assert (cfg.architecture, cfg.rotary_dim, cfg.rope_scaling["rope_type"]) == (
        "Phi3ForCausalLM", 12, "longrope")
    for key in ("short_factor", "long_factor"):
        assert cfg.rope_scaling[key] == pytest.approx(want_cfg.rope_scaling[key])
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIG
    tokens = torch.randint(3, cfg.vocab_size, (ORIG - 2,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Linear) and (qkv.qtype is not None) == (linear_type is not None)
    # int8 weights: near, and the same argmax where it is clear
    assert_prompt_logits_match(model, cfg, hf, tokens, quantized=linear_type is not None,
                               clear_argmax=True)
