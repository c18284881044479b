"""OpenAI batch lines for ``/v1/embeddings``: the request body read into the prompt (a
string, or token ids) and its ``PoolingParams``, and the response body made from an
``EmbeddingRequestOutput``.

One input per line, as for completions: ``input`` is a string, a list of token ids, or a
list holding exactly one of those (OpenAI's API takes several; a batch line here is one
request, one output line). ``dimensions`` cuts the vector (then unit-normed, as OpenAI's
``text-embedding-3`` models do). ``encoding_format`` ``"base64"`` gives the float32 values'
little-endian bytes in base64, as OpenAI's API and SDKs read them.
"""

from __future__ import annotations

import base64
import numbers
import struct
from typing import Any

from deepinfer.pooling import PoolingParams

__all__ = ["EMBEDDINGS_URL", "embedding_body_fields", "embedding_response_body"]

EMBEDDINGS_URL = "/v1/embeddings"
# Accepted and without effect on one offline engine.
_IGNORED = {"model", "user"}
_ENCODINGS = ("float", "base64")


def embedding_body_fields(body: dict[str, Any]
                          ) -> tuple[str | None, list[int] | None, PoolingParams, str]:
    """``(prompt, prompt_token_ids, pooling, encoding_format)`` of an embeddings body
    (exactly one of the first two set); ``ValueError`` naming ``body.<field>`` when it is
    missing, malformed or unknown. A field given as null is taken as absent."""
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - _IGNORED - {"input", "dimensions", "encoding_format"})
    if unknown:
        raise ValueError(f"body.{unknown[0]}: unknown field")
    inp = body.get("input")
    if isinstance(inp, list) and len(inp) == 1 and isinstance(inp[0], (str, list)):
        inp = inp[0]
    prompt = ids = None
    if isinstance(inp, str) and inp:
        prompt = inp
    elif isinstance(inp, list) and inp and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in inp):
        ids = [int(t) for t in inp]
    else:
        raise ValueError("body.input: must be a non-empty string or list of token ids "
                         "(one input per line)")
    fmt = body.get("encoding_format", "float")
    if fmt not in _ENCODINGS:
        raise ValueError(f"body.encoding_format: {fmt!r}, expected one of "
                         f"{', '.join(_ENCODINGS)}")
    pooling = PoolingParams(dimensions=body.get("dimensions"))
    try:
        pooling.validate()
    except ValueError as e:
        raise ValueError(f"body.{e}") from None
    return prompt, ids, pooling, fmt


def embedding_response_body(res: Any, model: str, encoding_format: str) -> dict[str, Any]:
    """The ``list`` body of one finished embedding request (``EmbeddingRequestOutput``):
    one ``embedding`` object (floats, or base64 of float32 little-endian), with usage."""
    vec = res.outputs.embedding
    data: Any = vec
    if encoding_format == "base64":
        data = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    n = len(res.prompt_token_ids or ())
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": data}],
            "usage": {"prompt_tokens": n, "total_tokens": n}}
