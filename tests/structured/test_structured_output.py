"""Structured output through the whole engine on the default model (SmolLM2-135M GGUF):
JSON schema, regex, choice, EBNF grammar and JSON-object requests in one batch with
unconstrained neighbours; bad requests failing alone (API and jsonl jobs); and, on the
tiny random Llama, preemption (recompute) and n > 1 keeping each sample's matcher right.

Every constrained output must be complete (finish_reason "stop": an output cut at
max_tokens is a failure) and must match its constraint, checked without xgrammar
(``jsonschema``, ``re.fullmatch``, a small recursive-descent parser).

The engines run with ``async_scheduling=True`` so that overlapped constrained steps (the
forward enqueued before the step in flight lands, the mask filled after) are exercised on
CPU too; the tiny-model test also checks them against the plain loop, token for token.
"""

from __future__ import annotations

import io
import json
import re

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.jobs.input_records import read_inputs, to_requests
from deepinfer.jobs.output_records import result_record, write_record
from deepinfer.jobs.run_loop import RunTarget, submit_requests
from tests.structured.structured_cases import TINY_PROMPTS, TINY_SCHEMA, record_overlap, tiny_params

SO = StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
EMAIL = r"[a-z]{2,12}@[a-z]{2,10}\.(com|org|net)"
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral"]
# Arithmetic with parentheses: not a regular language.
ARITH = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] | [1-9] [0-9] | "(" expr ")"
"""


def parse_arith(text: str) -> None:
    """Raise ``ValueError`` unless ``text`` is an expression of ``ARITH``."""
    pos = 0

    def expr() -> None:
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    def term() -> None:
        nonlocal pos
        factor()
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            factor()

    def factor() -> None:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            expr()
            if text[pos:pos + 1] != ")":
                raise ValueError(f"')' expected at {pos} in {text!r}")
            pos += 1
            return
        m = re.match(r"[1-9][0-9]|[0-9]", text[pos:])
        if m is None:
            raise ValueError(f"number expected at {pos} in {text!r}")
        pos += m.end()

    expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")


def test_parse_arith_rejects():
    parse_arith("(1+23)*4-5/6")
    for bad in ["", "1+", "(1", "123", "1)", "a"]:
        with pytest.raises(ValueError):
            parse_arith(bad)


def _chat(llm: LLM, content: str) -> list[int]:
    from deepinfer.tokenizer import apply_chat_template

    return apply_chat_template(llm.tokenizer, [{"role": "user", "content": content}])


# ------------------------------------------------------------------ SmolLM2 batch
@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", device="cpu", max_num_seqs=24,
               max_num_batched_tokens=1024, kv_cache_memory=160 << 20,
               async_scheduling=True)


def _json(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=300, structured_outputs=SO(json=PERSON), **kw)


UNCONSTRAINED = [
    ("Name three colours.", SamplingParams(temperature=0.0, max_tokens=20)),
    ("Tell me a joke.", SamplingParams(temperature=1.0, seed=9, max_tokens=20)),
]
BATCH = [
    # (tag, prompt, params)
    ("json", "Describe a fictional airline pilot as JSON.", _json(temperature=0.0)),
    ("json", "Describe a chef from Paris as JSON.", _json(temperature=0.0)),
    ("json", "Describe a retired teacher as JSON.",
     _json(temperature=1.0, seed=1, repetition_penalty=1.2, presence_penalty=0.5)),
    ("json", "Describe a young programmer as JSON.", _json(temperature=1.0, seed=2, n=2)),
    ("regex:" + EMAIL, "Make up an email address for Bob.",
     SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=EMAIL))),
    ("regex:" + DATE, "When did the Berlin wall fall? Give the date.",
     SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                    structured_outputs=SO(regex=DATE))),
    ("choice", "Sentiment of 'I love this phone, it is great':",
     SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=SO(choice=CHOICES))),
    ("choice", "Sentiment of 'The food was cold and awful':",
     SamplingParams(temperature=1.0, seed=5, max_tokens=10, n=2,
                    structured_outputs={"choice": CHOICES})),
    ("grammar", "Write an arithmetic expression equal to 12.",
     SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SO(grammar=ARITH))),
    ("json_object", "Give a JSON object with the keys x and y set to small numbers.",
     SamplingParams(temperature=0.0, max_tokens=120,
                    structured_outputs=SO(json_object=True))),
] + [("plain", p, sp) for p, sp in UNCONSTRAINED]


@pytest.fixture(scope="module")
def batch(llm):
    prompts = [_chat(llm, p) for _, p, _ in BATCH]
    outs = llm.generate(prompts, [sp for _, _, sp in BATCH], use_tqdm=False)
    return [(tag, out) for (tag, _, _), out in zip(BATCH, outs)]


def _outputs(batch, prefix: str):
    got = [(tag, c) for tag, out in batch if tag.startswith(prefix) for c in out.outputs]
    assert got
    return got


def _complete(c) -> None:
    assert c.finish_reason == "stop", (c.finish_reason, len(c.token_ids), c.text)


def test_json_schema_outputs_validate(batch):
    outs = _outputs(batch, "json")
    assert len([1 for tag, _ in outs if tag == "json"]) == 5
    for tag, c in outs:
        _complete(c)
        value = json.loads(c.text)
        if tag == "json":
            jsonschema.validate(value, PERSON)
        else:
            assert isinstance(value, dict)
        assert "\n" not in c.text  # fixed whitespace by default


def test_regex_outputs_fully_match(batch):
    for tag, c in _outputs(batch, "regex:"):
        _complete(c)
        assert re.fullmatch(tag.split(":", 1)[1], c.text), c.text


def test_choice_outputs(batch):
    outs = _outputs(batch, "choice")
    assert len(outs) == 3
    for _, c in outs:
        _complete(c)
        assert c.text in CHOICES


def test_grammar_outputs_parse(batch):
    for _, c in _outputs(batch, "grammar"):
        _complete(c)
        parse_arith(c.text)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm, batch):
    alone = llm.generate([_chat(llm, p) for p, _ in UNCONSTRAINED],
                         [sp for _, sp in UNCONSTRAINED], use_tqdm=False)
    mixed = [out for tag, out in batch if tag == "plain"]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.structured.live is False  # every constrained request was forgotten


def test_bad_request_fails_alone_in_generate(llm):
    with pytest.raises(ValueError, match=r"prompt 1: .*structured_outputs\.regex"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(structured_outputs=SO(regex="(((a"))],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.structured.live


def test_stop_token_ids_of_a_constrained_request_must_be_special_tokens(llm):
    """A text token as a stop id would end the output short of its grammar (or, masked
    as text, change it): refused, naming it; special tokens end the grammar as EOS does."""
    obj = SO(json={"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"]})
    brace = llm.tokenizer.convert_tokens_to_ids("}")
    with pytest.raises(ValueError, match=rf"prompt 0: .*stop_token_ids \[{brace}\]: text "
                                         "tokens cannot end a constrained output"):
        llm.generate(["a"], SamplingParams(max_tokens=8, stop_token_ids=[brace],
                                           structured_outputs=obj), use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.structured.live
    special = llm.tokenizer.all_special_ids[0]
    (out,) = llm.generate(["Give a number as JSON:"],
                          SamplingParams(temperature=0.0, max_tokens=20,
                                         stop_token_ids=[special], structured_outputs=obj),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text)["n"], int)


def test_constrained_request_that_can_never_run_fails_alone(llm):
    """Checked at submission like any request, not later inside the step loop (where
    it would end the whole run): the batch is refused with its index named and nothing
    is left behind."""
    # A max_tokens past the model length is cut (as for any request); a prompt that
    # leaves no room for min_tokens can never run.
    too_long = SamplingParams(max_tokens=10**6, min_tokens=10**5,
                              structured_outputs=SO(choice=["a", "b"]))
    with pytest.raises(ValueError, match=r"prompt 1: .*max_model_len"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), too_long], use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.structured.live
    with pytest.raises(ValueError, match=r"request 'big': .*max_model_len"):
        llm.engine.add_request("big", "b", None, too_long)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_min_tokens_yields_to_a_finished_grammar(llm):
    """Under min_tokens the stop tokens are banned; once the grammar allows nothing else
    the ban is lifted for that row: the choice ends with "stop" and its stop token, not
    an arbitrary token the grammar rejects ("abort")."""
    eos = set(llm.engine.eos_token_ids)
    params = [SamplingParams(temperature=t, seed=1, max_tokens=12, min_tokens=6,
                             structured_outputs=SO(choice=CHOICES)) for t in (0.0, 1.0)]
    prompt = _chat(llm, "Sentiment of 'meh':")
    for out in llm.generate([prompt, prompt], params, use_tqdm=False):
        (c,) = out.outputs
        assert c.finish_reason == "stop" and c.text in CHOICES, (c.text, c.token_ids)
        assert c.token_ids[-1] in eos


def test_constrained_request_waits_for_its_grammar(llm):
    """A constrained request reaches the scheduler only once its grammar is compiled
    (parked meanwhile, counted as unfinished work); abort drops a parked one."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=8,
                        structured_outputs=SO(regex="[0-9]{3}"))
    eng.add_request("parked", "Three digits:", None, sp)
    assert eng.structured.has_parked() and eng.has_unfinished()
    assert not eng.scheduler.has_unfinished()
    (out,) = list(eng.drain())
    assert re.fullmatch("[0-9]{3}", out.outputs[0].text)
    eng.add_request("dropped", "Three digits:", None, sp)
    assert eng.abort("dropped") and not eng.has_unfinished() and not eng.structured.live


def test_jsonl_records_with_structured_fields(llm, tmp_path):
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                           "enum": ["yes", "no"]}},
              "required": ["answer"]}
    lines = [
        {"id": "schema", "messages": [{"role": "user", "content": "Is the sky blue?"}],
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "yn", "schema": schema}}},
        {"id": "object", "prompt": "A JSON object:", "max_tokens": 80,
         "response_format": {"type": "json_object"}},
        {"id": "regex", "prompt": "A number:", "structured_outputs": {"regex": "[0-9]{2,4}"}},
        {"id": "choice", "prompt": "Yes or no?",
         "sampling_params": {"structured_outputs": {"choice": ["yes", "no"]}}},
        {"id": "bad-regex", "prompt": "x", "structured_outputs": {"regex": "(((a"}},
        {"id": "bad-schema", "prompt": "x", "structured_outputs": {
            "json": {"type": "integer", "minimum": 9, "maximum": 1}}},
        {"id": "bad-format", "prompt": "x", "response_format": {"type": "yaml"}},
        {"id": "plain", "prompt": "Hello", "max_tokens": 4},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = list(read_inputs(str(path)))
    out = io.StringIO()
    defaults = SamplingParams(temperature=0.0, max_tokens=40)
    requests = to_requests(records, defaults, False)
    _, failed = submit_requests(RunTarget(llm.engine).admit, requests, out)
    for res in llm.engine.drain():
        write_record(out, result_record(res))
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert failed == 3 and sorted(got) == sorted(x["id"] for x in lines)
    assert "structured_outputs.regex" in got["bad-regex"]["error"]
    assert "structured_outputs.json" in got["bad-schema"]["error"]
    assert got["bad-format"]["error"].startswith("line 7: response_format.type='yaml'")
    text = {k: got[k]["outputs"][0]["text"] for k in ("schema", "object", "regex", "choice")}
    for k in text:
        assert got[k]["outputs"][0]["finish_reason"] == "stop", got[k]
    jsonschema.validate(json.loads(text["schema"]), schema)
    assert isinstance(json.loads(text["object"]), dict)
    assert re.fullmatch("[0-9]{2,4}", text["regex"]) and text["choice"] in ("yes", "no")
    assert len(got["plain"]["outputs"][0]["token_ids"]) <= 4


# ------------------------------------------------------------------ tiny model
def _tiny(path: str, kv_blocks: int, overlap: bool = True) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=32,
               max_num_seqs=8, block_size=8, kv_cache_memory=kv_blocks * 4096,
               async_scheduling=overlap)


def test_preemption_and_forks_keep_matchers_right(tiny_checkpoints):
    """Recompute after preemption keeps each sample's tokens and matcher: the outputs
    equal a run that never preempts, and every one matches its constraint (each n > 1
    sample has its own matcher). ``ignore_eos`` with a grammar: the matcher's end (EOS)
    still ends the sample, with "stop"."""
    path = tiny_checkpoints["llama_tied"].path
    prompts = TINY_PROMPTS
    small, big, plain = _tiny(path, 12), _tiny(path, 256), _tiny(path, 256, overlap=False)
    events = record_overlap(big.engine)
    got = small.generate(prompts, tiny_params(), use_tqdm=False)
    want = big.generate(prompts, tiny_params(), use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert big.engine.scheduler.stats.num_preemptions == 0
    key = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in got]
    assert key == [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in want]
    # Constrained steps keep the overlap (launched while the step before is in flight,
    # masked after it lands) and give what the plain loop gives.
    assert sum(1 for in_flight, deferred in events if in_flight == 1 and deferred) > 10
    want_plain = plain.generate(prompts, tiny_params(), use_tqdm=False)
    assert key == [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in want_plain]
    for c in got[0].outputs + got[3].outputs:
        _complete(c)
        jsonschema.validate(json.loads(c.text), TINY_SCHEMA)
    for c in got[1].outputs:
        _complete(c)
        assert re.fullmatch("[a-e]{12,20}", c.text)
    assert got[4].outputs[0].finish_reason == "stop"
    assert got[4].outputs[0].text in ("left", "right")
    assert not small.engine.structured.live and not small.engine.has_unfinished()


def test_threaded_mask_fill_gives_the_same_outputs(tiny_checkpoints):
    """Many constrained rows in a step are filled by xgrammar's thread pool where there
    are cores to spare (``fill_threads`` > 1): the same masks, so the same outputs, as
    one matcher at a time."""
    from deepinfer.structured.matchers import BATCH_FILL_MIN_ROWS

    path = tiny_checkpoints["llama_tied"].path
    n = BATCH_FILL_MIN_ROWS + 4
    prompts = [TINY_PROMPTS[i % len(TINY_PROMPTS)] + f" {i}" for i in range(n)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=60,
                             structured_outputs=SO(json=TINY_SCHEMA) if i % 3
                             else SO(regex="[a-e]{4,9}"))
              for i in range(n)]
    runs = []
    for threads in (1, 2):
        llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=n,
                  kv_cache_memory=8 << 20)
        so = llm.engine.structured
        so.fill_threads = threads
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        assert (so._batch is not None) == (threads > 1)
        assert so.stats.filled_rows > so.stats.fills >= 10 and so.stats.fill_seconds > 0
    key = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in runs[0]]
    assert key == [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in runs[1]]
    for c in (o.outputs[0] for o in runs[1]):
        _complete(c)

