"""Prometheus metrics: engine observer for latencies and counters, a collector for live gauges."""

from __future__ import annotations

import resource
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from .request import FinishReason

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    """All lmserve_* metrics on one registry; observes the engine and reads its state at scrape time."""

    def __init__(self, engine: "Engine", model_name: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.engine = engine
        self.model_name = model_name
        self._last_batch = 0
        self._lock = threading.Lock()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        self.ttft = Histogram("lmserve_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("lmserve_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lmserve_request_duration_seconds", "Arrival to finish of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("lmserve_queue_time_seconds", "Arrival to first scheduled step",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.step = Histogram("lmserve_engine_step_duration_seconds", "Duration of one engine step (model + sampling)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_hist = Histogram("lmserve_request_prompt_tokens", "Prompt tokens per request",
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.gen_hist = Histogram("lmserve_request_generated_tokens", "Generated tokens per request",
                                  buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter("lmserve_requests", "Finished requests by final status and finish reason",
                                ["status", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("lmserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("lmserve_generated_tokens", "Tokens generated", registry=r)
        self.stream_idle_timeouts = Counter(
            "lmserve_stream_idle_timeouts", "Streams cancelled because their reader took no message for "
            "--stream-idle-timeout seconds", registry=r)
        for reason in FinishReason:  # every series exists from the start, so rate() counts the first ones
            self.requests.labels(status=request_status(reason), finish_reason=reason.value)
        r.register(_LiveCollector(self))
        engine.observers.append(self)

    # ---- EngineObserver ---------------------------------------------------------------
    def on_step(self, seconds, batch) -> None:
        self.step.observe(seconds)
        self._last_batch = len(batch.decode) + len(batch.prefill)

    def on_token(self, seq, gap_seconds) -> None:
        self.generated_tokens.inc()
        if gap_seconds is not None:
            self.itl.observe(gap_seconds)

    def on_finish(self, seq, final) -> None:
        self.requests.labels(status=request_status(final.finish_reason), finish_reason=final.finish_reason.value).inc()
        if seq.first_scheduled is not None:
            self.queue.observe(final.timings.queue_seconds)
        if seq.first_token is not None:
            self.ttft.observe(final.timings.time_to_first_token_seconds)
        self.e2e.observe(final.timings.total_seconds)
        self.prompt_hist.observe(seq.prompt_len)
        self.gen_hist.observe(len(seq.output_ids))
        self.prompt_tokens.inc(seq.prompt_len)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Start the /metrics HTTP endpoint on its own thread; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)


def request_status(reason: FinishReason) -> str:
    """The final status label of a request that finished for `reason`."""
    return {FinishReason.ERROR: "error", FinishReason.CANCELLED: "cancelled",
            FinishReason.DEADLINE: "deadline_exceeded", FinishReason.SHUTDOWN: "unavailable"}.get(reason, "ok")


class _LiveCollector:
    """Gauges read from the engine at scrape time, so they are never stale."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        eng = self.m.engine
        st = eng.stats()
        lm = eng.loaded
        yield from (
            _gauge("lmserve_running_requests", "Requests admitted and not yet finished", st.running),
            _gauge("lmserve_waiting_requests", "Requests waiting for a KV slot", st.waiting),
            _gauge("lmserve_kv_slots_used", "KV cache slots in use", st.slots_used),
            _gauge("lmserve_kv_slots_capacity", "KV cache slots in total", st.slots_capacity),
            _gauge("lmserve_kv_cache_bytes", "Bytes reserved for the KV cache", st.kv_cache_bytes),
            _gauge("lmserve_kv_cache_used_bytes", "KV cache bytes holding live tokens",
                   eng.cache.bytes_per_token(lm.config, lm.dtype) * st.cached_tokens),
            _gauge("lmserve_batch_size", "Sequences in the last engine step", self.m._last_batch),
            _gauge("lmserve_model_weights_bytes", "Bytes of model parameters", lm.weight_bytes),
            _gauge("lmserve_process_peak_resident_memory_bytes", "Peak resident set size of the process",
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        )
        if lm.device.type == "cuda":
            import torch

            yield _gauge("lmserve_cuda_memory_allocated_bytes", "torch.cuda.memory_allocated", torch.cuda.memory_allocated(lm.device))
            yield _gauge("lmserve_cuda_memory_reserved_bytes", "torch.cuda.memory_reserved", torch.cuda.memory_reserved(lm.device))
            yield _gauge("lmserve_cuda_memory_peak_allocated_bytes", "torch.cuda.max_memory_allocated",
                         torch.cuda.max_memory_allocated(lm.device))
        info = InfoMetricFamily("lmserve_model", "The served model")
        info.add_metric([], {"model": self.m.model_name, "architecture": lm.config.model_type,
                             "dtype": str(lm.dtype).removeprefix("torch."), "device": str(lm.device),
                             "context_length": str(eng.max_model_len)})
        yield info


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
