"""Batched token sampling on the device.

One ``Sampler.sample`` call turns the logits of every sample of a step into token ids:

1. logprobs (optional) of the raw logits, like vLLM's default;
2. repetition penalty (HF), presence/frequency penalty (OpenAI) from per-slot state;
3. banned ids (EOS / stop ids of samples still under ``min_tokens``) -> -inf;
4. greedy rows: argmax here; other rows: temperature, top-k, top-p, min-p, then an
   exponential race ``argmax(p / Exp(1))``, which is an exact draw from ``p``.

Everything is batched; the only per-row Python loop draws the noise of seeded rows from
their own generator, so a seeded sample does not depend on the rest of the batch.

Penalty state lives in state-slot tensors owned by the engine (``make_state``); the
engine zeroes a new sequence's slot (``zero_states``) and copies a parent's slot into a
forked child (``clone_states``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling_params import GREEDY_EPS, SamplingParams

# Indices into the float rows of SamplingTensors.floats.
_TEMP, _TOP_P, _MIN_P, _REP, _PRES, _FREQ = range(6)


@dataclass
class SamplingTensors:
    """Per-step sampling parameters as device tensors plus host-side fast-path flags.

    ``floats`` ``[6, N]`` float32 (temperature, top_p, min_p, repetition, presence,
    frequency penalty), ``top_k`` ``[N]`` int64 (``vocab`` where off), ``greedy`` ``[N]``
    bool. ``banned_rows``/``banned_cols`` ``[B]`` int64 index the logits to set to -inf.
    The flags come from the Python params, never from the device (no host sync).
    """

    floats: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
    banned_rows: torch.Tensor | None
    banned_cols: torch.Tensor | None
    all_greedy: bool
    any_greedy: bool
    do_repetition: bool
    do_presence_frequency: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    max_top_k: int
    max_logprobs: int  # -1 when no sample asked for logprobs

    @property
    def temperatures(self) -> torch.Tensor:
        return self.floats[_TEMP]

    @property
    def top_p(self) -> torch.Tensor:
        return self.floats[_TOP_P]

    @property
    def min_p(self) -> torch.Tensor:
        return self.floats[_MIN_P]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """Pack ``params`` (one per sample) into tensors with one host-to-device copy each."""
        n = len(params)
        greedy = [p.temperature < GREEDY_EPS for p in params]
        # Greedy rows never use their temperature; 1.0 keeps the division harmless.
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        floats = torch.tensor(
            [temps,
             [float(p.top_p) for p in params],
             [float(p.min_p) for p in params],
             [float(p.repetition_penalty) for p in params],
             [float(p.presence_penalty) for p in params],
             [float(p.frequency_penalty) for p in params]],
            dtype=torch.float32,
        ).reshape(6, n)
        rows: list[int] = []
        cols: list[int] = []
        for i, ids in enumerate(banned_token_ids or ()):
            for t in ids:
                if 0 <= t < vocab_size:
                    rows.append(i)
                    cols.append(int(t))
        device = torch.device(device)
        pin = device.type == "cuda"

        def put(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        sampled = [p for p, g in zip(params, greedy) if not g]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            floats=put(floats),
            top_k=put(torch.tensor(top_k, dtype=torch.int64)),
            greedy=put(torch.tensor(greedy, dtype=torch.bool)),
            banned_rows=put(torch.tensor(rows, dtype=torch.int64)) if rows else None,
            banned_cols=put(torch.tensor(cols, dtype=torch.int64)) if rows else None,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            do_repetition=any(p.repetition_penalty != 1.0 for p in params),
            do_presence_frequency=any(
                p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params
            ),
            # Filters only matter for rows that sample.
            do_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            do_top_p=any(p.top_p < 1.0 for p in sampled),
            do_min_p=any(p.min_p > 0.0 for p in sampled),
            max_top_k=max((k for k, g in zip(top_k, greedy) if not g), default=vocab_size),
            max_logprobs=max(logprobs, default=-1),
        )


class Sampler:
    """Sampling logic. The per-slot penalty state is passed to ``sample`` by the caller
    (the model runner owns it, so ``zero_states``/``clone_states`` maintain it)."""

    @staticmethod
    def make_state(max_num_seqs: int, vocab_size: int,
                   device: torch.device | str) -> list[torch.Tensor]:
        """Per-slot penalty state, slot = dim 0, zero = empty sequence.

        ``[output_counts int32 [max_num_seqs, vocab], prompt_mask bool [max_num_seqs,
        vocab]]``: how often each token was generated, and whether it is in the prompt.
        """
        return [
            torch.zeros(max_num_seqs, vocab_size, dtype=torch.int32, device=device),
            torch.zeros(max_num_seqs, vocab_size, dtype=torch.bool, device=device),
        ]

    @staticmethod
    def record_prompt_tokens(states: Sequence[torch.Tensor], token_ids: torch.Tensor,
                             token_slots: torch.Tensor) -> None:
        """Mark prompt tokens: ``token_ids`` ``[T]`` int64 of the sequences in
        ``token_slots`` ``[T]`` int64 (one slot per token). No host sync."""
        if token_ids.numel() == 0:
            return
        mask = states[1]
        ones = torch.ones((), dtype=torch.bool, device=mask.device).expand(token_ids.shape)
        mask.index_put_((token_slots.long(), token_ids.long()), ones)

    @staticmethod
    def record_output_tokens(states: Sequence[torch.Tensor], token_ids: torch.Tensor,
                             slots: torch.Tensor) -> None:
        """Count generated tokens: ``token_ids`` ``[N]`` int64 sampled for ``slots``
        ``[N]`` int64. No host sync."""
        if token_ids.numel() == 0:
            return
        counts = states[0]
        ones = torch.ones((), dtype=counts.dtype, device=counts.device).expand(token_ids.shape)
        # accumulate=True: duplicates (same slot and token) must add up, not overwrite.
        counts.index_put_((slots.long(), token_ids.long()), ones, accumulate=True)

    def sample(
        self,
        logits: torch.Tensor,
        sample_slots: torch.Tensor,
        states: Sequence[torch.Tensor] | None = None,
        params: Sequence[SamplingParams] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, list[dict[int, float] | None] | None]:
        """Sample one token per row.

        - ``logits`` ``[N, V]`` (float32, or anything castable): not modified.
        - ``sample_slots`` ``[N]`` int64: each row's state slot (for penalties).
        - ``states``: ``make_state``'s tensors; read only when a row uses penalties.
        - ``params`` / ``generators``: one per row; a row with a generator draws its
          noise from it (seeded, batch-independent), others share one batched draw.
          ``generators=None``: no row is seeded.
        - ``banned_token_ids``: per row, token ids that must not be sampled (stop ids of
          a sample below ``min_tokens``).

        Returns ``token_ids`` ``[N]`` int64 on the logits' device, and per row either
        ``{token_id: logprob}`` (top-``logprobs`` plus the sampled token, raw logits) or
        None, or None for the whole list when no row asked for logprobs.
        """
        n, vocab = logits.shape
        params = [] if params is None else params
        generators = [None] * n if generators is None else generators
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"sample: {n} logit rows but {len(params)} params / "
                f"{len(generators)} generators"
            )
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device), None
        st = SamplingTensors.from_params(params, vocab, logits.device, banned_token_ids)
        # Own copy in float32: the filters below work in place.
        logits = logits.to(torch.float32, copy=True)

        raw_logprobs = torch.log_softmax(logits, dim=-1) if st.max_logprobs >= 0 else None

        if st.do_repetition or st.do_presence_frequency:
            if states is None:
                raise ValueError("sample: penalties requested but no sampler state given")
            self._apply_penalties(logits, sample_slots, states, st)
        if st.banned_rows is not None:
            logits.index_put_((st.banned_rows, st.banned_cols),
                              torch.tensor(float("-inf"), device=logits.device))

        if st.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, st, generators)
            if st.any_greedy:
                # The filters keep each row's top token, so the argmax of the filtered
                # logits equals the argmax of the penalized ones.
                token_ids = torch.where(st.greedy, logits.argmax(dim=-1), token_ids)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, token_ids, params, st.max_logprobs)
        return token_ids, logprobs

    # ------------------------------------------------------------------ steps
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, slots: torch.Tensor,
                         states: Sequence[torch.Tensor], st: SamplingTensors) -> None:
        """In place on ``logits`` ``[N, V]``; reads the rows ``slots`` of the state."""
        slots = slots.long()
        counts = states[0].index_select(0, slots)  # [N, V] int32
        seen_out = counts > 0
        if st.do_repetition:
            rep = st.floats[_REP].unsqueeze(1)
            seen = seen_out | states[1].index_select(0, slots)
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            torch.where(seen, penalized, logits, out=logits)
        if st.do_presence_frequency:
            logits -= st.floats[_FREQ].unsqueeze(1) * counts
            logits -= st.floats[_PRES].unsqueeze(1) * seen_out

    def _sample_random(self, logits: torch.Tensor, st: SamplingTensors,
                       generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Temperature, filters, exponential race; greedy rows get garbage (replaced)."""
        logits.div_(st.temperatures.unsqueeze(1))
        if st.do_top_p:
            _top_k_top_p_sorted(logits, st.top_k if st.do_top_k else None, st.top_p)
        elif st.do_top_k:
            _top_k(logits, st.top_k, st.max_top_k)
        probs = torch.softmax(logits, dim=-1)
        if st.do_min_p:
            top = probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < st.min_p.unsqueeze(1) * top, 0.0)

        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < len(generators):
            noise.exponential_()
        for i in seeded:
            # A fresh [V] draw per step from the row's own generator: the stream (and so
            # the token) depends only on the seed and the step, not on the batch.
            noise[i] = torch.empty_like(probs[i]).exponential_(generator=generators[i])
        # Exp(1) can underflow to 0: 0/0 would be NaN and argmax picks NaN.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                         params: Sequence[SamplingParams],
                         k: int) -> list[dict[int, float] | None]:
        """Top-``k`` (max over rows) plus the sampled token's logprob; one host copy."""
        sampled = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        k = min(k, raw.shape[-1])
        if k > 0:
            top_vals, top_ids = raw.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        sampled_l, ids_l = sampled.tolist(), token_ids.tolist()
        out: list[dict[int, float] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            d = {ids_l[i]: sampled_l[i]}
            for j in range(min(p.logprobs, k)):
                d.setdefault(top_ids[i][j], top_vals[i][j])
            out.append(d)
        return out


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """Keep each row's ``top_k[i]`` largest logits (ties at the threshold survive)."""
    vals = logits.topk(max_k, dim=-1).values  # [N, max_k], descending
    kth = vals.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    # Rows with top-k off (k == vocab > max_k) keep everything.
    kth.masked_fill_((top_k > max_k).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor) -> None:
    """Top-k then top-p with one descending sort; rows with ``top_p`` 1 skip top-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        pos = torch.arange(vocab, device=logits.device)
        sorted_logits.masked_fill_(pos >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p; the first always stays.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
