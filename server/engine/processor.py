"""Turns a sequence's newly recorded token into its stream chunk: stop checks, detokenizing, timings."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.model.text.detokenizer import make_detokenizer
from lmserve.model.text.tokenizer import Tokenizer

from .outputs import GenerationChunk, OutputState, Timings, TokenLogprob, Usage
from .request import FinishReason
from .sequence import Sequence
from .stopping import StopStringMatcher


@dataclass(frozen=True)
class StepOutput:
    """What a step produced for one sequence: its chunk (None when the request failed) and, if it
    is done, why. Delivered to the request's stream by the engine."""

    seq: Sequence
    chunk: GenerationChunk | None
    reason: FinishReason | None
    gap: float | None = None  # seconds since the sequence's previous token (None for its first)


class OutputProcessor:
    """Owns stops and detokenizing (the scheduler records tokens and retires sequences)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        _ = tokenizer.token_bytes  # built now (~0.1 s for 50k ids), not on the first request's first token
        self.eos_ids = frozenset(tokenizer.eos_ids)

    def on_token(self, seq: Sequence, token: int, logprob) -> tuple[GenerationChunk, FinishReason | None]:
        """The chunk for a newly recorded token, and the finish reason if the sequence is done.
        (A request never outgrows the context: validation bounds prompt + max_new_tokens by it.)"""
        if seq.output is None:
            seq.output = OutputState(make_detokenizer(self.tokenizer, seq.request.prompt_ids),
                                     StopStringMatcher(seq.request.params.stop))
        state = seq.output
        detok, stops = state.detokenizer, state.stops
        p = seq.request.params
        reason = None
        is_eos = token in self.eos_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            reason = FinishReason.EOS
            text = ""
        else:
            text = stops.push(detok.push(token))
            if stops.stopped:
                reason = FinishReason.STOP
                state.matched_stop = stops.matched
            elif len(seq.output_ids) >= p.max_new_tokens:
                reason = FinishReason.LENGTH
        if reason is not None and reason is not FinishReason.STOP:
            text += stops.push(detok.flush()) + stops.flush()
        lp = () if logprob is None else (TokenLogprob(token, logprob[0], logprob[1]),)
        return GenerationChunk(request_id=seq.request_id, text=text, token_ids=(token,), logprobs=lp), reason

    @staticmethod
    def final(seq: Sequence, reason: FinishReason, now: float, chunk: GenerationChunk | None = None,
              error: str | None = None) -> GenerationChunk:
        """The last chunk: carries the finish reason, usage and timings (and the final delta if any)."""
        arrival = seq.request.arrival
        timings = Timings(
            queue_seconds=(seq.first_scheduled or now) - arrival,
            time_to_first_token_seconds=(seq.first_token or now) - arrival,
            total_seconds=now - arrival,
        )
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids),
                      cached_prompt_tokens=seq.cached_prompt_tokens,
                      draft_tokens=seq.draft.drafted_total if seq.draft else 0,
                      accepted_draft_tokens=seq.draft.accepted_total if seq.draft else 0)
        base = chunk or GenerationChunk(request_id=seq.request_id)
        return GenerationChunk(request_id=seq.request_id, text=base.text, token_ids=base.token_ids,
                               logprobs=base.logprobs, finish_reason=reason, usage=usage, timings=timings,
                               error=error, matched_stop=seq.output.matched_stop if seq.output else None)
