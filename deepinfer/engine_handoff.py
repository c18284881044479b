"""The prefill/decode hand-off side of ``LLMEngine`` (``deepinfer.distributed.pd``): a
PROMPT engine describes each sequence it hands off, a COMPLETION engine admits it. A base
class of the engine, kept apart: the rest of the engine never calls it."""

from __future__ import annotations

from deepinfer.request_state import RequestState, SequenceExport
from deepinfer.sampling.steering import resolve_steering
from deepinfer_scheduler import Sequence


class SequenceHandoff:
    """``LLMEngine``'s hand-off methods (they use its requests, scheduler, tokenizer and
    per-sample bookkeeping)."""

    def export_sequence(self, seq: Sequence) -> SequenceExport:
        """Describe a handed-off sequence (``Scheduler.take_handoffs``) for another
        engine; its KV blocks and state row travel separately (``runner.export_kv``)."""
        req = self.requests[seq.request_id]
        st = req.samples[seq.sample_index]
        return SequenceExport(
            request_id=seq.request_id, prompt=req.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids), params=req.params,
            stop_token_ids=sorted(req.stop_token_ids),
            logprobs=st.logprobs, num_blocks=len(seq.blocks),
            prompt_logprobs=req.prompt_logprobs, thinking=req.thinking,
        )

    def release_exported(self, seq: Sequence) -> None:
        """Forget a sequence whose transfer completed: its blocks and slot are freed and
        its request leaves this engine."""
        self.scheduler.release_handoff(seq.seq_id)
        self._forget(self.requests.pop(seq.request_id, None))

    def import_sequence(self, exp: SequenceExport) -> Sequence | None:
        """Admit a sequence exported by another engine: scheduler blocks and slot, and the
        host state (detokenizer fed the tokens so far, logprobs, its sampling row). The
        caller fills its blocks and slot (``runner.import_kv``) before the next step.
        Returns None, changing nothing, when there is no room (credits)."""
        params = exp.params
        seq = self.scheduler.add_prefilled(
            exp.request_id, exp.prompt_token_ids, exp.output_token_ids, params.max_tokens,
            stop_token_ids=exp.stop_token_ids, min_tokens=params.min_tokens)
        if seq is None:
            return None
        req = RequestState(exp.request_id, exp.prompt, list(exp.prompt_token_ids), params,
                           frozenset(exp.stop_token_ids), prompt_logprobs=exp.prompt_logprobs,
                           thinking=exp.thinking,
                           steering=resolve_steering(exp.request_id, params, self.tokenizer,
                                                     self.model_config.vocab_size))
        self.requests[exp.request_id] = req
        self._watch_masks(req, exp.stop_token_ids, park=False)
        st = self._start_sample(req, seq)
        if st.logprobs is not None and exp.logprobs:
            st.logprobs.extend(exp.logprobs)
        if st.detok is not None:
            # As step() did on the exporting engine: the sequence is not finished, so
            # every token went through the detokenizer.
            for t in exp.output_token_ids:
                st.detok.add(t)
        self.stats.num_requests += 1
        return seq
