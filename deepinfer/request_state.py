"""Host-side state of the requests an engine is running: per sample, its sequence, the
incremental detokenizer when stop strings need the text while generating, and the
logprobs.

``SequenceExport`` is what moves with a sequence when a PROMPT engine hands it to a
COMPLETION engine: everything needed to rebuild this host state on the other side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.detokenizer import IncrementalDetokenizer, decode_once
from deepinfer.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from deepinfer.pooling import PoolingParams, pool_embedding
from deepinfer.prompt_scoring import PromptScores
from deepinfer.reasoning import split_reasoning
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.steering import Steering
from deepinfer_scheduler import Sequence
from deepinfer_scheduler.prompt_scores import ScoreRows


@dataclass
class SampleState:
    """Host-side state of one output sequence (one of a request's ``n`` samples).

    ``seq``: its scheduler ``Sequence`` (the token ids live there). ``detok``: an
    incremental detokenizer when the text is needed while generating (stop strings);
    None when the text is decoded once, at the end. ``logprobs``: one dict per token when
    requested."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None

    @property
    def watched(self) -> bool:
        """Whether each of its tokens needs host work during the step."""
        return self.detok is not None or self.logprobs is not None


@dataclass
class RequestState:
    """One request: its prompt, sampling parameters, stop ids (EOS included unless
    ``ignore_eos``) and the state of each sample started so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    samples: dict[int, SampleState] = field(default_factory=dict)
    num_finished: int = 0
    #: With ``params.prompt_logprobs``: None for the first prompt token, then one entry per
    #: prompt token scored so far (in order); else None.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    #: False when the chat template was told ``enable_thinking: false``.
    thinking: bool = True
    #: ``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` resolved (None: none).
    steering: Steering | None = None
    #: An embedding request (``LLM.embed``): how its vector is made; None for generation.
    pooling: PoolingParams | None = None
    #: Its vector, once its last prompt step ran.
    embedding: list[float] | None = None
    #: The ``lora_int_id`` of its LoRA adapter (``deepinfer.lora``); 0: none.
    lora: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    def start_sample(self, seq: Sequence, tokenizer: Any) -> tuple[SampleState, bool]:
        """The state of ``seq``'s sample, created when the sample starts (a preempted
        sample keeps its state). Returns it and whether it was created now."""
        st = self.samples.get(seq.sample_index)
        if st is not None:
            st.seq = seq
            return st, False
        p = self.params
        stop = p.stop_list()
        detok = None
        if stop:
            detok = IncrementalDetokenizer(tokenizer, self.prompt_token_ids,
                                           skip_special_tokens=p.skip_special_tokens,
                                           stop=stop, min_tokens=p.min_tokens,
                                           include_stop=p.include_stop_str_in_output)
        st = SampleState(seq, detok, [] if p.logprobs is not None else None)
        self.samples[seq.sample_index] = st
        return st, True

    def output(self, tokenizer: Any, reasoning_parser: str | None = None,
               error: str | None = None) -> RequestOutput | EmbeddingRequestOutput:
        """The finished request's ``RequestOutput`` (``EmbeddingRequestOutput`` for an
        embedding request). ``max_tokens=0`` (scored only): the
        prompt step's token is dropped. ``reasoning_parser``: each text's reasoning split
        from its answer (``deepinfer.reasoning``). ``error``: why it failed while
        running (its outputs are then partial)."""
        if self.pooling is not None:
            if self.embedding is None and error is None:
                error = "no embedding: the request ended before its prompt was run"
            return EmbeddingRequestOutput(self.request_id, self.prompt,
                                          self.prompt_token_ids,
                                          EmbeddingOutput(self.embedding or []), error=error)
        keep = self.params.max_tokens
        outs = []
        for i, st in sorted(self.samples.items()):
            text = self.text_of(st, tokenizer) if keep else ""
            reasoning = None
            if reasoning_parser is not None:
                reasoning, text = split_reasoning(text, reasoning_parser, self.thinking)
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=st.seq.output_token_ids[:keep],
                finish_reason=st.finish_reason if keep else "length",
                logprobs=None if st.logprobs is None else st.logprobs[:keep],
                stop_reason=self.stop_reason_of(st) if keep else None, reasoning=reasoning))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outs,
                             finished=True, prompt_logprobs=self.prompt_logprobs,
                             error=error)

    def stop_reason_of(self, st: SampleState) -> str | int | None:
        """What stopped a sample, as vLLM reports it: the stop string that matched, or the
        ``stop_token_ids`` entry it sampled; None for EOS, a length limit or a grammar."""
        if st.detok is not None and st.detok.stopped:
            return st.detok.stop_reason
        ids = st.seq.output_token_ids
        if (st.finish_reason == "stop" and ids
                and ids[-1] in (self.params.stop_token_ids or ())):
            return ids[-1]
        return None

    def text_of(self, st: SampleState, tokenizer: Any) -> str:
        """The final text of a sample: the incremental one, or its tokens decoded once
        (the stop token that ended it left out, as the incremental path does)."""
        if st.detok is not None:
            return st.detok.text
        ids = st.seq.output_token_ids
        if st.finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return decode_once(tokenizer, self.prompt_token_ids, ids,
                           skip_special_tokens=self.params.skip_special_tokens)


@dataclass
class SequenceExport:
    """A prefilled sequence leaving its engine (n = 1 only): what the receiving engine
    needs besides the KV blocks and state rows (``ModelRunner.export_kv``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    num_blocks: int
    prompt_logprobs: list[dict[int, float] | None] | None = None
    thinking: bool = True


def fit_to_model_len(request_id: str, prompt_len: int, p: SamplingParams,
                     max_model_len: int) -> SamplingParams:
    """``p`` with ``max_tokens`` cut to what ``max_model_len`` leaves after the prompt
    (as vLLM does: the output then ends with ``"length"``); ``ValueError`` naming the
    request when the prompt leaves no room, or less than ``min_tokens``."""
    room = max_model_len - prompt_len
    if room < max(1, p.min_tokens):
        need = f"min_tokens ({p.min_tokens})" if room >= 1 else "one generated token"
        raise ValueError(f"request {request_id!r}: prompt ({prompt_len} tokens) + {need} "
                         f"exceeds max_model_len={max_model_len}")
    return p if p.max_tokens <= room else p.replace(max_tokens=room)


@dataclass
class AdmissionLimits:
    """What a new request must fit to be admitted: the engine's ``max_model_len`` and, on
    a PROMPT engine of a disaggregated run, the COMPLETION engines it hands sequences to
    (``hand_off``), so that a request no decode side could hold fails at once instead of
    waiting forever for credits."""

    max_model_len: int
    decode_model_len: int | None = None
    decode_blocks: int | None = None
    # KV blocks a handed-off sequence may need (prompt length, max_tokens -> blocks).
    blocks_needed: Callable[[int, int], int] | None = None

    def hand_off(self, max_model_len: int, max_blocks: int,
                 blocks_needed: Callable[[int, int], int]) -> None:
        """Also fit the largest decode side: ``max_model_len`` positions, ``max_blocks``
        KV blocks."""
        self.decode_model_len, self.decode_blocks = max_model_len, max_blocks
        self.blocks_needed = blocks_needed

    def fit(self, request_id: str, prompt_len: int, p: SamplingParams) -> SamplingParams:
        """``p`` cut to the shortest model length on the way (``fit_to_model_len``);
        ``ValueError`` naming the request when it can never fit."""
        max_len = self.max_model_len
        if self.decode_model_len is not None:
            max_len = min(max_len, self.decode_model_len)
        p = fit_to_model_len(request_id, prompt_len, p, max_len)
        if self.decode_blocks is not None and self.blocks_needed is not None:
            need = self.blocks_needed(prompt_len, p.max_tokens)
            if need > self.decode_blocks:
                raise ValueError(
                    f"request {request_id!r}: prompt + max_tokens needs {need} KV blocks; "
                    f"no decode rank has that many ({self.decode_blocks} blocks)")
        return p


def prompt_score_k(requests: dict[str, RequestState], rows: ScoreRows) -> int:
    """The most top logprobs any request scored in a prompt step asks for."""
    ks = [req.params.prompt_logprobs for seq, _, _ in rows.owners
          if (req := requests.get(seq.request_id)) is not None]
    return max((k for k in ks if k is not None), default=0)


def record_embeddings(requests: dict[str, RequestState], request_ids: list[str],
                      rows: torch.Tensor | None) -> None:
    """Give each embedding request of a step its vector: ``rows`` float32 ``[P, H]``
    (``SampledTokens.pooled``), one per id in ``request_ids`` (an aborted one skipped)."""
    if rows is None:
        return
    for rid, row in zip(request_ids, rows):
        req = requests.get(rid)
        if req is not None and req.pooling is not None:
            req.embedding = pool_embedding(row, req.pooling)


def record_prompt_scores(requests: dict[str, RequestState], rows: ScoreRows,
                         scores: PromptScores) -> None:
    """Append each scored row's entry (``{token: logprob}``: the prompt token it scores,
    then its request's top ``prompt_logprobs``) to its request's ``prompt_logprobs``. A
    request no longer here (aborted) is skipped."""
    targets = rows.targets.tolist()
    r = 0
    for seq, first, count in rows.owners:
        req = requests.get(seq.request_id)
        if req is not None and req.prompt_logprobs is not None:
            if len(req.prompt_logprobs) != first + 1:  # the scheduler scores in order, once
                raise RuntimeError(f"request {seq.request_id!r}: prompt position {first} "
                                   f"scored after {len(req.prompt_logprobs) - 1} positions")
            req.prompt_logprobs += scores.entries(r, targets[r:r + count],
                                                  req.params.prompt_logprobs)
        r += count


def watch_sample_tokens(watched: dict[int, tuple[RequestState, SampleState]],
                        sample_seqs: list[Sequence], token_ids: list[int],
                        logprobs: list | None, finished_seqs: list[Sequence],
                        dropped: set[int], finish_sequence: Callable[[int, str], object]
                        ) -> None:
    """A step's host work per token, for the samples that asked for it (``watched``, by
    seq id): logprobs and stop strings. A stop string that matches ends its sequence
    (``finish_sequence(seq_id, "stop")``, appended to ``finished_seqs``). ``dropped``:
    seq ids whose token the step did not apply (they had ended)."""
    for i, seq in enumerate(sample_seqs):
        entry = watched.get(seq.seq_id)
        if entry is None or seq.seq_id in dropped:
            continue
        req, st = entry
        tok = token_ids[i]
        if st.logprobs is not None and logprobs is not None:
            st.logprobs.append(logprobs[i])
        if st.detok is None:
            continue
        if tok in req.stop_token_ids and seq.finish_reason == "stop":
            continue  # the stop token itself is not part of the text
        st.detok.add(tok)
        if st.detok.stopped and seq.finish_reason is None:
            finish_sequence(seq.seq_id, "stop")
            finished_seqs.append(seq)
        elif st.detok.stopped and seq.finish_reason == "length":
            # The last allowed token completed a stop string: the text ends there, so
            # the reason is the stop string (as vLLM reports it).
            seq.finish_reason = "stop"
