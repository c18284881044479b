"""Batched token sampling on the device.

One ``Sampler.sample`` call turns the logits of every sample of a step into token ids:

1. logprobs (optional) of the raw logits, like vLLM's default;
2. steering (``logit_bias``, ``allowed_token_ids``, single-token ``bad_words``) from the
   per-slot rows of ``steering.SteeringTable``;
3. repetition penalty (HF), presence/frequency penalty (OpenAI) from per-slot state;
4. banned ids (EOS / stop ids of samples still under ``min_tokens``) -> -inf, unless
   that leaves a row nothing (a grammar that can only end): the end wins there;
5. greedy rows: argmax here; other rows: temperature, top-k, top-p, min-p, then one
   uniform per row inverted through the row's cumulative distribution, an exact draw
   from ``p`` (the ops' ``sample_tokens`` / ``sample_tokens_filtered``: one C call on
   the CPU, one fused kernel after the torch filters on a GPU). Seeded rows take
   their uniform from ``table.seeded_uniforms`` (host, counter-based), the
   others from one batched ``torch.rand``.

Everything is batched: no per-row launches, no host sync. Penalty state lives in
state-slot tensors owned by the engine (``make_state``); the engine zeroes a new
sequence's slot (``zero_states``) and copies a parent's slot into a forked child
(``clone_states``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.host_copy import to_device
from deepinfer.models.backend import KernelBackend
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.steering import StepSteering
from deepinfer.sampling.table import NO_SEED, SamplingRows, seeded_uniforms
from deepinfer.sampling.token_logprobs import TokenLogprobs
from deepinfer_kernels import reference

# Indices into the float rows of SamplingTensors.floats.
_TEMP, _TOP_P, _MIN_P, _REP, _PRES, _FREQ, _UNIFORM = range(7)


@dataclass
class SamplingTensors:
    """Per-step sampling parameters as device tensors plus host-side fast-path flags.

    ``floats`` ``[7, N]`` float32 (temperature, top_p, min_p, repetition, presence,
    frequency penalty, seeded uniform or NaN), ``top_k`` ``[N]`` int64 (``vocab`` where
    off), ``greedy`` ``[N]`` bool. ``banned_rows``/``banned_cols`` ``[B]`` int64 index the
    logits to set to -inf. ``logprobs`` (host, int64 ``[N]``, -1 = off). The flags come from
    the host rows, never from the device (no host sync). ``steering``: the rows'
    ``logit_bias`` / ``allowed_token_ids`` / bad-word rows (None: no row has any).
    """

    floats: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
    banned_rows: torch.Tensor | None
    banned_cols: torch.Tensor | None
    logprobs: np.ndarray
    all_greedy: bool
    any_greedy: bool
    any_seeded: bool
    all_seeded: bool
    do_repetition: bool
    do_presence_frequency: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    max_top_k: int
    max_logprobs: int  # -1 when no sample asked for logprobs
    steering: StepSteering | None = None

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
        steps: Sequence[int] | None = None,
        sample_indices: list[int] | None = None,
    ) -> SamplingTensors:
        """Tensors of ``params`` (one per sample). ``steps``: each sample's output index
        (its seeded stream's counter; default 0); ``sample_indices``: which of its
        request's ``n`` samples each row is (default 0)."""
        rows = SamplingRows.from_params(list(params), vocab_size, sample_indices)
        st = np.zeros(len(params), np.int64) if steps is None else np.asarray(steps, np.int64)
        return cls.from_rows(rows, st, vocab_size, device, banned_token_ids)

    @classmethod
    def from_rows(
        cls,
        rows: SamplingRows,
        steps: np.ndarray,
        vocab_size: int,
        device: torch.device | str,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """Tensors of ``rows`` (``steps``: int64 ``[N]`` output index of each row), with
        one host-to-device copy per tensor."""
        n = rows.top_k.shape[0]
        seeded = rows.seed_key != NO_SEED
        uniforms = np.full(n, np.nan, np.float32)
        if seeded.any():
            uniforms[seeded] = seeded_uniforms(rows.seed_key[seeded], steps[seeded])
        floats = np.concatenate([rows.floats, uniforms[None]], axis=0)
        b_rows: list[int] = []
        b_cols: list[int] = []
        for i, ids in enumerate(banned_token_ids or ()):
            for t in ids:
                if 0 <= t < vocab_size:
                    b_rows.append(i)
                    b_cols.append(int(t))
        device = torch.device(device)

        def put(t: torch.Tensor) -> torch.Tensor:
            return to_device(t, device)

        greedy = rows.greedy
        sampled = ~greedy
        k_sampled = rows.top_k[sampled]
        f = rows.floats
        return cls(
            floats=put(torch.from_numpy(floats)),
            top_k=put(torch.from_numpy(rows.top_k)),
            greedy=put(torch.from_numpy(greedy)),
            banned_rows=put(torch.tensor(b_rows, dtype=torch.int64)) if b_rows else None,
            banned_cols=put(torch.tensor(b_cols, dtype=torch.int64)) if b_rows else None,
            logprobs=rows.logprobs,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_seeded=bool(seeded[sampled].any()),
            all_seeded=bool(seeded[sampled].all()),
            do_repetition=bool((f[_REP] != 1.0).any()),
            do_presence_frequency=bool((f[_PRES] != 0.0).any() or (f[_FREQ] != 0.0).any()),
            # Filters only matter for rows that sample.
            do_top_k=bool((k_sampled < vocab_size).any()),
            do_top_p=bool((f[_TOP_P][sampled] < 1.0).any()),
            do_min_p=bool((f[_MIN_P][sampled] > 0.0).any()),
            max_top_k=int(k_sampled.max()) if k_sampled.size else vocab_size,
            max_logprobs=int(rows.logprobs.max()) if n else -1,
        )


class Sampler:
    """Sampling logic. The per-slot penalty state is passed to ``sample`` by the caller
    (the model runner owns it, so ``zero_states``/``clone_states`` maintain it).

    ``ops``: the kernel provider whose ``sample_tokens`` draws every sampled row (one
    fused kernel on a GPU): from the logits as they are when a row only scales by a
    temperature, after the torch filters when top-k/top-p/min-p are on; default
    ``deepinfer_kernels.reference`` (torch). ``generator``: where the uniforms of rows
    without a seed of their own come from (None: torch's global generator)."""

    def __init__(self, ops: KernelBackend | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.ops = reference if ops is None else ops
        self.generator = generator

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
        st: SamplingTensors,
        sample_slots: torch.Tensor | None = None,
        states: Sequence[torch.Tensor] | None = None,
        owned: bool = False,
        lazy_logprobs: bool = False,
    ) -> tuple[torch.Tensor, list[dict[int, float] | None] | TokenLogprobs | None]:
        """Sample one token per row.

        - ``logits`` ``[N, V]`` (float32, or anything castable): not modified, unless
          ``owned`` (the caller has no further use for it: the steps that work in place
          write into a float32 ``logits`` instead of a copy, 50 MB at 256 rows of a 49k
          vocabulary).
        - ``st``: the rows' parameters (``SamplingTensors.from_rows`` / ``from_params``).
        - ``sample_slots`` ``[N]`` int64: each row's state slot (for penalties).
        - ``states``: ``make_state``'s tensors; read only when a row uses penalties.

        Returns ``token_ids`` ``[N]`` int64 on the logits' device, and per row either
        ``{token_id: logprob}`` (top-``logprobs`` plus the sampled token, raw logits) or
        None, or None for the whole list when no row asked for logprobs. With
        ``lazy_logprobs`` that list comes as a ``TokenLogprobs`` still on the device (its
        ``lists()`` builds it), so the call reads nothing back from the device.
        """
        n = logits.shape[0]
        if st.top_k.shape[0] != n:
            raise ValueError(f"sample: {n} logit rows but {st.top_k.shape[0]} parameter rows")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device), None
        # Own copy in float32 when a step below works in place (greedy rows and the draws,
        # filtered or not, only read: no [N, V] copy, 50 MB at 256 rows of a 49k vocab).
        in_place = (st.do_repetition or st.do_presence_frequency
                    or st.banned_rows is not None or st.steering is not None)
        logits = logits.to(torch.float32, copy=in_place and not owned)

        raw_logprobs = torch.log_softmax(logits, dim=-1) if st.max_logprobs >= 0 else None

        if st.steering is not None:
            st.steering.apply(logits)
        if st.do_repetition or st.do_presence_frequency:
            if states is None or sample_slots is None:
                raise ValueError("sample: penalties requested but no sampler state given")
            self._apply_penalties(logits, sample_slots, states, st)
        if st.banned_rows is not None:
            self._ban(logits, st.banned_rows, st.banned_cols)

        if st.all_greedy:
            token_ids = argmax_rows(logits)
        else:
            # Greedy rows' argmax before the filters, which may drop one of several tied
            # top tokens (top-p's sort order), changing which index argmax returns.
            greedy_ids = argmax_rows(logits) if st.any_greedy else None
            token_ids = self._sample_random(logits, st)
            if greedy_ids is not None:
                token_ids = torch.where(st.greedy, greedy_ids, token_ids)

        if raw_logprobs is None:
            return token_ids, None
        logprobs = gather_logprobs(raw_logprobs, token_ids, st.logprobs, st.max_logprobs)
        return token_ids, logprobs if lazy_logprobs else logprobs.lists()

    # ------------------------------------------------------------------ steps
    @staticmethod
    def _ban(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """-inf at ``(rows, cols)`` (``[B]`` int64 each), in place, except in a row that
        the ban would leave with nothing to draw: a grammar that can only end (its mask
        allows stop tokens alone) under ``min_tokens``. There the end wins, so the row
        draws a stop token, not index 0 of an all -inf row. Device ops only."""
        # The value made on the device (a fill kernel): a Python scalar becomes a CPU
        # tensor that index_put_ copies over with a blocking copy (a stream sync).
        ninf = logits.new_full((), float("-inf"))
        kept = logits[rows, cols]
        logits.index_put_((rows, cols), ninf)
        emptied = logits.amax(dim=-1).isneginf()
        logits.index_put_((rows, cols), torch.where(emptied[rows], kept, ninf))

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

    def _sample_random(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Temperature, filters, then inverse-CDF sampling with one uniform per row, by
        the ops (one C call on the CPU, the torch filters and one kernel on a GPU); greedy
        rows get garbage (replaced by the caller). ``logits`` is not modified."""
        uniform = st.floats[_UNIFORM]
        if not st.all_seeded:
            fresh = torch.rand(uniform.shape, device=uniform.device,
                               generator=self.generator)
            uniform = torch.where(uniform.isnan(), fresh, uniform) if st.any_seeded else fresh
        if not (st.do_top_k or st.do_top_p or st.do_min_p):
            return self.ops.sample_tokens(logits, st.temperatures, uniform)
        return self.ops.sample_tokens_filtered(
            logits, st.temperatures, uniform,
            top_k=st.top_k if st.do_top_k else None,
            top_p=st.top_p if st.do_top_p else None,
            min_p=st.min_p if st.do_min_p else None,
            max_top_k=st.max_top_k)


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                    wanted: np.ndarray, k: int) -> TokenLogprobs:
    """The sampled tokens' logprobs and the top-``k`` of ``raw`` (``[N, V]`` float32
    logprobs; ``token_ids`` ``[N]`` int64; ``wanted`` host ``[N]``, -1 = none), on the
    device."""
    sampled = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    k = min(k, raw.shape[-1])
    top_vals, top_ids = raw.topk(k, dim=-1) if k > 0 else (None, None)
    return TokenLogprobs(token_ids, sampled, top_vals, top_ids, wanted)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[N, V]`` float -> ``[N]`` int64 index of each row's maximum (the first
    one on ties, NaN counting as the maximum: ``torch.argmax``'s rules).

    A contiguous fp32 CPU tensor goes through numpy, whose argmax is vectorised: 7x
    faster than torch's at 256 x 290 and 2x at 256 x 49152 (14 ms a step there)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] > 0):
        return torch.from_numpy(logits.numpy().argmax(axis=1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)
