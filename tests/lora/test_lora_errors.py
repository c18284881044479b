"""Bad LoRA input: each is a ValueError naming the adapter (folder, tensor or field) and
the request, raised before any work starts, and leaves nothing held."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deepinfer import LLM, EngineArgs, LoRARequest, SamplingParams
from tests.checkpoints import tiny_configs
from tests.lora.adapters import save_peft_adapter
from tests.models.hf_checkpoints import save_random_model

ONE = SamplingParams(max_tokens=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_errors")
    hf = save_random_model(tiny_configs()["llama3"], str(root / "model"), 0)
    save_peft_adapter(hf, str(root / "good"), 1)
    llm = LLM(str(root / "model"), dtype="float32", device="cpu", kv_cache_memory=4 << 20,
              enable_lora=True, max_lora_rank=8)
    return root, hf, llm


def _edit_config(folder, **changes):
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _copy_adapter(root, name, **config_changes):
    """The good adapter's files under ``name``, its config changed."""
    import shutil

    dst = root / name
    shutil.copytree(root / "good", dst, dirs_exist_ok=True)
    _edit_config(dst, **config_changes)
    return str(dst)


def _rewrite_tensors(folder, fn):
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "adapter_model.safetensors")
    save_file(fn(load_file(path)), path)


def _refused(llm, req, match):
    before = list(llm.engine.lora.loaded)
    with pytest.raises(ValueError, match=match):
        llm.generate(["hello", "world"], ONE, use_tqdm=False, lora_request=[None, req])
    assert llm.engine.lora.loaded == before  # nothing held
    assert not llm.engine.has_unfinished()  # the other prompt did not stay queued


def test_missing_folder_and_files(setup, tmp_path):
    root, _, llm = setup
    _refused(llm, LoRARequest("x", 5, str(tmp_path / "nope")),
             r"prompt 1: request '\d+': LoRARequest 'x': LoRA adapter .*nope': not a folder")
    _refused(llm, LoRARequest("x", 5, str(tmp_path)), r"no adapter_config\.json")
    only_cfg = root / "only_cfg"
    only_cfg.mkdir()
    (only_cfg / "adapter_config.json").write_text(
        (root / "good" / "adapter_config.json").read_text())
    _refused(llm, LoRARequest("x", 5, str(only_cfg)),
             r"no adapter_model\.safetensors or adapter_model\.bin")


@pytest.mark.parametrize("changes, match", [
    ({"use_dora": True}, r"use_dora is set: DoRA adapters are not supported"),
    ({"bias": "all"}, r"bias='all' trains the base model's biases"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save \['lm_head'\]"),
    ({"peft_type": "IA3"}, r"peft_type 'IA3'; only LORA"),
    ({"r": 0}, r"r must be a positive integer, got 0"),
    ({"r": 2}, r"has rank 4, adapter_config\.json gives .* rank 2"),
    ({"lora_alpha": "x"}, r"lora_alpha must be a number"),
])
def test_config_fields_refused(setup, changes, match):
    root, _, llm = setup
    name = "cfg_" + "_".join(changes)
    _refused(llm, LoRARequest(name, 6, _copy_adapter(root, name, **changes)), match)


def test_rank_over_max_lora_rank(setup):
    root, hf, llm = setup
    save_peft_adapter(hf, str(root / "r16"), 2, r=16, alpha=16)
    _refused(llm, LoRARequest("r16", 7, str(root / "r16")),
             r"tensor 'base_model\.model\.model\.layers\.0\..*lora_A\.weight' has rank 16, "
             r"over max_lora_rank=8")


def test_tensors_that_do_not_fit(setup):
    root, _, llm = setup
    path = _copy_adapter(root, "bad_shape")
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    _rewrite_tensors(path, lambda t: {**t, key: torch.randn(7, 4)})
    _refused(llm, LoRARequest("bad_shape", 8, path),
             r"'base_model\.model\.model\.layers\.1\.mlp\.down_proj\.lora_B\.weight' \(7, 4\) "
             r"do not fit 'model\.layers\.1\.mlp\.down_proj' \(128 inputs, 64 outputs\)")
    path = _copy_adapter(root, "no_partner")
    _rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if k != key})
    _refused(llm, LoRARequest("no_partner", 9, path),
             r"down_proj\.lora_A\.weight' has no lora_B partner")
    path = _copy_adapter(root, "stray")
    _rewrite_tensors(path, lambda t: {**t, "base_model.model.lm_head.weight":
                                      torch.randn(300, 64)})
    _refused(llm, LoRARequest("stray", 10, path),
             r"tensor 'base_model\.model\.lm_head\.weight' is not a LoRA A or B weight")


def test_modules_lora_does_not_adapt_here(setup):
    """lm_head (a Linear, but not an attention or MLP projection) and the embedding."""
    root, hf, llm = setup
    save_peft_adapter(hf, str(root / "head"), 3, targets=("q_proj", "lm_head"))
    # PEFT also saves the head's own weight beside an adapted one: only its LoRA here.
    _rewrite_tensors(root / "head", lambda t: {k: v for k, v in t.items()
                                               if "base_layer" not in k})
    _refused(llm, LoRARequest("head", 11, str(root / "head")),
             r"adapts 'lm_head', which is not an attention or dense MLP projection of this "
             r"LlamaForCausalLM model")
    save_peft_adapter(hf, str(root / "embed"), 4, targets=("embed_tokens",))
    _rewrite_tensors(root / "embed", lambda t: {k: v for k, v in t.items()
                                                if "base_layer" not in k})
    _refused(llm, LoRARequest("embed", 12, str(root / "embed")),
             r"lora_embedding_A' is not a LoRA A or B weight")


def test_requests_and_options_refused(setup, tmp_path):
    root, _, llm = setup
    good = LoRARequest("good", 1, str(root / "good"))
    llm.generate(["hello"], ONE, use_tqdm=False, lora_request=good)
    _refused(llm, LoRARequest("other", 1, str(root / "r16")),
             r"lora_int_id 1 is already adapter 'good' .* give each adapter its own id")
    _refused(llm, LoRARequest("", 2, str(root / "good")), r"lora_name must be a non-empty")
    _refused(llm, LoRARequest("zero", 0, str(root / "good")),
             r"LoRARequest 'zero': lora_int_id must be a positive integer, got 0")
    with pytest.raises(ValueError, match=r"lora_request: got 1 for 2 prompts"):
        llm.generate(["a", "b"], ONE, use_tqdm=False, lora_request=[good])
    with pytest.raises(ValueError, match=r"lora_request must be a LoRARequest, got str"):
        llm.generate(["a"], ONE, use_tqdm=False, lora_request=["good"])
    # Nothing stays held: every request above finished or was refused.
    assert llm.engine.lora.loaded == ["good"]
    plain = LLM(str(root / "model"), dtype="float32", device="cpu", kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match=r"lora_request 'good' needs an engine built with "
                                         r"enable_lora=True"):
        plain.generate(["a"], ONE, use_tqdm=False, lora_request=good)
    for kw, match in (({"max_loras": 0}, r"max_loras=0: expected a positive integer"),
                      ({"max_lora_rank": True}, r"max_lora_rank=True"),
                      ({"tensor_parallel_size": 2}, r"enable_lora with tensor_parallel_size"),
                      ({"engine_type": "prompt"}, r"enable_lora with disaggregated")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(enable_lora=True, **kw).validate()
