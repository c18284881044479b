"""Embeddings (``LLM.embed``): a prompt's vector from the final-normed hidden state of its
last token, as decoder-only embedding models are trained to be read (Qwen3-Embedding,
gte-Qwen2, e5-mistral: "last-token pooling"), optionally cut to its first ``dimensions``
values (Matryoshka-trained models) and scaled to unit length.

Why the last token: a causal model's last position is the only one that has attended to
the whole prompt, so that is where these models put the sequence's meaning. The engine
runs an embedding request as a one-token generation whose token is dropped: its prompt
steps are ordinary prefill steps (chunked, prefix-cached, batched with generations), and
the hidden row the sampler reads is also copied out.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from deepinfer.pooling_config import LAST_TOKEN
from deepinfer.sampling.params import SamplingParams

__all__ = ["EMBED_SAMPLING", "PoolingParams", "embedding_params", "pool_embedding"]


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt's embedding is made from its last token's hidden state.

    - ``dimensions``: keep the first ``dimensions`` values (None: all ``hidden_size``);
      meaningful for Matryoshka-trained models such as Qwen3-Embedding.
    - ``normalize``: scale the (cut) vector to unit L2 norm, so that a dot product is the
      cosine similarity (sentence-transformers' ``Normalize`` module; on by default, as
      these models are used).
    """

    dimensions: int | None = None
    normalize: bool = True

    def validate(self, hidden_size: int | None = None) -> None:
        """``ValueError`` naming the field when a value is not allowed (``hidden_size``:
        the model's, the most ``dimensions`` may be)."""
        d = self.dimensions
        if d is not None:
            if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
                raise ValueError(f"dimensions={d!r}: must be a positive integer or None")
            if hidden_size is not None and d > hidden_size:
                raise ValueError(f"dimensions={d}: the model's embeddings have "
                                 f"{hidden_size} (hidden_size)")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize={self.normalize!r}: must be True or False")


def pool_embedding(hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """One prompt's embedding: ``hidden`` float32 ``[H]`` (its last token's final-normed
    hidden state) -> ``dimensions`` (or ``H``) floats, unit length with ``normalize``."""
    v = hidden.float()
    if params.dimensions is not None:
        v = v[: params.dimensions]
    if params.normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v.tolist()


#: What an embedding request runs with: one greedy token, dropped (its prompt step is
#: what matters; the scheduler and sampler need a token to end the sequence on).
EMBED_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


def embedding_params(request_id: str, pooling: PoolingParams, hidden_size: int,
                     hands_off: bool = False, model_pooling: str | None = None
                     ) -> SamplingParams:
    """What an embedding request runs with (``EMBED_SAMPLING``), once ``pooling`` is
    checked against the model's ``hidden_size``; ``ValueError`` naming the request and
    the field otherwise, when the engine would hand it off (``hands_off``: a PROMPT
    engine of a disaggregated run, whose decode side never sees the prompt step), or
    when the checkpoint names a pooling other than the last token (``model_pooling``,
    ``ModelConfig.pooling``)."""
    try:
        pooling.validate(hidden_size)
    except ValueError as e:
        raise ValueError(f"request {request_id!r}: {e}") from None
    if model_pooling not in (None, LAST_TOKEN):
        raise ValueError(f"request {request_id!r}: this model's files pool its embeddings "
                         f"by {model_pooling}; LLM.embed reads the last token only")
    if hands_off:
        raise ValueError(f"request {request_id!r}: an embedding request cannot run on a "
                         "prefill/decode split (PROMPT engine)")
    return EMBED_SAMPLING
