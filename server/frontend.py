"""What the gRPC and HTTP edges share: readiness, draining, the worker pool, and one path from a
client's input to the engine's chunk stream.

    request = await frontend.offload(frontend.request_for, generate_input, rid, deadline, "grpc")
    async for chunk in frontend.run(request): ...

`request_for` (size prechecks, tokenizing or chat rendering, engine validation) runs on the worker
threads, never on the event loop; `run` submits and maps the engine's abnormal endings to EdgeErrors,
so both edges report them alike. One engine, one pool, one count of calls in flight for the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import AsyncIterator

from .config import ServerSettings
from .edge_errors import EdgeError, Failure
from .engine.outputs import GenerationChunk, Usage
from .engine.request import FinishReason, Request, SamplingParams
from .inputs import GenerateInput, InputConverter, InputLimits, precheck_generate

# the engine's abnormal endings, as both edges report them
_ENDINGS = {
    FinishReason.SHUTDOWN: (Failure.UNAVAILABLE, "the server stopped before this request finished; retry"),
    FinishReason.DEADLINE: (Failure.DEADLINE_EXCEEDED, "the request's deadline passed before it finished"),
    FinishReason.CANCELLED: (Failure.CANCELLED, "the request was cancelled"),
}


def new_request_id() -> str:
    """The id a request gets when the caller sent none."""
    return f"req-{uuid.uuid4().hex[:16]}"


class Frontend:
    """The edges' common half; `attach` gives it the engine once the model is loaded."""

    def __init__(self, settings: ServerSettings | None = None):
        self.settings = settings or ServerSettings()
        self.draining = False
        self.in_flight = 0  # generation calls of either edge between submit and their last chunk
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(self.settings.input_workers, thread_name_prefix="lmserve-input")
        self.engine = None
        self.model_name: str | None = None  # the name reported; requests may use any of model_names
        self.model_names: tuple[str, ...] = ()
        self._ending: set[str] = set()  # requests an edge ended early (end): their end is not an error

    def attach(self, engine, model_name: str, *aliases: str) -> None:
        """Start answering with this engine (until then every call is UNAVAILABLE: the model is loading).
        `aliases`: more names requests may give the model (--served-model-name)."""
        self.tokenizer = engine.loaded.tokenizer
        self.model_name = model_name
        self.model_names = tuple(dict.fromkeys((model_name, *aliases)))
        self.limits = InputLimits.for_context(engine.max_model_len, self.settings.max_input_chars)
        self.inputs = InputConverter(self.tokenizer, engine)
        self.engine = engine

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_ready(self) -> None:
        if self.engine is None:
            raise EdgeError(Failure.UNAVAILABLE, "the model is still loading; retry shortly")

    def check_accepting(self) -> None:
        """Ready and not draining; else UNAVAILABLE (a caller retries on another replica)."""
        self.check_ready()
        if self.draining:
            raise EdgeError(Failure.UNAVAILABLE, "server is draining; retry on another replica")

    async def offload(self, fn, *args):
        """Run client-sized work on the worker threads, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    # ---- LoRA adapters ---------------------------------------------------------------------
    def adapter_of(self, model: str) -> str:
        """The adapter a request's model name chooses: "" for the base model (any of model_names), the
        name of a known adapter; else NOT_FOUND naming it and what is served."""
        if model in self.model_names:
            return ""
        pool = self.engine.adapters
        if pool is not None and model in pool.known:
            return model
        served = [*self.model_names, *(a.name for a in self.adapters())]
        raise EdgeError(Failure.NOT_FOUND, f"the model {model[:200]!r} is not served here; this server serves "
                                           f"{' or '.join(map(repr, served))} (GET /v1/models)", param="model")

    def adapters(self) -> list:
        """The known adapters (engine/adapters.KnownAdapter), by name."""
        pool = self.engine.adapters if self.engine is not None else None
        return [] if pool is None else pool.listing()

    def load_adapter(self, name: str, path: str, replace_existing: bool = True):
        """Read and register adapter `name` from `path` inside --lora-dir (on a worker thread: it reads
        the files). Refused: runtime loading off (no --lora-dir), a bad name or path, bad files."""
        pool = self.engine.adapters
        if pool is None or pool.lora_dir is None:
            raise EdgeError(Failure.NOT_FOUND, "runtime adapter loading is off: start the server with --lora-dir DIR")
        if not name or len(name) > 128 or not (name.isascii() and name.isprintable()):
            raise EdgeError(Failure.INVALID_ARGUMENT, "lora_name must be 1 to 128 printable ASCII characters",
                            param="lora_name")
        if name in self.model_names:
            raise EdgeError(Failure.INVALID_ARGUMENT, f"lora_name {name!r} is the base model's name", param="lora_name")
        if not replace_existing and name in pool.known:
            raise EdgeError(Failure.INVALID_ARGUMENT, f"the adapter {name!r} is already loaded (unload it first, or "
                                                      "load it in place)", param="lora_name")
        return pool.register(name, pool.resolve_path(path))

    def unload_adapter(self, name: str) -> None:
        pool = self.engine.adapters
        if pool is None or pool.lora_dir is None:
            raise EdgeError(Failure.NOT_FOUND, "runtime adapter loading is off: start the server with --lora-dir DIR")
        pool.unregister(name)

    def request_for(self, inp: GenerateInput, rid: str, deadline: float | None, origin: str) -> Request:
        """Check and convert an input (on a worker thread); RequestValidationError names proto fields."""
        precheck_generate(inp, self.limits)
        # the engine id is unique even if callers reuse theirs
        return self.inputs.generate_request(inp, f"{rid}#{next(self._ids)}", deadline, origin)

    def count_prompt(self, inp: GenerateInput) -> int:
        """The prompt tokens `inp` would take (on a worker thread): the size checks, then the rendering."""
        precheck_generate(inp, self.limits)
        return len(self.inputs.prompt_ids(inp))

    def samples(self, request: Request, n: int) -> list[Request]:
        """`n` requests sampling the same prompt independently: ids `<id>/<i>`; with a seed, sample i's is
        derived from it (sample 0 keeps it, so n=1 and the first of n agree)."""
        if n == 1:
            return [request]
        p = request.params
        return [replace(request, request_id=f"{request.request_id}/{i}",
                        params=p if p.seed is None or i == 0 else replace(p, seed=_sample_seed(p.seed, i)))
                for i in range(n)]

    async def share_prompt(self, request: Request) -> Usage | None:
        """Compute `request`'s prompt once and leave its K/V in the prefix cache, so that the samples of it
        submitted next copy the K/V instead of each computing it: a one-token greedy request run to its
        end (a step's work beyond the prompt's). Its usage, or None where nothing is shared: no prefix
        cache, or a prompt shorter than one of its blocks."""
        cache = self.engine.scheduler.kv.prefix_cache
        if cache is None or len(request.prompt_ids) <= cache.block:
            return None
        prompt = Request(prompt_ids=request.prompt_ids, params=SamplingParams(max_new_tokens=1, speculate=False),
                         request_id=f"{request.request_id}/prompt", deadline=request.deadline, origin=request.origin)
        usage = None
        async with contextlib.aclosing(self.run(prompt)) as chunks:
            async for chunk in chunks:
                usage = chunk.usage or usage
        return usage

    def end(self, request: Request) -> None:
        """Stop a running request early, as an edge decides (its answer is complete): its stream still
        ends with a final chunk (finish_reason CANCELLED, its usage), not an error; its KV is freed."""
        self._ending.add(request.request_id)
        self.engine.cancel(request.request_id)

    async def run(self, request: Request, announce: bool = False) -> AsyncIterator[GenerationChunk | None]:
        """Submit (admission errors raise before any chunk) and yield the chunks; a request that ends
        abnormally raises EdgeError. Leaving early cancels the request and frees its KV.

        `announce`: first yield None once the engine has admitted the request to its queue, so that
        an edge can answer (headers, a first event) before the first token."""
        stream = self.engine.generate(request)
        self.in_flight += 1
        try:
            if announce:
                yield None
            async for chunk in stream:
                if chunk.finish_reason is FinishReason.CANCELLED and request.request_id in self._ending:
                    yield chunk
                    continue
                if chunk.finish_reason is FinishReason.ERROR:
                    raise EdgeError(Failure.INTERNAL, chunk.error or "generation failed")
                if chunk.finish_reason in _ENDINGS:
                    raise EdgeError(*_ENDINGS[chunk.finish_reason])
                yield chunk
        finally:
            self._ending.discard(request.request_id)
            await stream.aclose()
            self.in_flight -= 1


def _sample_seed(seed: int, i: int) -> int:
    """Sample i's seed, derived from the request's: far from seed + i, which a neighbouring request may use."""
    return (seed + i * 0x9E3779B97F4A7C15) % 2**63
