"""Per-request sampling options (vLLM-like names and semantics).

``SamplingParams`` validates itself on construction and on ``replace``; every error is a
``ValueError`` that names the field and the rule, so the CLI can report a bad input line
without a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

from deepinfer.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_EPS = 1e-5

#: The most top logprobs a prompt position may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


# Token ids live in int64 tensors.
_MAX_TOKEN_ID = (1 << 63) - 1

#: OpenAI's range of a ``logit_bias`` value.
MAX_LOGIT_BIAS = 100.0

#: The fields a checkpoint's ``generation_config.json`` may give a default for, with the
#: built-in default each falls back to (``SamplingParams.unset`` names those not given).
MODEL_DEFAULTABLE = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                     "repetition_penalty": 1.0, "max_tokens": 16}


class _Unset:
    """The default of a ``MODEL_DEFAULTABLE`` field: replaced by the built-in value in
    ``__post_init__``, its name kept in ``SamplingParams.unset``."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


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
    - ``logit_bias``: ``{token id: bias}`` added to those logits before sampling, each
      in [-100, 100] (OpenAI's); JSON's string keys (``"42"``) are taken as ids.
    - ``allowed_token_ids``: only these tokens may be sampled (non-empty).
    - ``bad_words``: strings the output never contains as tokens: a word that is one
      token (with or without a leading space) is never sampled; a longer one never gets
      its last token after the others.

    The fields in ``MODEL_DEFAULTABLE`` (temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens) left out take the model's ``generation_config.json``
    value when the engine has one, else the built-in default; ``unset`` names them.
    """

    n: int = 1
    temperature: float = UNSET
    top_p: float = UNSET
    top_k: int = UNSET
    min_p: float = UNSET
    seed: int | None = None
    repetition_penalty: float = UNSET
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int = UNSET
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        unset = []
        for name, builtin in MODEL_DEFAULTABLE.items():
            if getattr(self, name) is UNSET:
                setattr(self, name, builtin)
                unset.append(name)
        self.unset: frozenset[str] = frozenset(unset)
        # numpy scalars (np.float32(0.5), np.int64(3)) are taken as the numbers they hold.
        for f in dataclasses.fields(self):
            setattr(self, f.name, _plain(getattr(self, f.name)))
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if isinstance(ids, (list, tuple)):
                setattr(self, name, [_plain(t) for t in ids])
        self.logit_bias = _logit_bias(self.logit_bias)
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
        self._validate_steering()
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

    def _validate_steering(self) -> None:
        for tok, bias in (self.logit_bias or {}).items():
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{tok}]={bias!r}: must be a number in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        ids = self.allowed_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not ids
            or not all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in ids)
        ):
            raise ValueError(f"allowed_token_ids={ids!r}: must be a non-empty list of "
                             "non-negative integers (token ids)")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple))
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ValueError(f"bad_words={words!r}: must be a list of non-blank strings")

    # ------------------------------------------------------------------ helpers
    @property
    def steered(self) -> bool:
        """Whether ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` is set."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """A validated copy whose ``unset`` fields take ``defaults``' values (a model's
        ``generation_config.json``: keys of ``MODEL_DEFAULTABLE``); ``self`` when none
        applies. ``ValueError`` naming the field when the result breaks a rule."""
        taken = {k: v for k, v in defaults.items() if k in self.unset}
        if not taken:
            return self
        try:
            return self.replace(**taken)
        except ValueError as e:
            raise ValueError(f"{e} (with the model's generation_config.json defaults "
                             f"{taken})") from None

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
        """A validated copy with ``overrides`` applied; an unknown key is a ``ValueError``.
        The fields left ``unset`` stay so unless overridden."""
        _check_keys(overrides)
        new = dataclasses.replace(self, **overrides)
        new.unset = self.unset - overrides.keys()
        return new

    @classmethod
    def defaults(cls, **values: Any) -> SamplingParams:
        """Params holding ``values`` as built-in defaults: every ``MODEL_DEFAULTABLE``
        field stays ``unset``, so a model's ``generation_config.json`` overrides it (a
        format's own default, such as greedy deepinfer records, is one)."""
        params = cls(**values)
        params.unset = frozenset(MODEL_DEFAULTABLE)
        return params

    def to_dict(self) -> dict[str, Any]:
        """All fields, JSON-ready (``logit_bias`` keys as JSON writes them)."""
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """``logit_bias`` with its keys as ints: JSON objects key by string (``"42"``).
    ``ValueError`` naming a key that is no token id."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias={bias!r}: must be an object of token id -> bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        tok = key
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            tok = int(key)
        tok = _plain(tok)
        if not _is_int(tok) or not 0 <= tok <= _MAX_TOKEN_ID:
            raise ValueError(f"logit_bias: key {key!r} is not a token id (a non-negative "
                             "integer)")
        out[tok] = _plain(value)
    return out


def _check_keys(d: dict[str, Any]) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"sampling params: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - _FIELDS)
    if unknown:
        raise ValueError(
            f"unknown sampling parameter(s) {unknown}: expected some of {sorted(_FIELDS)}"
        )


def checked_defaults(raw: dict[str, Any], source: str = "generation_config.json"
                     ) -> dict[str, Any]:
    """The model defaults of ``raw`` (``MODEL_DEFAULTABLE`` names, e.g. from a
    ``generation_config.json``) that are valid alone; each one dropped is warned about,
    naming ``source`` and the rule it breaks."""
    ok: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            if key not in MODEL_DEFAULTABLE:
                raise ValueError(f"{key}: not a sampling default")
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as e:
            warnings.warn(f"{source}: {e}: ignored", stacklevel=2)
            continue
        ok[key] = _plain(value)
    return ok
