"""Random-weight checkpoints (``deepinfer.testing.random_model``): what GPU CI benchmarks
run on where no weights can be downloaded. A checkpoint with a real tokenizer (SmolLM2's, read
from the default GGUF) loads in the engine and serves a constrained request."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.testing.random_model import PRESETS, main, make_random_checkpoint
from deepinfer.tokenizer import load_tokenizer


def test_real_tokenizer_and_fewer_layers(smollm2_path, tmp_path):
    out = str(tmp_path / "smol")
    # The CLI, as scripts/gpu_ci.sh calls it (tokenizer from the GGUF itself here).
    main(["--preset", "smollm2-135m", "--tokenizer", smollm2_path, "--layers", "2",
          "--out", out])
    cfg = json.loads((tmp_path / "smol" / "config.json").read_text())
    spec = PRESETS["smollm2-135m"]
    assert cfg["num_hidden_layers"] == 2
    assert (cfg["hidden_size"], cfg["vocab_size"]) == (spec["hidden_size"],
                                                       spec["vocab_size"])
    real, saved = load_tokenizer(smollm2_path), load_tokenizer(out)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (real.bos_token_id,
                                                          real.eos_token_id)
    text = "Describe a chef from Paris as JSON: {\"name\": \"Zoë\", \"age\": 41}"
    assert saved.encode(text) == real.encode(text) and len(saved) == len(real)

    llm = LLM(out, dtype="float32", device="cpu", kv_cache_memory=32 << 20,
              max_num_seqs=4)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}!"))
    (res,) = llm.generate(["Say a word:"], sp, use_tqdm=False)
    c = res.outputs[0]
    assert c.finish_reason == "stop" and re.fullmatch("[a-z]{3,8}!", c.text), c


def test_bad_arguments_named(tmp_path):
    with pytest.raises(ValueError, match=r"preset='gpt-9'"):
        make_random_checkpoint(str(tmp_path), "gpt-9")
    with pytest.raises(ValueError, match=r"num_layers=0"):
        make_random_checkpoint(str(tmp_path), "smollm2-135m", num_layers=0)
