"""``LLM.embed``: a prompt's vector is its last token's final-normed hidden state (what
transformers' base model returns as ``last_hidden_state[:, -1]``), cut to
``dimensions`` and unit-normed as asked, whatever else shares the step, however the
prompt is chunked or prefix-cached, and over tensor-parallel ranks. Base-model
checkpoints (``Qwen3Model``: unprefixed names, no lm_head) and causal-LM configs with
unprefixed weights (as Qwen3-Embedding is saved) load and embed; a base model refuses to
generate. Bad pooling values are named before anything runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 8, 250, 12], [9, 8, 7], list(range(20, 60)), [11]]


def _llm(path: str, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 8 << 20,
          "max_model_len": 128, **kw}
    return LLM(path, **kw)


def _hf_last_hidden(base_model, prompt: list[int]) -> torch.Tensor:
    """transformers' final-normed hidden state of the prompt's last token, fp32 ``[H]``."""
    with torch.inference_mode():
        return base_model(torch.tensor([prompt])).last_hidden_state[0, -1].float()


def _vectors(outs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_embeddings_match_transformers_last_token(tiny_checkpoints, name):
    ckpt = tiny_checkpoints[name]
    llm = _llm(ckpt.path)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.error is None for o in outs)
    # The one token each samples is dropped: none counts as generated, every prompt one does.
    stats = llm.engine.stats
    assert (stats.generated_tokens, stats.prompt_tokens) == (0, sum(map(len, PROMPTS)))
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for p, got in zip(PROMPTS, _vectors(outs)):
        want = torch.nn.functional.normalize(_hf_last_hidden(ckpt.hf_model.model, p), dim=0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert abs(float(got.norm()) - 1.0) < 1e-5
    # dimensions keeps the first values; normalize=False leaves them unscaled.
    raw = llm.embed(PROMPTS[:2], [PoolingParams(dimensions=16, normalize=False),
                                  PoolingParams(dimensions=8)], use_tqdm=False)
    hidden = [_hf_last_hidden(ckpt.hf_model.model, p) for p in PROMPTS[:2]]
    torch.testing.assert_close(torch.tensor(raw[0].outputs.embedding), hidden[0][:16],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(raw[1].outputs.embedding),
                               torch.nn.functional.normalize(hidden[1][:8], dim=0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_embeddings_beside_generations_chunks_and_the_prefix_cache(tiny_checkpoints,
                                                                    overlap):
    """Embedding requests in the same steps as generations change neither (plain and
    overlapped scheduling); a prompt prefilled in chunks of 8 tokens, or found in the
    prefix cache, embeds the same."""
    path = tiny_checkpoints["qwen3"].path
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = _llm(path, async_scheduling=overlap)
    alone_vec = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    alone_gen = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", None, p, greedy)
        engine.add_request(f"e{i}", None, p, greedy, pooling=PoolingParams())
    outs = {o.request_id: o for o in engine.drain()}
    assert [outs[f"g{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone_gen
    for i, v in enumerate(alone_vec):
        torch.testing.assert_close(torch.tensor(outs[f"e{i}"].outputs.embedding), v,
                                   atol=1e-5, rtol=1e-5)

    # Prefix cache: the first call filled it, this one reads the shared blocks.
    stats = engine.scheduler.stats
    hits0 = stats.prefix_cache_hits
    again = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    assert stats.prefix_cache_hits > hits0
    for got, want in zip(again, alone_vec):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    chunked = _llm(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    for got, want in zip(_vectors(chunked.embed(PROMPTS, use_tqdm=False)), alone_vec):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _save_base_model(ckpt, dest, **config_changes) -> str:
    """``ckpt``'s decoder saved as transformers saves a base model (``Qwen3Model``:
    names without ``model.``, no lm_head), its config.json then edited."""
    ckpt.hf_model.model.save_pretrained(dest, safe_serialization=True)
    for f in Path(ckpt.path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dest / f.name)
    cfg_path = dest / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config_changes)
    cfg_path.write_text(json.dumps(cfg))
    return str(dest)


def test_base_model_checkpoints_embed_and_refuse_to_generate(tiny_checkpoints, tmp_path):
    from safetensors import safe_open

    ckpt = tiny_checkpoints["qwen3"]  # untied: its lm_head is not in a base checkpoint
    base = _save_base_model(ckpt, tmp_path / "base")
    with safe_open(f"{base}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head"))
                                                       for n in names)
    assert json.loads((tmp_path / "base" / "config.json").read_text())["architectures"] == [
        "Qwen3Model"]
    want = [torch.nn.functional.normalize(_hf_last_hidden(ckpt.hf_model.model, p), dim=0)
            for p in PROMPTS]
    llm = _llm(base)
    assert llm.engine.model_config.embedding_only
    for got, w in zip(_vectors(llm.embed(PROMPTS, use_tqdm=False)), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="base model without a language-model head"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()

    # Qwen3-Embedding's layout: a causal-LM config (tied) over a base model's names.
    tied = _save_base_model(ckpt, tmp_path / "tied", architectures=["Qwen3ForCausalLM"],
                            tie_word_embeddings=True)
    llm = _llm(tied)
    assert not llm.engine.model_config.embedding_only
    for got, w in zip(_vectors(llm.embed(PROMPTS, use_tqdm=False)), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (PoolingParams(dimensions=0), r"prompt 0: request '\d+': dimensions=0: must be a positive"),
    (PoolingParams(dimensions=65), r"dimensions=65: the model's embeddings have 64"),
    (PoolingParams(dimensions=2.5), r"dimensions=2.5: must be a positive integer"),
    (PoolingParams(normalize=1), r"normalize=1: must be True or False"),
    ([PoolingParams()], r"pooling_params: got 1 for 2 prompts"),
    ([PoolingParams(), SamplingParams()],
     r"pooling_params: expected PoolingParams objects, got SamplingParams"),
])
def test_bad_pooling_values_are_named_and_nothing_runs(tiny_checkpoints, bad, message):
    llm = _llm(tiny_checkpoints["qwen3"].path)
    with pytest.raises(ValueError, match=message):
        llm.embed(PROMPTS[:2], bad, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert len(llm.embed(PROMPTS[:2], use_tqdm=False)[1].outputs.embedding) == 64


def test_one_bad_prompt_fails_the_call_before_any_work(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["qwen3"].path)
    with pytest.raises(ValueError, match=r"prompt 1: .*outside the vocabulary"):
        llm.embed([[1, 2, 3], [1, 10_000]], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_embeddings_under_tensor_parallelism(tiny_checkpoints):
    """Two gloo ranks: each holds half the heads and the MLP; the leader's vectors equal
    one rank's."""
    path = tiny_checkpoints["qwen3"].path
    want = _vectors(_llm(path).embed(PROMPTS, use_tqdm=False))
    with _llm(path, tensor_parallel_size=2) as llm:
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_output_record():
    from deepinfer import EmbeddingOutput

    out = EmbeddingRequestOutput("7", "hi", [1, 2], EmbeddingOutput([0.6, 0.8]))
    assert json.loads(json.dumps(out.to_dict())) == {
        "request_id": "7", "prompt": "hi", "prompt_token_ids": [1, 2],
        "embedding": [0.6, 0.8], "finished": True, "error": None}


def _with_modules(src: str, dest: Path, pooling: dict, dense: bool = False) -> str:
    """``src``'s files linked into ``dest`` plus sentence-transformers' modules.json and
    a Pooling config (and a Dense module when ``dense``)."""
    dest.mkdir()
    for f in Path(src).iterdir():
        (dest / f.name).symlink_to(f)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                        "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **pooling}))
    return str(dest)


def test_the_pooling_a_checkpoint_names_is_read_and_others_refused(tiny_checkpoints,
                                                                  tmp_path):
    """sentence-transformers files that say last-token embed as before; ones that say
    mean pooling, or a Dense layer after it, are refused by name (generation still
    runs); a GGUF file's pooling_type is read the same way."""
    from deepinfer.loading.loader import load_config
    from tests.models.tiny_gguf import write_tiny_gguf

    ckpt = tiny_checkpoints["qwen3"]
    want = _vectors(_llm(ckpt.path).embed(PROMPTS, use_tqdm=False))
    last = _with_modules(ckpt.path, tmp_path / "last", {"pooling_mode_lasttoken": True,
                                                        "pooling_mode_mean_tokens": False})
    llm = _llm(last)
    assert llm.engine.model_config.pooling == "last token"
    for got, w in zip(_vectors(llm.embed(PROMPTS, use_tqdm=False)), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    for name, pooling, dense, said in [
            ("mean", {"pooling_mode_mean_tokens": True}, False, "by mean;"),
            ("dense", {"pooling_mode_lasttoken": True}, True, "by last token, then Dense;")]:
        llm = _llm(_with_modules(ckpt.path, tmp_path / name, pooling, dense))
        with pytest.raises(ValueError, match=f"pool its embeddings {said} LLM.embed reads "
                                             "the last token only"):
            llm.embed(PROMPTS[:1], use_tqdm=False)
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    for pooling_type, said in [(3, "last token"), (1, "mean"), (None, None)]:
        path = str(tmp_path / f"pool{pooling_type}.gguf")
        write_tiny_gguf(ckpt.hf_model, "qwen3", path, pooling_type=pooling_type)
        assert load_config(path).pooling == said


def test_malformed_sentence_transformers_files_are_named(tmp_path):
    from deepinfer.pooling_config import hf_folder_pooling

    assert hf_folder_pooling(str(tmp_path)) is None  # no modules.json: nothing said
    (tmp_path / "modules.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match=r"modules.json: expected a list of module"):
        hf_folder_pooling(str(tmp_path))
    (tmp_path / "modules.json").write_text("[{")
    with pytest.raises(ValueError, match=r"modules.json: not valid JSON"):
        hf_folder_pooling(str(tmp_path))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "p", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    assert hf_folder_pooling(str(tmp_path)) == "CLS token"
