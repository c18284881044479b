"""Sampling: what a request asks for, and how a step's logits become token ids.

``params`` (``SamplingParams``: per-request options, validated), ``table`` (the per-slot
rows written when a sample gets its state slot, and the counter-based streams of seeded
samples), ``step_sampling`` (the tokens of this step's admitted sequences, for their
penalty state), ``steering`` (``logit_bias`` / ``allowed_token_ids`` / ``bad_words``
resolved per request, and their per-slot rows on the device), ``sampler`` (``Sampler``:
steering, penalties, bans, filters and the draw, batched on the device),
``sampled_tokens`` (a launched step's ids on their way to the host)."""

from deepinfer.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
