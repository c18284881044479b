"""SamplingParams validation/overrides and the output records."""

import json

import pytest

from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling.params import SamplingParams


def test_defaults_are_vllm_like():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.seed, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (
        None, 1.0, 0.0, 0.0)
    assert (p.stop, p.stop_token_ids, p.max_tokens, p.min_tokens) == (None, None, 16, 0)
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens) == (False, None, True)
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"seed": "42"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ],
)
def test_each_rule_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"seed": 0},
        {"stop": "x"},
        {"stop": ["a", "b"]},
        {"stop_token_ids": []},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_validate_can_run_again_after_mutation():
    p = SamplingParams()
    p.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        p.validate()


def test_stop_list():
    assert SamplingParams().stop_list() == []
    assert SamplingParams(stop="END").stop_list() == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop_list() == ["a", "b"]


def test_from_dict_and_replace():
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": ["\n"], "seed": 3})
    assert (p.temperature, p.stop, p.seed) == (0.5, ["\n"], 3)
    q = p.replace(max_tokens=4, top_k=5)
    assert (q.max_tokens, q.top_k, q.temperature) == (4, 5, 0.5)
    assert p.max_tokens == 16  # the original is untouched
    assert SamplingParams.from_dict(q.to_dict()) == q
    json.dumps(q.to_dict())


def test_unknown_key_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams().replace(best_of=2)


def test_replace_validates():
    with pytest.raises(ValueError, match="^top_p="):
        SamplingParams().replace(top_p=2.0)
    with pytest.raises(ValueError, match="^min_tokens="):
        SamplingParams(max_tokens=8).replace(min_tokens=9)


def test_outputs_to_dict_is_json_ready():
    c = CompletionOutput(index=0, text="hi", token_ids=[5, 6], finish_reason="stop",
                         logprobs=[{5: -0.1, 7: -2.0}, {6: -0.3}])
    r = RequestOutput(request_id="r1", prompt="say hi", prompt_token_ids=[1, 2],
                      outputs=[c], finished=True)
    d = r.to_dict()
    assert d == {
        "request_id": "r1", "prompt": "say hi", "prompt_token_ids": [1, 2],
        "outputs": [{"index": 0, "text": "hi", "token_ids": [5, 6], "finish_reason": "stop",
                     "stop_reason": None, "logprobs": [{5: -0.1, 7: -2.0}, {6: -0.3}],
                     "reasoning": None}],
        "finished": True, "prompt_logprobs": None, "error": None,
    }
    back = json.loads(json.dumps(d))
    assert back["outputs"][0]["logprobs"][0] == {"5": -0.1, "7": -2.0}
    r.prompt_logprobs = [None, {2: -1.5, 9: -0.5}]
    assert json.loads(json.dumps(r.to_dict()))["prompt_logprobs"] == [
        None, {"2": -1.5, "9": -0.5}]
    assert c.finished()
    assert not CompletionOutput(0, "", [], None).finished()
    assert CompletionOutput(0, "", [], None).to_dict()["logprobs"] is None


def test_numpy_scalars_are_the_numbers_they_hold():
    """Values computed with numpy (np.float32 temperature, np.int64 top_k / stop ids) are
    accepted and stored as Python numbers; numpy booleans are not numbers here."""
    import numpy as np

    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int32(7),
                       stop_token_ids=[np.int64(4)], max_tokens=np.uint16(9))
    assert (p.temperature, p.top_k, p.seed, p.stop_token_ids, p.max_tokens) == (
        0.5, 3, 7, [4], 9)
    assert all(type(v) in (int, float) for v in (p.temperature, p.top_k, p.seed,
                                                 p.stop_token_ids[0], p.max_tokens))
    with pytest.raises(ValueError, match=r"^n=np.True_: must be an integer"):
        SamplingParams(n=np.bool_(True))
    with pytest.raises(ValueError, match="temperature=nan"):
        SamplingParams(temperature=np.float64("nan"))


@pytest.mark.parametrize("ids", [[2**63], [10**20], [-1]])
def test_stop_token_ids_must_fit_a_token_id(ids):
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=ids)
