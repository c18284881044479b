"""Per-request sampling options (vLLM-like names and semantics).

``SamplingParams`` validates itself on construction and on ``replace``; every error is a
``ValueError`` that names the field and the rule, so the CLI can report a bad input line
without a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from deepinfer.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_EPS = 1e-5

#: The most top logprobs a prompt position may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


# Token ids live in int64 tensors.
_MAX_TOKEN_ID = (1 << 63) - 1


def _is_int(v: Any) -> bool:
    # bool is an int subclass, but `"n": true` in a JSON line is a mistake, not n=1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _plain(v: Any) -> Any:
    """A number of another type (numpy's ``int64``, ``float32``, ...; numpy's bool is
    not a number) as the Python ``int`` / ``float`` it holds; anything else as is."""
    if isinstance(v, bool) or type(v) in (int, float):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)  # np.float64 too: a float subclass that prints as np.float64
    return v


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt.

    - ``n``: number of completions (each with its own random stream when ``seed`` is set).
    - ``temperature``: 0 means greedy (argmax); higher flattens the distribution.
    - ``top_p`` in (0, 1]: keep the smallest set of tokens whose probability reaches it.
    - ``top_k``: keep the k most likely tokens; -1 or 0 disables it.
    - ``min_p`` in [0, 1]: drop tokens less likely than ``min_p`` times the top one.
    - ``seed``: makes this request's samples reproducible whatever else is in the batch.
    - ``repetition_penalty`` > 0 (HF semantics, 1 = off): tokens seen in the prompt or the
      output get positive logits divided by it and negative ones multiplied by it.
    - ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI semantics, 0 = off):
      subtracted once per generated token type / once per occurrence.
    - ``stop``: strings that end the completion (excluded from the text unless
      ``include_stop_str_in_output``).
    - ``stop_token_ids``: token ids that end the completion (besides EOS).
    - ``max_tokens`` >= 1, ``min_tokens`` in [0, max_tokens]: before ``min_tokens`` tokens
      EOS and ``stop_token_ids`` cannot be sampled, and ``stop`` strings are not looked for.
    - ``ignore_eos``: keep generating past EOS.
    - ``logprobs``: return the log-probabilities of the sampled token and the top ``k``
      (of the raw model distribution); None = off.
    - ``prompt_logprobs``: return the log-probability of every prompt token after the
      first and the top ``k`` at each of those positions (``RequestOutput.
      prompt_logprobs``), 0 to ``MAX_LOGPROBS``; None = off. With it, ``max_tokens`` may be
      0: the prompt is scored and nothing is generated.
    - ``skip_special_tokens``: leave special tokens out of the text.
    - ``structured_outputs``: a ``StructuredOutputsParams`` the output must match (JSON
      schema, regex, choice, EBNF grammar, any JSON object); a mapping such as
      ``{"regex": "[0-9]+"}`` is converted. None = unconstrained.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # numpy scalars (np.float32(0.5), np.int64(3)) are taken as the numbers they hold.
        for f in dataclasses.fields(self):
            setattr(self, f.name, _plain(getattr(self, f.name)))
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = [_plain(t) for t in self.stop_token_ids]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(
                self.structured_outputs)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that breaks its rule."""
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be an integer")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a finite number")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be true or false")

        if self.n < 1:
            raise ValueError(f"n={self.n}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: must be -1 or 0 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty}: must be > 0 (1 = off)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}={v}: must be in [-2, 2]")
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens={self.max_tokens}: must be at least 1 (0 only "
                             "with prompt_logprobs: scoring without generating)")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens}: must be >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens}: must be <= max_tokens={self.max_tokens}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be an integer or None")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r}: must be an integer >= 0 or None")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs={k!r}: must be an integer in "
                             f"[0, {MAX_LOGPROBS}] or None")
        self._validate_stop()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs={so!r}: must be a StructuredOutputsParams, "
                             "a mapping such as {'regex': ...}, or None")

    def _validate_stop(self) -> None:
        stop = self.stop
        if stop is not None:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, (list, tuple)) or not all(
                isinstance(s, str) for s in items
            ):
                raise ValueError(f"stop={stop!r}: must be a string or a list of strings")
            # An empty stop string would match before any text: always a mistake.
            if any(s == "" for s in items):
                raise ValueError(f"stop={stop!r}: stop strings must be non-empty")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple))
            or not all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in ids)
        ):
            raise ValueError(
                f"stop_token_ids={ids!r}: must be a list of non-negative integers "
                f"(token ids, below 2**63)"
            )

    # ------------------------------------------------------------------ helpers
    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (``temperature`` 0)."""
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on: only then does the
        engine keep this sample's token counts (prompt mask, output counts)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def stop_list(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a mapping (a JSON object); an unknown key is a ``ValueError``."""
        _check_keys(d)
        return cls(**d)

    def replace(self, **overrides: Any) -> SamplingParams:
        """A validated copy with ``overrides`` applied; an unknown key is a ``ValueError``."""
        _check_keys(overrides)
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """All fields, JSON-ready."""
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _check_keys(d: dict[str, Any]) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"sampling params: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - _FIELDS)
    if unknown:
        raise ValueError(
            f"unknown sampling parameter(s) {unknown}: expected some of {sorted(_FIELDS)}"
        )
