"""A launched step's sampled ids on their way to the host (``ModelRunner.launch``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.sampling.token_logprobs import TokenLogprobs


class SampledTokens:
    """A launched step's sampled ids. ``result()`` waits for them: on CUDA they are copied
    into pinned memory on a side stream behind an event, so the host can schedule and
    launch the next step first (overlapped scheduling).

    ``pending``: the step's sampling not enqueued yet (a structured-output step, whose
    token mask needs the grammar matchers to have seen every earlier token): a callable
    that enqueues it and returns the ``SampledTokens`` it produced. ``finish_sampling()``
    runs it; ``result()`` does so first if no one did.

    ``logprobs``: a list, or a ``TokenLogprobs`` whose host copy is behind the same event
    (read by ``result()``).

    ``prompt_scores``: a prompt step's scored rows (``deepinfer.prompt_scoring``), read at
    launch; None when the step scored none.

    ``pooled``: float32 ``[P, hidden_size]`` on the host, the final-normed hidden rows of
    the samples ``launch`` was asked to pool (embedding requests), read at launch; None
    when it pooled none."""

    def __init__(self, ids: torch.Tensor | None, logprobs: list | TokenLogprobs | None,
                 host: torch.Tensor | None = None, event: torch.cuda.Event | None = None,
                 *, pending: Callable[[], SampledTokens] | None = None,
                 prompt_scores: Any = None) -> None:
        self._ids = ids
        self._host = host
        self._event = event
        self.logprobs = logprobs
        self._pending = pending
        self.prompt_scores = prompt_scores
        self.pooled: torch.Tensor | None = None

    @classmethod
    def deferred(cls, pending: Callable[[], SampledTokens]) -> SampledTokens:
        """A step whose forward is enqueued and whose sampling waits for
        ``finish_sampling()``."""
        return cls(None, None, pending=pending)

    @property
    def sampling_pending(self) -> bool:
        """Whether the sampling still waits for ``finish_sampling()``."""
        return self._pending is not None

    def finish_sampling(self) -> None:
        """Enqueue the deferred sampling (nothing when it is enqueued already)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            done = pending()
            self._ids, self._host, self._event = done._ids, done._host, done._event
            self.logprobs = done.logprobs

    def result(self) -> tuple[list[int], list | None]:
        """The sampled ids (one per sample, sample order) and logprobs (or None)."""
        self.finish_sampling()
        if self._event is not None:
            self._event.synchronize()
        logprobs = self.logprobs
        if isinstance(logprobs, TokenLogprobs):  # read now that its copy has landed
            logprobs = logprobs.lists()
        if self._ids is None:
            return [], logprobs
        return (self._host if self._event is not None else self._ids).tolist(), logprobs
