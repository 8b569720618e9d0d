"""Turns a step's sampled tokens into stream chunks: record them, check stops, detokenize, fold timings."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lmserve.model.detokenizer import make_detokenizer
from lmserve.model.tokenizer import Tokenizer

from .outputs import GenerationChunk, Timings, TokenLogprob, Usage
from .request import FinishReason
from .sampler import SampleOutput
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SeqStatus
from .stopping import StopStringMatcher

log = logging.getLogger("lmserve.engine")


@dataclass(frozen=True)
class StepOutput:
    """What a step produced for one sequence: its chunk (None when the request failed) and, if it
    is done, why. Delivered to the request's stream by the engine."""

    seq: Sequence
    chunk: GenerationChunk | None
    reason: FinishReason | None
    gap: float | None = None  # seconds since the sequence's previous token (None for its first)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        _ = tokenizer.token_bytes  # built now (~0.1 s for 50k ids), not on the first request's first token
        self.eos_ids = frozenset(tokenizer.eos_ids)
        self.max_model_len = max_model_len

    def postprocess(self, scheduler: Scheduler, batch: ScheduledBatch, out: SampleOutput | None,
                    sampled: list[Sequence], now: float) -> list[StepOutput]:
        """Record a launched step's tokens in the scheduler (Scheduler.advance ran at its launch) and
        build each sampled sequence's chunk; sequences that are done (a stop, the length, a non-finite
        row, a processing error) are finished there. Runs under the engine lock."""
        ok = {} if out is None else {s: t for s, t, good in zip(sampled, out.token_ids, out.ok) if good}
        scheduler.record(batch, ok)
        results = []
        for i, seq in enumerate(sampled):
            if seq.status is SeqStatus.FINISHED:
                continue  # cancelled while the step ran, or (overlapped steps) done at the step before
            if not out.ok[i]:
                scheduler.finish(seq, FinishReason.ERROR)
                results.append(StepOutput(seq, None, FinishReason.ERROR))
                continue
            try:
                chunk, reason = self.on_token(seq, out.token_ids[i], out.logprobs[i])
            except Exception:  # noqa: BLE001 - detokenizing one request must not stop the others
                log.exception("output processing failed for %s", seq.request_id)
                scheduler.finish(seq, FinishReason.ERROR)
                results.append(StepOutput(seq, None, FinishReason.ERROR))
                continue
            if reason is not None:
                scheduler.finish(seq, reason)
            gap = None if seq.last_token_time is None else now - seq.last_token_time
            seq.last_token_time = now
            results.append(StepOutput(seq, chunk, reason, gap))
        return results

    def on_token(self, seq: Sequence, token: int, logprob) -> tuple[GenerationChunk, FinishReason | None]:
        """The chunk for a newly appended token, and the finish reason if the sequence is done."""
        if seq.detokenizer is None:
            seq.detokenizer = make_detokenizer(self.tokenizer, seq.request.prompt_ids)
            seq.stops = StopStringMatcher(seq.request.params.stop)
        detok, stops = seq.detokenizer, seq.stops
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
                seq.matched_stop = stops.matched
            elif len(seq.output_ids) >= p.max_new_tokens:
                reason = FinishReason.LENGTH
            elif seq.total_len >= self.max_model_len:
                reason = FinishReason.CONTEXT_LENGTH
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
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids))
        base = chunk or GenerationChunk(request_id=seq.request_id)
        return GenerationChunk(request_id=seq.request_id, text=base.text, token_ids=base.token_ids,
                               logprobs=base.logprobs, finish_reason=reason, usage=usage,
                               timings=timings, error=error, matched_stop=seq.matched_stop)
