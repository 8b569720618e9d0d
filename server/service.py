"""The TextGeneration servicer: validate, convert proto <-> engine, stream. Thin by design."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import AsyncIterator

import grpc

import lmserve
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

from .engine import Engine
from .grpc_errors import EdgeError, map_errors
from .engine.outputs import GenerationChunk, GenerationResult
from .engine.request import FinishReason, Request, RequestValidationError, SamplingParams

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256

FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: pb.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def new_request_id() -> str:
    """The id a request gets when the caller sent none."""
    return f"req-{uuid.uuid4().hex[:16]}"


class TextGenerationService(pb_grpc.TextGenerationServicer):
    def __init__(self, engine: Engine | None = None, model_name: str = ""):
        self.draining = False
        self.in_flight = 0
        self._ids = itertools.count(1)
        self.engine: Engine | None = None
        if engine is not None:
            self.attach(engine, model_name)

    def attach(self, engine: Engine, model_name: str) -> None:
        """Start answering with this engine (until then every RPC is UNAVAILABLE: the model is loading)."""
        self.tokenizer = engine.loaded.tokenizer
        self.model_name = model_name
        self.engine = engine

    def _check_ready(self) -> None:
        if self.engine is None:
            raise EdgeError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")

    # ---- proto -> engine ------------------------------------------------------------
    def _messages(self, msgs: pb.ChatMessages, field: str) -> list[dict]:
        v = []
        if not msgs.messages:
            v.append((field, "must hold at least one message"))
        elif len(msgs.messages) > MAX_MESSAGES:
            v.append((field, f"at most {MAX_MESSAGES} messages"))
        for i, m in enumerate(msgs.messages):
            if m.role not in CHAT_ROLES:
                v.append((f"{field}[{i}].role", f"must be one of {sorted(CHAT_ROLES)}, got {m.role!r}"))
        if v:
            raise RequestValidationError(v)
        return [{"role": m.role, "content": m.content} for m in msgs.messages]

    def _render_chat(self, msgs: pb.ChatMessages, field: str, add_generation_prompt: bool = True) -> list[int]:
        messages = self._messages(msgs, field)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # the checkpoint's template rejected the conversation (raise_exception)
            raise RequestValidationError([(field, f"the model's chat template rejected these messages: {exc}")]) from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prompt_ids(self, req: pb.GenerateRequest) -> tuple[list[int], str]:
        kind = req.WhichOneof("input")
        if kind == "prompt":
            if not req.prompt:
                raise RequestValidationError([("prompt", "must not be empty")])
            return self.tokenizer.encode(req.prompt, add_special_tokens=True), "prompt"
        if kind == "token_ids":
            return list(req.token_ids.ids), "token_ids"
        if kind == "messages":
            return self._render_chat(req.messages, "messages"), "messages"
        raise RequestValidationError([("input", "set one of prompt, token_ids or messages")])

    def _params(self, p: pb.SamplingParams, prompt_len: int) -> SamplingParams:
        s = self.engine.settings
        # unset max_new_tokens: the server default, shortened to what the cap and the context leave
        default = max(1, min(s.default_max_new_tokens, s.max_new_tokens_cap, self.engine.max_model_len - prompt_len))
        return SamplingParams(
            max_new_tokens=p.max_new_tokens or default,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p if p.top_p != 0 else 1.0,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
        )

    def _request(self, req: pb.GenerateRequest, context: grpc.aio.ServicerContext, rid: str) -> Request:
        self._check_ready()
        if self.draining:
            raise EdgeError(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        ids, field = self._prompt_ids(req)
        remaining = context.time_remaining()
        request = Request(
            prompt_ids=ids,
            params=self._params(req.params, len(ids)),
            request_id=f"{rid}#{next(self._ids)}",  # unique inside the engine even if callers reuse ids
            deadline=None if remaining is None else time.monotonic() + remaining,
        )
        try:
            self.engine.validate(request)
        except RequestValidationError as exc:  # name fields as the proto does
            raise RequestValidationError([(self._field_path(f, field), d) for f, d in exc.violations]) from None
        return request

    @staticmethod
    def _field_path(name: str, input_field: str) -> str:
        if name in ("prompt", "token_ids"):
            return input_field
        if name == "request_id":
            return name
        return f"params.{name}"

    # ---- engine -> proto ------------------------------------------------------------
    def _logprobs(self, chunk_lps) -> list[pb.TokenLogprob]:
        dec = self.tokenizer.decode
        return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, text=dec([lp.token_id]),
                                top=[pb.TopLogprob(token_id=t, logprob=v, text=dec([t])) for t, v in lp.top])
                for lp in chunk_lps]

    @staticmethod
    def _final_fields(c: GenerationChunk | GenerationResult) -> dict:
        out = {"finish_reason": FINISH[c.finish_reason], "matched_stop": c.matched_stop or ""}
        if c.usage:
            out["usage"] = pb.Usage(prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens)
        if c.timings:
            out["timing"] = pb.Timing(queue_seconds=c.timings.queue_seconds,
                                      time_to_first_token_seconds=c.timings.time_to_first_token_seconds,
                                      total_seconds=c.timings.total_seconds)
        return out

    async def _chunks(self, req: pb.GenerateRequest, context, rid: str) -> AsyncIterator[GenerationChunk]:
        request = self._request(req, context, rid)
        stream = self.engine.generate(request)  # admission errors raise here, before any response
        self.in_flight += 1
        try:
            async for chunk in stream:
                if chunk.finish_reason is FinishReason.SHUTDOWN:
                    raise EdgeError(grpc.StatusCode.UNAVAILABLE, "the server stopped before this request finished; retry")
                if chunk.finish_reason is FinishReason.ERROR:
                    raise EdgeError(grpc.StatusCode.INTERNAL, chunk.error or "generation failed")
                if chunk.finish_reason is FinishReason.DEADLINE:
                    raise EdgeError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished")
                if chunk.finish_reason is FinishReason.CANCELLED:
                    raise EdgeError(grpc.StatusCode.CANCELLED, "the request was cancelled")
                yield chunk
        finally:
            await stream.aclose()
            self.in_flight -= 1

    # ---- RPCs -----------------------------------------------------------------------
    @map_errors
    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        rid = request.request_id or new_request_id()
        result = GenerationResult(request_id=rid)
        async for chunk in self._chunks(request, context, rid):
            result.add(chunk)
        return pb.GenerateResponse(request_id=rid, text=result.text, token_ids=result.token_ids,
                                   logprobs=self._logprobs(result.logprobs), **self._final_fields(result))

    @map_errors
    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        rid = request.request_id or new_request_id()
        async for chunk in self._chunks(request, context, rid):
            msg = pb.GenerateStreamResponse(request_id=rid, text=chunk.text, token_ids=chunk.token_ids,
                                            logprobs=self._logprobs(chunk.logprobs))
            if chunk.finished:
                msg.MergeFrom(pb.GenerateStreamResponse(**self._final_fields(chunk)))
            yield msg

    @map_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self._check_ready()
        kind = request.WhichOneof("input")
        if kind == "messages":
            ids = self._render_chat(request.messages, "messages", request.add_generation_prompt)
        elif kind == "text":
            ids = self.tokenizer.encode(request.text, add_special_tokens=True)
        else:
            raise RequestValidationError([("input", "set one of text or messages")])
        tokens = [self.tokenizer.id_to_token(i) or "" for i in ids]
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, text=self.tokenizer.decode(ids))

    @map_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        self._check_ready()
        lm, cfg, s = self.engine.loaded, self.engine.loaded.config, self.engine.settings
        info = pb.GetModelInfoResponse(
            model_name=self.model_name, architecture=cfg.model_type, context_length=self.engine.max_model_len,
            vocab_size=cfg.vocab_size, dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device),
            eos_token_ids=list(self.tokenizer.eos_ids), max_new_tokens_limit=s.max_new_tokens_cap,
            max_batch_size=self.engine.cache.num_slots, default_max_new_tokens=s.default_max_new_tokens,
            has_chat_template=bool(self.tokenizer.chat_template),
            num_parameters=lm.num_parameters, server_version=lmserve.__version__,
            quantization=lm.plan.mode.quantization if lm.plan else "none", kernels=lm.kernels)
        if self.tokenizer.bos_id is not None:
            info.bos_token_id = self.tokenizer.bos_id
        return info

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no Generate call is in flight; False if the timeout passed first."""
        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.in_flight == 0
