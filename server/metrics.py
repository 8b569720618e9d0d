"""Prometheus metrics: engine observer for latencies and counters, a collector for live gauges."""

from __future__ import annotations

import resource
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from .engine.request import FinishReason
from .engine.step_cost import KINDS, step_kind

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
# a step and the gap between two tokens: milliseconds on a GPU, tens of them on a CPU, seconds in a stall; fine
# enough between 1 and 100 ms that histogram_quantile tells a 40 ms stall from a 16 ms pace
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05,
                0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# the edge a request came through (engine Request.origin): a label of the per-request metrics
PROTOCOLS = ("grpc", "http")


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
                              ["protocol"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("lmserve_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                             buckets=STEP_BUCKETS, registry=r)
        self.e2e = Histogram("lmserve_request_duration_seconds", "Arrival to finish of a request",
                             ["protocol"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("lmserve_queue_time_seconds", "Arrival to first scheduled step",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.step = Histogram("lmserve_engine_step_duration_seconds", "Duration of one engine step (model + sampling)",
                              buckets=STEP_BUCKETS, registry=r)
        self.prompt_hist = Histogram("lmserve_request_prompt_tokens", "Prompt tokens per request",
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.gen_hist = Histogram("lmserve_request_generated_tokens", "Generated tokens per request",
                                  buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter("lmserve_requests", "Finished requests by final status, finish reason and protocol",
                                ["status", "finish_reason", "protocol"], registry=r)
        self.prompt_tokens = Counter("lmserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("lmserve_generated_tokens", "Tokens generated", registry=r)
        self.stream_idle_timeouts = Counter(
            "lmserve_stream_idle_timeouts", "Streams cancelled because their reader took no message for "
            "--stream-idle-timeout seconds", registry=r)
        for protocol in PROTOCOLS:  # every series exists from the start, so rate() counts the first ones
            self.ttft.labels(protocol=protocol)
            self.e2e.labels(protocol=protocol)
            for reason in FinishReason:
                self.requests.labels(status=request_status(reason), finish_reason=reason.value, protocol=protocol)
        # stalls: a long prompt's chunk makes a "mixed" step; its streams wait for all of it
        self.step_by_kind = Histogram("lmserve_step_duration_seconds", "Duration of one engine step by kind: "
                                      "decode (decode rows only), mixed (decode rows + prefill), prefill (prefill only)",
                                      ["kind"], buckets=STEP_BUCKETS, registry=r)
        self.step_prefill = Histogram("lmserve_step_prefill_tokens", "Prompt tokens prefilled by a step that prefills, by kind",
                                      ["kind"], buckets=TOKEN_BUCKETS, registry=r)
        for kind in KINDS:
            self.step_by_kind.labels(kind=kind)
            if kind != "decode":
                self.step_prefill.labels(kind=kind)
        r.register(_LiveCollector(self))
        engine.observers.append(self)

    # ---- EngineObserver ---------------------------------------------------------------
    def on_step(self, seconds, batch) -> None:
        self.step.observe(seconds)
        self._last_batch = len(batch.decode) + len(batch.prefill)
        prefill = sum(c.length for c in batch.prefill)
        kind = step_kind(len(batch.decode), prefill)
        self.step_by_kind.labels(kind=kind).observe(seconds)
        if prefill:
            self.step_prefill.labels(kind=kind).observe(prefill)

    def on_tokens(self, seq, count, gap_seconds) -> None:
        self.generated_tokens.inc(count)
        if gap_seconds is not None:  # several tokens in one step (an accepted draft): the gap per token
            for _ in range(count):
                self.itl.observe(gap_seconds / count)

    def on_finish(self, seq, final) -> None:
        protocol = seq.request.origin or "engine"
        self.requests.labels(status=request_status(final.finish_reason), finish_reason=final.finish_reason.value,
                             protocol=protocol).inc()
        if seq.first_scheduled is not None:
            self.queue.observe(final.timings.queue_seconds)
        if seq.first_token is not None:
            self.ttft.labels(protocol=protocol).observe(final.timings.time_to_first_token_seconds)
        self.e2e.labels(protocol=protocol).observe(final.timings.total_seconds)
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
            _gauge("lmserve_waiting_requests", "Requests waiting for admission (or preempted, to be resumed)", st.waiting),
            _gauge("lmserve_kv_slots_used", "KV cache slots held by running requests", st.slots_used),
            _gauge("lmserve_kv_slots_capacity", "Requests admitted at once at most (--max-batch)", st.max_batch),
            _gauge("lmserve_kv_cache_bytes", "KV cache budget: the most K/V memory held, prefix cache included",
                   st.kv_cache_bytes),
            _gauge("lmserve_kv_cache_used_bytes", "KV cache bytes holding running requests' tokens",
                   eng.cache.token_bytes * st.cached_tokens),
            _gauge("lmserve_kv_cache_committed_bytes", "KV memory held in pages: running requests and prefix cache",
                   st.kv_pages_used * st.kv_page_bytes),
            _gauge("lmserve_prefix_cache_bytes", "KV memory held by prefix-cache entries",
                   st.prefix_cache_pages * st.kv_page_bytes),
            _gauge("lmserve_prefix_cache_entries", "Finished requests whose K/V the prefix cache keeps",
                   st.prefix_cache_entries),
            _counter("lmserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                     st.prefix_queried_tokens_total),
            _counter("lmserve_prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the prefix cache",
                     st.prefix_hit_tokens_total),
            _counter("lmserve_prefix_cache_evictions", "Prefix-cache entries evicted for memory or slots",
                     st.prefix_cache_evictions_total),
            _counter("lmserve_preemptions", "Running requests preempted (to be recomputed) when KV memory ran out",
                     st.preemptions_total),
            _counter("lmserve_speculative_draft_tokens", "Tokens drafted by prompt lookup and verified (--speculation)",
                     st.drafted_tokens_total),
            _counter("lmserve_speculative_accepted_tokens", "Drafted tokens the model agreed with (each saved a step)",
                     st.accepted_tokens_total),
            _gauge("lmserve_batch_size", "Sequences in the last engine step", self.m._last_batch),
            _gauge("lmserve_model_weights_bytes", "Bytes of model parameters", lm.weight_bytes),
            _gauge("lmserve_model_step_weight_bytes", "Bytes of weights a batch-1 decode step reads (every linear, "
                   "the LM head included)", lm.step_weight_bytes),
            _gauge("lmserve_step_target_seconds", "Step time the prefill budget aims at while requests decode "
                   "(NaN: none now: no decode rows, not measured yet, or --max-step-ms 0)", _target_seconds(eng)),
            _gauge("lmserve_process_peak_resident_memory_bytes", "Peak resident set size of the process",
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        )
        if eng.cores is not None:
            yield _gauge("lmserve_step_threads", "CPU threads the next engine step runs on (one while other processes "
                         "keep the cores busy, --adaptive-threads)", eng.cores.threads)
            yield _counter("lmserve_step_thread_reductions", "Times engine steps went to one thread because other "
                           "processes kept the cores busy", eng.cores.reductions)
        if eng.adapters is not None:
            yield _gauge("lmserve_lora_resident_adapters", "LoRA adapters resident in their slots (--max-loras)",
                         st.lora_resident)
            yield _gauge("lmserve_lora_known_adapters", "LoRA adapters a request may choose", len(eng.adapters.known))
            yield _counter("lmserve_lora_loads", "LoRA adapters written into a slot (first loads and reloads after "
                           "an eviction)", st.lora_loads_total)
            yield _counter("lmserve_lora_evictions", "Resident LoRA adapters evicted for another (none of its "
                           "requests running)", st.lora_evictions_total)
            yield _gauge("lmserve_lora_slots_bytes", "Bytes of the LoRA slots (--max-loras x --max-lora-rank)",
                         eng.adapters.slots.nbytes)
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


def _target_seconds(engine) -> float:
    budget = getattr(engine, "step_pacer", None)
    target = None if budget is None else budget.last_target_ms
    return float("nan") if target is None else target / 1000.0


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)  # exposed as name_total
