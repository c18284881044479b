"""Mixture-of-experts models end to end: tiny random Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE
checkpoints made with transformers' own config classes and ``save_pretrained``, loaded back
from the folder by our loader, greedy outputs token-for-token equal to transformers (fp32,
CPU) as one batch with chunked prefill and a prefix-cache hit; one run on the Triton
kernels through the interpreter; bad MoE configs rejected with the architecture named.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.loading.loader import load_model
from deepinfer.models.moe import SparseMoeBlock
from tests.models.moe_checkpoints import MoeCheckpoint, make_moe_checkpoints

LONG = [5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 41, 55, 61, 90, 101, 11,
        13, 150, 160, 170, 180, 190, 30]
PROMPTS = [LONG, [9, 8, 7], LONG[:16] + [44]]  # the third shares LONG's first 2 blocks
MARGIN = 1e-3  # fp32 rounding moves logits by ~1e-5; a closer top-2 is a coin toss


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, MoeCheckpoint]:
    return make_moe_checkpoints(tmp_path_factory.mktemp("tiny_moe"))


def _hf_greedy(hf_model: Any, prompt: list[int],
               n: int) -> tuple[list[int], int, torch.Tensor]:
    """transformers' greedy tokens, how many of them have a clear top-2 margin (the prefix
    up to the first step whose two best logits are within ``MARGIN``), and the log-softmax
    of its raw logits at each step ``[n, vocab]`` fp32."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0, output_scores=True,
                                output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    clear = n
    for step, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if float(top2[0] - top2[1]) < MARGIN:
            clear = step
            break
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return tokens, clear, logprobs


def _assert_greedy_matches_hf(llm: LLM, hf_model: Any, prompts: list[list[int]],
                              n: int) -> None:
    """Tokens equal up to (and including) the first unclear step; on the common prefix the
    log-probabilities of our top-2 tokens equal transformers' to fp32 tolerance."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, logprobs=2,
                                                ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        want, clear, hf_logprobs = _hf_greedy(hf_model, p, n)
        assert clear >= 3, f"top-2 margin unclear after {clear} tokens: pick another seed"
        got = o.outputs[0]
        assert got.token_ids[:clear + 1] == want[:clear + 1], p
        for step in range(clear):
            assert len(got.logprobs[step]) >= 2
            for tok, lp in got.logprobs[step].items():
                assert abs(lp - float(hf_logprobs[step, tok])) < 1e-4, (p, step, tok)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_moe_models_greedy_match_transformers(moe_checkpoints, name):
    ckpt = moe_checkpoints[name]
    llm = LLM(ckpt.path, dtype="float32", device="cpu", max_num_batched_tokens=24,
              max_num_seqs=3, kv_cache_memory=8 << 20, block_size=8)
    _assert_greedy_matches_hf(llm, ckpt.hf_model, PROMPTS, 10)
    assert llm.engine.scheduler.stats.prefix_cache_hits > 0
    cfg = llm.engine.model_config
    sparse = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert sparse == {"qwen3_moe": [0, 2], "qwen2_moe": [1]}.get(name, [0, 1, 2])


def test_moe_layout_and_stacked_weights(moe_checkpoints):
    """Experts land stacked as [E, 2I, H] (gate rows, then up rows) and [E, H, I]; the
    dense layer of Qwen3-MoE is the plain MLP."""
    hf = moe_checkpoints["qwen3_moe"].hf_model
    model, cfg = load_model(moe_checkpoints["qwen3_moe"].path, dtype="float32")
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    assert not isinstance(model.model.layers[1].mlp, SparseMoeBlock)
    assert block.w13.shape == (6, 64, 64) and block.w2.shape == (6, 64, 32)
    experts = hf.model.layers[0].mlp.experts  # transformers 5 holds them stacked too
    torch.testing.assert_close(block.w13, experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(block.w2, experts.down_proj, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_checkpoint_with_stacked_experts_loads_the_same(moe_checkpoints, name, tmp_path):
    """A checkpoint that stores experts already stacked (transformers 5's in-memory names:
    ``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) loads
    to the same parameters as the per-expert one."""
    from safetensors.torch import save_file

    ckpt = moe_checkpoints[name]
    state = {k: v.contiguous() for k, v in ckpt.hf_model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(ckpt.path, "config.json"), tmp_path / "config.json")
    stacked, _ = load_model(str(tmp_path), dtype="float32")
    per_expert, _ = load_model(ckpt.path, dtype="float32")
    want = dict(per_expert.named_parameters())
    for pname, param in stacked.named_parameters():
        torch.testing.assert_close(param, want[pname], rtol=0, atol=0, msg=pname)


def test_triton_backend_interpreter_moe(moe_checkpoints):
    import deepinfer_kernels

    ckpt = moe_checkpoints["qwen3_moe"]
    llm = LLM(ckpt.path, dtype="float32", device="cpu", attention_backend="triton",
              max_num_batched_tokens=8, max_num_seqs=2, kv_cache_memory=4 << 20,
              block_size=8)
    assert llm.engine.backend is deepinfer_kernels
    _assert_greedy_matches_hf(llm, ckpt.hf_model, [LONG[:10], [9, 8]], 3)


# ------------------------------------------------------------------ bad configs
def _hf_dict(**over: Any) -> dict[str, Any]:
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=300, hidden_size=64,
                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32)
    base.update(over)
    return base


@pytest.mark.parametrize("over, match", [
    (dict(num_experts_per_tok=5), r"Qwen3MoeForCausalLM: num_experts_per_tok=5"),
    (dict(num_experts_per_tok=0), r"num_experts_per_tok=0"),
    (dict(num_experts=0), r"Qwen3MoeForCausalLM: num_experts=0"),
    (dict(architectures=["MixtralForCausalLM"], num_experts=None, num_local_experts=2,
          num_experts_per_tok=3), r"MixtralForCausalLM: num_experts_per_tok=3"),
    (dict(architectures=["DeepseekV3ForCausalLM"]), r"'DeepseekV3ForCausalLM'"),
    (dict(architectures=["GptOssForCausalLM"]), r"'GptOssForCausalLM'"),
])
def test_bad_moe_config_raises_naming_it(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(_hf_dict(**over))


def test_bad_moe_checkpoint_folder_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        _hf_dict(architectures=["OlmoeForCausalLM"], num_experts=3, num_experts_per_tok=4)))
    with pytest.raises(ValueError, match=r"OlmoeForCausalLM: num_experts_per_tok=4"):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("experts, match", [
    # 7 in the config: the router's rows already disagree.
    (7, r"mlp\.gate\.weight': shape \(6, 64\), expected \(7, 64\)"),
    (4, r"experts\.[45]\.\w+\.weight': expert [45] but the config has 4 experts"),
])
def test_checkpoint_expert_count_mismatch_raises(moe_checkpoints, tmp_path, experts, match):
    src = moe_checkpoints["qwen3_moe"].path  # 6 experts in its tensors
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("num_experts", None)
    cfg["num_local_experts"] = experts
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("name, dropped", [
    ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w3.weight"),
    ("qwen3_moe", "model.layers.2.mlp.experts.4.down_proj.weight"),
])
def test_missing_expert_tensor_is_named_as_the_checkpoint_names_it(moe_checkpoints, tmp_path,
                                                                    name, dropped):
    from safetensors.torch import load_file, save_file

    src = moe_checkpoints[name].path
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    for f in shards:
        tensors = load_file(str(tmp_path / f))
        if dropped in tensors:
            del tensors[dropped]
            save_file(tensors, str(tmp_path / f), metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{dropped} is not in the checkpoint")
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\), e\.g\. " + re.escape(dropped)):
        load_model(str(tmp_path), dtype="float32")
