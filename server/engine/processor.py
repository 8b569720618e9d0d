"""Turns sampled tokens into stream chunks: detokenize, check stop conditions, fold timings."""

from __future__ import annotations

from lmserve.model.detokenizer import IncrementalDetokenizer
from lmserve.model.tokenizer import Tokenizer

from .outputs import GenerationChunk, Timings, TokenLogprob, Usage
from .request import FinishReason
from .sequence import Sequence
from .stopping import StopStringMatcher


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_ids)
        self.max_model_len = max_model_len

    def on_token(self, seq: Sequence, token: int, logprob) -> tuple[GenerationChunk, FinishReason | None]:
        """The chunk for a newly appended token, and the finish reason if the sequence is done."""
        st = seq.state
        if "detok" not in st:
            st["detok"] = IncrementalDetokenizer(self.tokenizer, seq.request.prompt_ids, skip_special_tokens=True)
            st["stops"] = StopStringMatcher(seq.request.params.stop)
        p = seq.request.params
        reason = None
        is_eos = token in self.eos_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            reason = FinishReason.EOS
            text = ""
        else:
            text = st["stops"].push(st["detok"].push(token))
            if st["stops"].stopped:
                reason = FinishReason.STOP
                st["matched_stop"] = st["stops"].matched
            elif len(seq.output_ids) >= p.max_new_tokens:
                reason = FinishReason.LENGTH
            elif seq.total_len >= self.max_model_len:
                reason = FinishReason.CONTEXT_LENGTH
        if reason is not None and reason is not FinishReason.STOP:
            text += st["stops"].push(st["detok"].flush()) + st["stops"].flush()
        lp = () if logprob is None else (TokenLogprob(token, logprob[0], logprob[1]),)
        chunk = GenerationChunk(request_id=seq.request_id, text=text, token_ids=(token,), logprobs=lp)
        return chunk, reason

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
                               timings=timings, error=error, matched_stop=seq.state.get("matched_stop"))
