"""Reasoning separation (issue 28, part 2): ``split_reasoning``'s rules, and
``LLM(reasoning_parser=...)`` / ``--reasoning-parser`` end to end: an output forced (by a
choice grammar) to ``<think>plan</think> answer`` gives reasoning and content apart, in
``CompletionOutput.reasoning``, OpenAI's ``message.reasoning`` and native ``reasoning``;
thinking turned off keeps all text as content; an unknown parser is refused."""

from __future__ import annotations

import json

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.generate import main
from deepinfer.reasoning import split_reasoning

FORCED = "<think>plan it</think>\n\nthe answer"


@pytest.mark.parametrize("parser,text,thinking,want", [
    ("qwen3", FORCED, True, ("plan it", "the answer")),
    ("qwen3", "still thinking", True, ("still thinking", "")),  # cut before the answer
    ("qwen3", FORCED, False, (None, FORCED)),  # thinking off: all content
    ("deepseek_r1", "plan</think>answer", True, ("plan", "answer")),  # opened in prompt
    ("deepseek_r1", "<think>a</think>b", True, ("a", "b")),
    ("deepseek_r1", "no end", True, ("no end", "")),
])
def test_split_rules(parser, text, thinking, want):
    assert split_reasoning(text, parser, thinking) == want


def test_unknown_parser_is_refused(tiny_checkpoints, capsys):
    with pytest.raises(ValueError, match="reasoning_parser='o1'"):
        split_reasoning("x", "o1")
    with pytest.raises(ValueError, match="reasoning_parser='o1'"):
        LLM(tiny_checkpoints["llama3"].path, device="cpu", reasoning_parser="o1")
    with pytest.raises(SystemExit) as exc:
        main(["--input", "x.jsonl", "--output", "o.jsonl", "--reasoning-parser", "o1"])
    assert exc.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err


def _forced() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40,
                          structured_outputs={"choice": [FORCED]})


def test_llm_splits_reasoning_from_the_answer(tiny_checkpoints):
    path = tiny_checkpoints["llama3"].path
    llm = LLM(path, device="cpu", kv_cache_memory=8 << 20, reasoning_parser="qwen3")
    chat = [{"role": "user", "content": "think first"}]
    [out] = llm.chat(chat, _forced(), use_tqdm=False)
    c = out.outputs[0]
    assert (c.reasoning, c.text) == ("plan it", "the answer")
    assert c.to_dict()["reasoning"] == "plan it"
    [off] = llm.chat(chat, _forced(), use_tqdm=False,
                     chat_template_kwargs={"enable_thinking": False})
    assert (off.outputs[0].reasoning, off.outputs[0].text) == (None, FORCED)
    plain = LLM(path, device="cpu", kv_cache_memory=8 << 20)
    [raw] = plain.chat(chat, _forced(), use_tqdm=False)
    assert (raw.outputs[0].reasoning, raw.outputs[0].text) == (None, FORCED)


def test_batch_files_write_reasoning(tmp_path, tiny_checkpoints):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "t", "schema": {"enum": [FORCED]}}}}
    inp = tmp_path / "batch.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n")
    args = ["--model", tiny_checkpoints["llama3"].path, "--device", "cpu",
            "--kv-cache-memory", str(8 << 20), "--no-progress", "--reasoning-parser",
            "deepseek_r1"]
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *args]) == 0
    msg = json.loads(out.read_text())["response"]["body"]["choices"][0]["message"]
    # The JSON string's quotes wrap the forced text: the split still finds the tags.
    assert msg["reasoning"] == '"<think>plan it' and msg["content"] == '\\n\\nthe answer"'
    native = tmp_path / "in.jsonl"
    native.write_text(json.dumps({"id": "n", "prompt": "x", "max_tokens": 40,
                                  "structured_outputs": {"choice": [FORCED]}}) + "\n")
    out2 = tmp_path / "out2.jsonl"
    assert main(["--input", str(native), "--output", str(out2), *args]) == 0
    rec = json.loads(out2.read_text())["outputs"][0]
    assert (rec["reasoning"], rec["text"]) == ("plan it", "the answer")


@pytest.fixture(scope="module")
def think_token_model(tiny_checkpoints, tmp_path_factory) -> str:
    """The tiny llama3 with ``<think>`` / ``</think>`` as tokens of their own (as in
    Qwen3's and DeepSeek-R1's vocabularies)."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("think_tokens") / "llama3"
    shutil.copytree(tiny_checkpoints["llama3"].path, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(path)
    return str(path)


def test_a_grammar_constrains_the_answer_after_the_reasoning(think_token_model):
    llm = LLM(think_token_model, device="cpu", kv_cache_memory=8 << 20,
              reasoning_parser="qwen3")
    tok = llm.tokenizer
    [end] = tok.encode("</think>", add_special_tokens=False)
    free = tok.encode("zq", add_special_tokens=False)[0]  # no answer starts with it
    choice = {"choice": ["yes", "no"]}

    def run(bias: dict[int, float], **kw):
        [out] = llm.chat([{"role": "user", "content": "x"}], SamplingParams(
            temperature=0.0, max_tokens=6, structured_outputs=choice, logit_bias=bias),
            use_tqdm=False, **kw)
        return out.outputs[0]

    # Thinking: the reasoning is free (here never closed, so all of it is reasoning)...
    thought = run({free: 100})
    assert thought.token_ids == [free] * 6 and thought.text == ""
    assert thought.reasoning == tok.decode([free] * 6)
    # ... and once </think> comes, the grammar holds the answer (</think> is then masked).
    answered = run({end: 100})
    assert answered.token_ids[0] == end
    assert (answered.reasoning, answered.text) in (("", "yes"), ("", "no"))
    # Thinking off: the grammar constrains everything.
    off = run({free: 100}, chat_template_kwargs={"enable_thinking": False})
    assert off.text in ("yes", "no") and off.reasoning is None
    # Without a reasoning parser the grammar constrains the whole output too.
    plain = LLM(think_token_model, device="cpu", kv_cache_memory=8 << 20)
    [out] = plain.generate(["x"], SamplingParams(temperature=0.0, max_tokens=6,
                                                 structured_outputs=choice,
                                                 logit_bias={free: 100}), use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
