"""What ``LLM.generate`` returns: one ``RequestOutput`` per prompt, one
``CompletionOutput`` per sample (``n`` of them); what ``LLM.embed`` returns: one
``EmbeddingRequestOutput`` per prompt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# One dict per generated token: {token_id: logprob} with the sampled token and the top-k.
SampleLogprobs = list[dict[int, float]]
# One entry per prompt token: None for the first (nothing precedes it), then {token_id:
# logprob} with that prompt token and the top-k at its position.
PromptLogprobs = list[dict[int, float] | None]


def logprob_dicts(entries: list[dict[int, float] | None]) -> list[dict[int, float] | None]:
    """JSON-ready copies of logprob dicts (plain ints and floats; None kept)."""
    return [None if d is None else {int(t): float(lp) for t, lp in d.items()}
            for d in entries]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    ``finish_reason``: ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` or the model's length limit), ``"abort"``, or None while running.
    ``logprobs``: None unless ``SamplingParams.logprobs`` was set. ``stop_reason``: the
    stop string or ``stop_token_ids`` entry that ended it (None otherwise: EOS too).
    ``reasoning``: with a reasoning parser, the thinking split from ``text`` (None when
    there is none).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: SampleLogprobs | None = None
    stop_reason: str | int | None = None
    reasoning: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready. ``json.dumps`` writes the logprob dicts' int keys as strings."""
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "logprobs": None if self.logprobs is None else logprob_dicts(self.logprobs),
            "reasoning": self.reasoning,
        }


@dataclass
class RequestOutput:
    """All completions of one prompt. ``prompt`` is None when token ids were given.
    ``prompt_logprobs``: None unless ``SamplingParams.prompt_logprobs`` was set.
    ``error``: why the request failed while running (None when it did not); a batch job
    writes it as that record's error."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of the request and its completions."""
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": list(self.prompt_token_ids),
            "outputs": [o.to_dict() for o in self.outputs],
            "finished": self.finished,
            "prompt_logprobs": None if self.prompt_logprobs is None
            else logprob_dicts(self.prompt_logprobs),
            "error": self.error,
        }


@dataclass
class EmbeddingOutput:
    """One prompt's embedding: ``PoolingParams.dimensions`` floats (``hidden_size``
    without it); empty when the request failed (its ``error`` says why)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The embedding of one prompt (vLLM's names). ``prompt`` is None when token ids
    were given; ``error``: why the request failed while running (None when it did not)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of the request and its embedding (a flat ``embedding``)."""
        record = asdict(self)
        record["embedding"] = record.pop("outputs")["embedding"]
        return record
