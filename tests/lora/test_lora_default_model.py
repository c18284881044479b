"""A LoRA adapter on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF): against PEFT
over transformers' load of the same file, dequantized in float32 and as served by
default (weights kept as GGUF blocks, bfloat16 activations, the fused C decode step for
the steps without an adapter)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import logits, save_peft_adapter

NEW = 16


@pytest.fixture(scope="module")
def adapter(hf_smollm2, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("smollm2_lora") / "adapter")
    # std 0.05: the adapter moves prompt log-probabilities by up to ~2 nats.
    peft = save_peft_adapter(hf_smollm2, path, 1, r=8, alpha=16, std=0.05)
    return LoRARequest("smol", 1, path), peft


def test_float32_prompt_logprobs_match_peft(smollm2_path, adapter, hf_smollm2):
    req, peft = adapter
    llm = LLM(smollm2_path, dtype="float32", quantization="none", enable_lora=True)
    prompt = llm.tokenizer.encode("The capital of France is")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False, lora_request=req)[0]
    want = torch.log_softmax(logits(peft, prompt), -1)
    base = torch.log_softmax(logits(hf_smollm2, prompt), -1)
    pos = range(1, len(prompt))
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]] for i in pos])
    ref = torch.tensor([want[i - 1, prompt[i]].item() for i in pos])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # The adapter matters here (else a missing delta would pass).
    assert (ref - torch.tensor([base[i - 1, prompt[i]].item() for i in pos])).abs().max() > 0.5


def test_served_by_default_beside_a_base_request(smollm2_path, adapter):
    """Quantized weights and bf16: the adapter's greedy tokens are PEFT's (fp32) top
    choices within bf16 noise at every position, and the request without an adapter in
    the same batch gets exactly what an engine without LoRA gives it."""
    req, peft = adapter
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm = LLM(smollm2_path, enable_lora=True)
    prompt = llm.tokenizer.encode("The capital of France is")
    with_adapter, without = llm.generate([prompt, prompt], greedy, use_tqdm=False,
                                         lora_request=[req, None])
    plain = LLM(smollm2_path).generate([prompt], greedy, use_tqdm=False)[0]
    assert without.outputs[0].token_ids == plain.outputs[0].token_ids
    tokens = with_adapter.outputs[0].token_ids
    assert tokens != plain.outputs[0].token_ids
    rows = logits(peft, prompt + tokens)[len(prompt) - 1:-1]
    gap = rows.max(-1).values - rows[torch.arange(NEW), torch.tensor(tokens)]
    assert (gap < 0.1).all(), gap
