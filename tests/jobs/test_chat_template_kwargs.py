"""``chat_template_kwargs`` (issue 28, part 1): template variables such as Qwen3's
``enable_thinking`` reach the chat template from ``LLM.chat``, from a line of either file
format and from ``--chat-template-kwargs`` (a line's own win, key by key); malformed ones
fail that line (or, on the command line, the run with exit 2), naming the field."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.generate import main
from deepinfer.jobs.input_records import parse_jsonl_line
from deepinfer.jobs.openai_batch import parse_openai_line
from deepinfer.tokenizer import apply_chat_template, load_tokenizer

# Qwen3's switch, reduced: thinking off writes an empty think block after the prompt.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}")
CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def thinking_model(tiny_checkpoints, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("thinking") / "llama3"
    shutil.copytree(tiny_checkpoints["llama3"].path, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return str(path)


def test_the_template_sees_the_variables(thinking_model):
    tok = load_tokenizer(thinking_model)
    plain = apply_chat_template(tok, CHAT)
    off = apply_chat_template(tok, CHAT, {"enable_thinking": False})
    assert off[:len(plain)] == plain and len(off) > len(plain)
    assert "</think>" in tok.decode(off[len(plain):])
    assert apply_chat_template(tok, CHAT, {"enable_thinking": True}) == plain
    with pytest.raises(ValueError, match=r"chat_template_kwargs.tokenize"):
        apply_chat_template(tok, CHAT, {"tokenize": True})
    with pytest.raises(ValueError, match="chat_template_kwargs: must be an object"):
        apply_chat_template(tok, CHAT, ["enable_thinking"])


def test_llm_chat_passes_them(thinking_model):
    llm = LLM(thinking_model, device="cpu", kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    [plain] = llm.chat(CHAT, params, use_tqdm=False)
    [off] = llm.chat(CHAT, params, use_tqdm=False,
                     chat_template_kwargs={"enable_thinking": False})
    assert len(off.prompt_token_ids) > len(plain.prompt_token_ids)


def _chat_line(cid: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": CHAT, "max_tokens": 1, "temperature": 0,
                                **body}})


def _prompt_tokens(path) -> dict[str, int | None]:
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    return {r["custom_id"]: (r["response"]["body"]["usage"]["prompt_tokens"]
                             if r["response"] else None) for r in recs}


def test_lines_and_the_flag_reach_the_template(tmp_path, thinking_model):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join([
        _chat_line("default"),
        _chat_line("off", chat_template_kwargs={"enable_thinking": False}),
        _chat_line("on", chat_template_kwargs={"enable_thinking": True}),
        _chat_line("bad", chat_template_kwargs={"conversation": []}),
    ]) + "\n")
    args = ["--model", thinking_model, "--device", "cpu", "--kv-cache-memory",
            str(8 << 20), "--no-progress"]
    out = tmp_path / "a.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *args]) == 1  # "bad" failed
    got = _prompt_tokens(out)
    assert got["bad"] is None and got["off"] > got["default"] == got["on"]
    out = tmp_path / "b.jsonl"
    assert main(["--input", str(inp), "--output", str(out), *args,
                 "--chat-template-kwargs", '{"enable_thinking": false}']) == 1
    flagged = _prompt_tokens(out)
    # The flag turns thinking off for every line but the one that turns it on.
    assert flagged["default"] == flagged["off"] == got["off"]
    assert flagged["on"] == got["on"]


def test_bad_values_name_the_field(capsys):
    rec = parse_openai_line(_chat_line("x", chat_template_kwargs="yes"), 2)
    assert "body.chat_template_kwargs" in rec.error and "line 2" in rec.error
    completion = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "x", "chat_template_kwargs": {}}})
    assert "body.chat_template_kwargs" in parse_openai_line(completion, 3).error
    rec = parse_jsonl_line(json.dumps({"prompt": "x", "chat_template_kwargs": {"tokenize": 1}}), 4)
    assert "chat_template_kwargs.tokenize" in rec.error
    with pytest.raises(SystemExit) as exc:
        main(["--input", "x.jsonl", "--output", "o.jsonl",
              "--chat-template-kwargs", "{not json"])
    assert exc.value.code == 2
    assert "--chat-template-kwargs" in capsys.readouterr().err
