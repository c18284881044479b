"""Tensor-parallel loading of checkpoints beyond the tiny defaults: an o_proj bias (whole on
every rank, added once after the all-reduce) and a zero-width Qwen2-MoE shared expert on
two real gloo ranks, and a checkpoint tensor whose whole size disagrees with config.json:
every rank must refuse it, naming the tensor, as one rank does (a rank reads only its
slice, so it would otherwise load a wrong one silently). Safetensors and GGUF files."""

from __future__ import annotations

import copy
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from deepinfer.loading.loader import load_model
from deepinfer.models.tensor_parallel import Shard, TPGroup, take_shard
from tests.distributed.test_tp_moe import _stacked_copy
from tests.models.hf_checkpoints import edit_config, save_hf_checkpoint, tiny_config
from tests.models.paged_sim import PagedSim
from tests.models.test_models import ATOL, hf_logits

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

PROMPT = [5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 41]


# ---------------------------------------------------------------------------- 2 ranks
def _rank(info, good: dict[str, str], bad: str, out_dir: str) -> int:
    """One spawned rank: the good checkpoints' prompt logits (leader) and this rank's
    o_proj bias, then the error loading ``bad``; saved to ``out_dir/rank{r}.pt``."""
    from deepinfer.distributed.ranks import destroy_group, init_distributed

    torch.set_num_threads(1)  # ranks share 2 cores
    init_distributed(info, "cpu", timeout_s=120)
    try:
        tp = TPGroup(info.rank, info.world_size, dist.group.WORLD)
        result: dict[str, object] = {}
        for name, path in good.items():
            model, cfg = load_model(path, dtype="float32", device="cpu", tp=tp)
            logits = PagedSim(cfg, tp=tp).step(model, {0: PROMPT}, True)
            result[name] = (logits, model.model.layers[0].self_attn.o_proj.bias)
        try:
            load_model(bad, dtype="float32", device="cpu", tp=tp)
            result["bad"] = None
        except ValueError as e:
            result["bad"] = str(e)
        torch.save(result, os.path.join(out_dir, f"rank{info.rank}.pt"))
        return 0
    finally:
        destroy_group()


def test_two_gloo_ranks_bias_zero_shared_expert_and_size_mismatch(tmp_path, monkeypatch):
    from deepinfer.distributed.ranks import spawn_ranks

    hf = {
        "llama_bias": save_hf_checkpoint(tiny_config("llama3", attention_bias=True),
                                         str(tmp_path / "llama_bias"), 4000),
        "qwen2_moe_shared_0": save_hf_checkpoint(
            tiny_config("qwen2_moe", shared_expert_intermediate_size=0),
            str(tmp_path / "qwen2_moe_shared_0"), 4001),
    }
    # The experts are 32 wide; config.json says 16 (8 per rank: rows 0..8 / 8..16 of 32).
    bad = str(tmp_path / "qwen3_moe_lie")
    save_hf_checkpoint(tiny_config("qwen3_moe"), bad, 4002, {"moe_intermediate_size": 16},
                       reference=False)
    with pytest.raises(ValueError, match=r"shape \(\d+, \d+\), expected \(\d+, \d+\)"):
        load_model(bad, dtype="float32")  # one rank: a plain shape error

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    good = {name: str(tmp_path / name) for name in hf}
    spawn_ranks(_rank, 2, (good, bad, str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, model in hf.items():
        got, _ = results[0][name]
        want = hf_logits(model, PROMPT)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=name)
        assert results[1][name][0] is None  # only the leader gathers the vocabulary
    o_bias = hf["llama_bias"].model.layers[0].self_attn.o_proj.bias
    for r in range(2):  # replicated, not split
        assert torch.equal(results[r]["llama_bias"][1], o_bias)
        msg = results[r]["bad"]
        assert msg is not None, f"rank {r} loaded a checkpoint that disagrees with its config"
        assert re.search(r"checkpoint tensor 'model\.layers\.\d+\.mlp\.experts\.\d+\.\w+\."
                         r"weight': shape \((32, 64|64, 32)\), expected size 16 along dim "
                         r"[01] \(moe_intermediate_size=16 in the config\)", msg), msg


# ---------------------------------------------------------------------------- one process
def _copy_with(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    edit_config(str(dst), changes)
    return str(dst)


def _assert_every_rank_refuses(path: str, tp: int, pattern: str) -> None:
    """Each rank's load (no group behind the TPGroup: loading runs no collective) raises
    naming the tensor; so does the one-rank load (whole shapes compared)."""
    for rank in range(tp):
        with pytest.raises(ValueError, match=pattern):
            load_model(path, dtype="float32", device="cpu", tp=TPGroup(rank, tp, None))
    with pytest.raises(ValueError, match=r"checkpoint tensor '.*': shape"):
        load_model(path, dtype="float32", device="cpu")


@pytest.mark.parametrize("name, changes, tp, pattern", [
    ("llama3", {"intermediate_size": 64}, 2,
     r"'model\.layers\.\d+\.mlp\.\w+_proj\.weight': shape \((128, 64|64, 128)\), expected "
     r"size 64 along dim [01] \(intermediate_size=64 in the config\)"),
    ("llama3", {"vocab_size": 200}, 2,
     r"'(model\.embed_tokens|lm_head)\.weight': shape \(300, 64\), expected size 200 "
     r"along dim 0 \(vocab_size=200 in the config\)"),
    # 1 KV head over 2 ranks: replicated, each rank reads 16 of the 32 rows it finds.
    ("llama3", {"num_key_value_heads": 1}, 2,
     r"'model\.layers\.\d+\.self_attn\.[kv]_proj\.weight': shape \(32, 64\), expected size "
     r"16 along dim 0 \(num_key_value_heads=1 x head_dim=16 in the config\)"),
    ("llama3", {"num_key_value_heads": 1}, 4, r"num_key_value_heads=1 x head_dim=16"),
    # Fewer rows than the config's: one rank used to fill part of the fused qkv rows.
    ("llama3", {"num_key_value_heads": 4}, 2,
     r"'model\.layers\.\d+\.self_attn\.[kv]_proj\.weight': shape \(32, 64\), expected size "
     r"64 along dim 0 \(num_key_value_heads=4 x head_dim=16 in the config\)"),
    # head_dim 32 explicit: 2 query heads are 64 rows, the tensors have 128.
    ("qwen3", {"num_attention_heads": 2}, 2,
     r"'model\.layers\.\d+\.self_attn\.[qo]_proj\.weight': shape \((128, 64|64, 128)\), "
     r"expected size 64 along dim [01] \(num_attention_heads=2 x head_dim=32 in the"),
])
def test_dense_size_mismatch_refused_by_every_rank(name, changes, tp, pattern,
                                                   tiny_checkpoints, tmp_path):
    path = _copy_with(tiny_checkpoints[name].path, tmp_path / name, **changes)
    _assert_every_rank_refuses(path, tp, pattern)


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_checks_moe")
    out = {}
    for i, name in enumerate(("qwen3_moe", "qwen2_moe")):
        out[name] = str(root / name)
        save_hf_checkpoint(tiny_config(name), out[name], 4100 + i)
    out["qwen3_moe_stacked"] = _stacked_copy(out["qwen3_moe"], root / "qwen3_moe_stacked")
    return out


@pytest.mark.parametrize("name, changes, pattern", [
    ("qwen3_moe", {"moe_intermediate_size": 16},
     r"'model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight': shape \((32, 64|64, 32)\), "
     r"expected size 16 along dim [01] \(moe_intermediate_size=16 in the config\)"),
    # Stacked experts: down_proj [E, H, I] is cut by the loader, gate_up_proj [E, 2I, H]
    # by the MoE block (both halves).
    ("qwen3_moe_stacked", {"moe_intermediate_size": 16},
     r"'model\.layers\.\d+\.mlp\.experts\.(down_proj': shape \(6, 64, 32\), expected size 16 "
     r"along dim 2 \(|gate_up_proj': shape \(6, 64, 64\), expected size 32 along dim 1 \(2 x "
     r")moe_intermediate_size=16 in the config\)"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 32},
     r"'model\.layers\.1\.mlp\.shared_expert\.\w+_proj\.weight': shape \((48, 64|64, 48)\), "
     r"expected size 32 along dim [01] \(shared_expert_intermediate_size=32 in the config\)"),
    # A zero-width shared expert in the config, a real one in the checkpoint.
    ("qwen2_moe", {"shared_expert_intermediate_size": 0},
     r"'model\.layers\.1\.mlp\.shared_expert\.\w+_proj\.weight': shape \((48, 64|64, 48)\), "
     r"expected (size 0 along dim [01] \(shared_expert_intermediate_size=0 in the config\)|"
     r"a zero-size tensor)"),
])
def test_moe_size_mismatch_refused_by_every_rank(name, changes, pattern, moe_ckpts,
                                                 tmp_path):
    path = _copy_with(moe_ckpts[name], tmp_path / name, **changes)
    _assert_every_rank_refuses(path, 2, pattern)


def test_gguf_size_mismatch_refused_by_every_rank(tiny_checkpoints, tmp_path):
    """GGUF tensors are read whole, then cut (``take_shard``): the same check there."""
    from tests.models.tiny_gguf import write_tiny_gguf

    hf = copy.deepcopy(tiny_checkpoints["llama3"].hf_model)
    hf.config.intermediate_size = 64  # the metadata's feed_forward_length; tensors: 128
    path = str(tmp_path / "lie.gguf")
    write_tiny_gguf(hf, "llama", path)
    _assert_every_rank_refuses(
        path, 2, r"'model\.layers\.\d+\.mlp\.\w+_proj\.weight': shape \((128, 64|64, 128)\), "
                 r"expected size 64 along dim [01] \(intermediate_size=64 in the config\)")


def test_take_shard_checks_the_split_dim():
    w = torch.arange(24.0).reshape(4, 6)
    ok = Shard(1, 3, 3, 6, "intermediate_size=6")
    assert torch.equal(take_shard(w, ok, "w"), w[:, 3:])
    with pytest.raises(ValueError, match=r"checkpoint tensor 'w': shape \(4, 6\), expected "
                                         r"size 8 along dim 1 \(intermediate_size=8 in"):
        take_shard(w, Shard(1, 4, 4, 8, "intermediate_size=8"), "w")
    with pytest.raises(ValueError, match=r"'b': shape \(6,\), expected size 6 along dim 1"):
        take_shard(w[0], ok, "b")  # no such dim
