"""A step's sampled tokens turned into stream chunks: recorded (through the scheduler), stop checks,
detokenizing, and each finished request's last chunk with its usage and timings. The engine calls
it and nothing else does."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmserve.model.text.detokenizer import make_detokenizer
from lmserve.model.text.tokenizer import Tokenizer

from .ngram import Speculation, kept
from .outputs import GenerationChunk, OutputState, Timings, TokenLogprob, Usage, merge_chunks
from .request import FinishReason
from .repeat_probe import RepeatProbe
from .sequence import Sequence, SeqStatus
from .stopping import StopStringMatcher

if TYPE_CHECKING:
    from .scheduler import InFlight, Scheduler

log = logging.getLogger("lmserve.engine")


@dataclass(frozen=True)
class StepOutput:
    """What a step produced for one sequence: its chunk (None when the request failed) and, if it
    is done, why. Delivered to the request's stream by the engine."""

    seq: Sequence
    chunk: GenerationChunk | None
    reason: FinishReason | None
    gap: float | None = None  # seconds since the sequence's previous token (None for its first)


def _constraint_ended(seq: Sequence) -> bool:
    """Its constraint admits nothing after the token just recorded but the end (a JSON value closed, a tool
    call whose grammar allows one): it ends there, where the end-of-sequence token the mask forces would
    end it a token later. The constraint may have taken tokens past this one (a verified draft's run, an
    overlapped step): it says after how many it finished."""
    c = seq.constraint
    return c is not None and not seq.request.params.ignore_eos and c.finished_at == len(seq.output_ids)


def _held_text(state: OutputState) -> str:
    """At a sequence's end (not a stop string's), the text its detokenizer and stop matcher still held."""
    return state.stops.push(state.detokenizer.flush()) + state.stops.flush()


class OutputProcessor:
    """Owns stops and detokenizing; the scheduler records the tokens and retires the sequences it says
    are done."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        _ = tokenizer.token_bytes  # built now (~0.1 s for 50k ids), not on the first request's first token
        self.eos_ids = frozenset(tokenizer.eos_ids)

    def postprocess(self, scheduler: "Scheduler", step: "InFlight") -> list[StepOutput]:
        """A launched step's sampled tokens (one row per sampled sequence, k + 1 rows for one verifying
        k drafts; none when no row sampled): recorded, each turned into its chunk (stops,
        detokenizing), and the sequences that are done (a stop, the length, a non-finite row, a
        processing error) retired.

        A verifying row keeps its drafts up to the first one that differs from the model's own greedy
        token at that position, then the model's token there: exactly the tokens decoding one at a
        time would give (scheduler.verified rewinds the rest); tokens after a stop are dropped too."""
        scheduler.land(step)
        batch, out = step.batch, step.run.out if step.run is not None else None
        now = scheduler.clock()
        results, row = [], 0
        token_ids, ok, logprobs = (out.token_ids, out.ok, out.logprobs) if out is not None else ((), (), ())
        finished = SeqStatus.FINISHED
        for seq, draft in zip(batch.sampled(), batch.sampled_drafts()):
            first = row
            row += 1 + len(draft)
            if seq.status is finished:
                continue  # cancelled while the step ran, or (overlapped steps) done at the step before
            if not ok[first]:
                scheduler.finish(seq, FinishReason.ERROR)
                results.append(StepOutput(seq, None, FinishReason.ERROR))
                continue
            keep = 0
            if draft:
                keep = kept(token_ids, ok, first, draft)  # drafts accepted
                probe = seq.repeats is not None and seq.repeats.probed
                if probe:
                    seq.repeats.probed = False
                if probe and keep == len(draft):  # decoding would write an earlier part again: it ends here,
                    scheduler.verified(seq, len(draft), 0, probe)  # none of the drafted tokens recorded
                    scheduler.trim_to_output(seq)
                    scheduler.finish(seq, FinishReason.EOS)
                    chunk = GenerationChunk(request_id=seq.request_id, text=_held_text(seq.output))
                    results.append(StepOutput(seq, chunk, FinishReason.EOS))
                    continue
                scheduler.verified(seq, len(draft), keep, probe)
            chunk = reason = None
            for r in range(first, first + keep + 1):
                scheduler.append(seq, token_ids[r], now)
                try:
                    piece, reason = self.on_token(seq, token_ids[r], logprobs[r])
                except Exception:  # noqa: BLE001 - detokenizing one request must not stop the others
                    log.exception("output processing failed for %s", seq.request_id)
                    chunk, reason = None, FinishReason.ERROR
                    break
                chunk = piece if chunk is None else merge_chunks(chunk, piece)
                if reason is not None:
                    break
            if draft:
                scheduler.trim_to_output(seq)  # a stop inside the accepted run
            if chunk is None:
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
        """The chunk for a newly recorded token, and the finish reason if the sequence is done.
        (A request never outgrows the context: validation bounds prompt + max_new_tokens by it.)"""
        p = seq.request.params
        if seq.output is None:
            seq.output = OutputState(make_detokenizer(self.tokenizer, seq.request.prompt_ids),
                                     StopStringMatcher(p.stop))
            if p.repeat_marker and Speculation.verifiable(p):
                seq.repeats = RepeatProbe(*p.repeat_marker)
        state = seq.output
        detok, stops = state.detokenizer, state.stops
        reason = None
        is_eos = token in self.eos_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            reason = FinishReason.EOS
            text = ""
        else:
            text = detok.push(token)
            if seq.repeats is not None:
                seq.repeats.push(len(seq.output_ids) - 1, text)
            text = stops.push(text)
            if stops.stopped:
                reason = FinishReason.STOP
                state.matched_stop = stops.matched
            elif _constraint_ended(seq):
                reason = FinishReason.EOS
            elif len(seq.output_ids) >= p.max_new_tokens:
                reason = FinishReason.LENGTH
        if reason is not None and reason is not FinishReason.STOP:
            text += _held_text(state)
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
