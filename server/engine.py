"""The engine: a thread that runs schedule -> step -> update, and an asyncio API in front of it.

The event loop never calls torch. Requests cross into the engine thread under a lock; results
cross back with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

import torch

from lmserve.model.kv_cache import KVCache
from lmserve.model.loader import LoadedModel

from .outputs import GenerationChunk
from .processor import OutputProcessor
from .request import FinishReason, Request, RequestValidationError
from .runner import ModelRunner
from .sampler import Sampler, make_generator
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SeqStatus
from .settings import EngineSettings

log = logging.getLogger("lmserve.engine")

Sink = Callable[[GenerationChunk], None]


class EngineUnavailableError(Exception):
    """The engine is shutting down or its loop has died; no new requests."""


class EngineObserver(Protocol):
    """Hooks for metrics; called on the engine thread, must be cheap and must not raise."""

    def on_step(self, seconds: float, batch: ScheduledBatch) -> None: ...
    def on_token(self, seq: Sequence, gap_seconds: float | None) -> None: ...
    def on_finish(self, seq: Sequence, final: GenerationChunk) -> None: ...


@dataclass(frozen=True)
class EngineHealth:
    alive: bool
    stuck: bool
    detail: str

    @property
    def ok(self) -> bool:
        return self.alive and not self.stuck


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    slots_used: int
    slots_capacity: int
    slots_allocated_total: int
    slots_freed_total: int
    kv_cache_bytes: int
    cached_tokens: int
    steps: int


class Engine:
    def __init__(self, loaded: LoadedModel, settings: EngineSettings | None = None):
        self.settings = s = settings or EngineSettings()
        self.loaded = loaded
        cfg = loaded.config
        self.max_model_len = min(s.max_model_len or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)
        budget = s.kv_cache_bytes or KVCache.bytes_per_token(cfg, loaded.dtype) * self.max_model_len * s.max_batch
        self.cache = KVCache.from_budget(cfg, budget, self.max_model_len, s.max_batch, loaded.dtype, loaded.device)
        # a quarter of the context: the prompts that would make short neighbours read many empty keys
        self.scheduler = Scheduler(self.cache.num_slots, s.max_queue, s.token_budget,
                                   long_prompt=max(2, self.max_model_len // 4))
        graphs = None
        if s.cuda_graphs and loaded.device.type == "cuda":
            from .cuda_graphs import DecodeGraphs

            try:
                graphs = DecodeGraphs(loaded.model, self.cache, self.cache.num_slots)
            except Exception as exc:  # noqa: BLE001 - said plainly, with the way around it
                raise RuntimeError(f"capturing CUDA graphs for decode failed ({exc}); "
                                   "start with --cuda-graphs false to decode eagerly") from exc
        self.runner = ModelRunner(loaded.model, self.cache, loaded.device, graphs)
        self.sampler = Sampler()
        self.processor = OutputProcessor(loaded.tokenizer, self.max_model_len)
        self.observers: list[EngineObserver] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._cancels: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None
        self._steps = 0
        self._accepting = True

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
        self._thread.start()
        return self

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight finish with an error."""
        self._accepting = False
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ---------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        request.validate(self.loaded.config.vocab_size, self.max_model_len, self.settings.max_new_tokens_cap)

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a validated request; its chunks go to `sink` (called on the engine thread).

        Raises RequestValidationError, QueueFullError or EngineUnavailableError; nothing is queued then.
        """
        self.validate(request)
        if not self._accepting or not self.health().alive:
            raise EngineUnavailableError("the engine is not accepting requests")
        with self._lock:
            if not self._accepting:
                raise EngineUnavailableError("the engine is not accepting requests")
            if request.request_id in self._sinks:
                raise RequestValidationError([("request_id", f"{request.request_id!r} is already in flight")])
            self.scheduler.add(request)  # may raise QueueFullError
            self._sinks[request.request_id] = sink
        self._wake.set()

    def generate(self, request: Request) -> AsyncIterator[GenerationChunk]:
        """Submit now (errors raise here, before any chunk) and return the chunk stream.

        Leaving the stream early (break, cancellation, error) cancels the request.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationChunk] = asyncio.Queue()

        def sink(chunk: GenerationChunk) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except RuntimeError:  # the loop is closed: nobody is listening
                self.cancel(request.request_id)

        self.submit(request, sink)
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[GenerationChunk]:
        done = False
        try:
            while not done:
                chunk = await queue.get()
                done = chunk.finished
                yield chunk
        finally:
            if not done:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """Ask the loop to cancel; the slot is free by the next step. Unknown ids are ignored."""
        with self._lock:  # resolve the id now: a late cancel must not hit a later request reusing it
            seq = self.scheduler.get(request_id)
            if seq is not None:
                self._cancels.append(seq)
        self._wake.set()

    # ---- introspection ----------------------------------------------------------------
    def health(self) -> EngineHealth:
        if self._thread is None or not self._thread.is_alive():
            return EngineHealth(False, False, "engine loop is not running")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.settings.stuck_after_seconds:
            return EngineHealth(True, True, f"engine step running for {time.monotonic() - started:.0f}s")
        return EngineHealth(True, False, "ok")

    def stats(self) -> EngineStats:
        """A consistent snapshot. A request counts as running from admission until its outcome is
        recorded and delivered, not only while it holds a slot, so "nothing running" also means
        every finished request is already counted by the observers."""
        sch = self.scheduler
        with self._lock:
            in_flight, waiting = len(self._sinks), len(sch.waiting)
        return EngineStats(
            running=in_flight - waiting, waiting=waiting, slots_used=sch.slots.used,
            slots_capacity=sch.slots.capacity, slots_allocated_total=sch.slots.allocated_total,
            slots_freed_total=sch.slots.freed_total, kv_cache_bytes=self.cache.nbytes,
            cached_tokens=sum(s.num_cached for s in list(sch.running)), steps=self._steps)

    # ---- the loop ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._step_once():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException:  # noqa: BLE001 - the loop must report its own death
            log.exception("engine loop died")
            raise
        finally:
            with self._lock:
                self._accepting = False  # checked under the lock in submit: no request can slip in now
                seqs = [*self.scheduler.waiting, *self.scheduler.running]
                for seq in seqs:
                    self.scheduler.finish(seq, FinishReason.SHUTDOWN)
            for seq in seqs:
                try:  # one failing finish (say, clearing its slot) must not leave the others without an end
                    self._finish(seq, FinishReason.SHUTDOWN, error="the server is shutting down")
                except Exception:  # noqa: BLE001
                    log.exception("finishing %s at shutdown failed", seq.request_id)
            with self._lock:  # whoever is still registered (a sequence lost on the way) gets a final chunk
                orphans, self._sinks = self._sinks, {}
            for request_id, sink in orphans.items():
                try:
                    sink(GenerationChunk(request_id=request_id, finish_reason=FinishReason.SHUTDOWN,
                                         error="the server is shutting down"))
                except Exception:  # noqa: BLE001
                    log.exception("delivering the final chunk of %s failed", request_id)

    def _step_once(self) -> bool:
        """One engine step; False when there was nothing to do."""
        with self._lock:
            cancels, self._cancels = self._cancels, []
            cancelled = [s for s in cancels if s.status is not SeqStatus.FINISHED]
            for seq in cancelled:
                self.scheduler.finish(seq, FinishReason.CANCELLED)
            batch = self.scheduler.schedule()
        for seq in cancelled:
            self._finish(seq, FinishReason.CANCELLED)
        for seq in batch.dropped:
            self._finish(seq, seq.finish_reason)
        if batch.empty:
            return bool(cancelled or batch.dropped)

        t0 = time.monotonic()
        self._step_started = t0
        sampled = batch.sampled()
        try:
            logits = self.runner.step(batch)
            out = self._sample(sampled, logits) if sampled else None
        except Exception:  # noqa: BLE001 - a failed step fails its requests, not the server
            log.exception("engine step failed; failing its %d request(s)", len(batch.prefill) + len(batch.decode))
            self._step_started = None
            self._fail_batch(batch)
            return True
        self._step_started = None
        self._steps += 1
        now = time.monotonic()

        with self._lock:
            ok = {} if out is None else {s: t for s, t, good in zip(sampled, out.token_ids, out.ok) if good}
            self.scheduler.update(batch, ok)
            results = []
            for i, seq in enumerate(sampled):
                if seq.status is not SeqStatus.RUNNING:
                    continue  # cancelled while the step ran
                if not out.ok[i]:
                    self.scheduler.finish(seq, FinishReason.ERROR)
                    results.append((seq, None, FinishReason.ERROR))
                    continue
                try:
                    chunk, reason = self.processor.on_token(seq, out.token_ids[i], out.logprobs[i])
                except Exception:  # noqa: BLE001 - detokenizing one request must not stop the others
                    log.exception("output processing failed for %s", seq.request_id)
                    self.scheduler.finish(seq, FinishReason.ERROR)
                    results.append((seq, None, FinishReason.ERROR))
                    continue
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                results.append((seq, chunk, reason))
        for obs in self.observers:
            obs.on_step(now - t0, batch)
        for seq, chunk, reason in results:
            if chunk is None:
                self._finish(seq, reason, error="generation failed for this request")
                continue
            last = seq.state.get("last_token_time")
            seq.state["last_token_time"] = now
            for obs in self.observers:
                obs.on_token(seq, None if last is None else now - last)
            if reason is None:
                self._deliver(seq.request_id, chunk)
            else:
                self._finish(seq, reason, chunk=chunk)
        return True

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor):
        params = [s.request.params for s in seqs]
        gens = [s.state.setdefault("generator", make_generator(p.seed, logits.device)) if p.temperature > 0 else None
                for s, p in zip(seqs, params)]
        return self.sampler(logits, params, gens, [s.output_ids for s in seqs], [s.request.prompt_ids for s in seqs])

    def _fail_batch(self, batch: ScheduledBatch) -> None:
        seqs = [c.seq for c in batch.prefill] + list(batch.decode)
        with self._lock:
            live = [s for s in seqs if s.status is SeqStatus.RUNNING]
            for seq in live:
                self.scheduler.finish(seq, FinishReason.ERROR)
        for seq in live:
            self._finish(seq, FinishReason.ERROR, error="generation failed on the server")

    def _finish(self, seq: Sequence, reason: FinishReason, chunk: GenerationChunk | None = None,
                error: str | None = None) -> None:
        try:
            if seq.slot is not None:
                # Zero what this request wrote: K/V it left behind may be non-finite (a poisoned prompt
                # cancelled mid-prefill never showed NaN logits), and masked keys still multiply values
                # (0 * NaN = NaN) for the slot's next owner. Costs one memset of the written positions.
                self.cache.clear(seq.slot, min(self.cache.max_len, seq.total_len + 1))
        finally:  # the request gets its final chunk even when clearing fails (which then stops the loop)
            final = OutputProcessor.final(seq, reason, time.monotonic(), chunk, error)
            for obs in self.observers:
                obs.on_finish(seq, final)
            with self._lock:  # unregister before delivering: once a caller has the final chunk, its id is free
                sink = self._sinks.pop(seq.request_id, None)
            if sink is not None:
                try:
                    sink(final)
                except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
                    log.exception("delivering to %s failed", seq.request_id)

    def _deliver(self, request_id: str, chunk: GenerationChunk) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            try:
                sink(chunk)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
                log.exception("delivering to %s failed", request_id)
