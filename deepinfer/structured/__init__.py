"""Structured output (JSON schema, regex, choice, EBNF grammar) with xgrammar.

``params`` (what a request asks for; no xgrammar import), ``grammar`` (tokenizer info,
grammar building, the compile cache and its thread pool), ``matchers`` (the engine's
per-sample matchers and step bitmask), ``bitmask`` (applying it to the logits)."""

from deepinfer.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
