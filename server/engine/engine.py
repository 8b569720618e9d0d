"""The engine: a thread that loops `batch = scheduler.schedule()`, `out = runner.run(batch)`,
`processor.postprocess(scheduler, step)`, and an asyncio API in front of it.

Who owns what: the scheduler (scheduler.py) plans steps and owns each sequence's lifecycle
(admission, preemption, recorded tokens, finishing); the KV manager (kv_manager.py) its slots,
pages and prefix-cache entries; the runner (runner.py) builds a step's tensors, runs the model and
samples; the output processor (processor.py) records a step's tokens and turns them into chunks
(stops, detokenizing). A launched step is one `scheduler.InFlight` record until its tokens are in. The event loop never calls torch. Requests cross into the engine thread
under a lock; results cross back with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Protocol

import torch

from lmserve.model.cache_dir import read_cached, write_cached
from lmserve.model.config import LongRopeScaling
from lmserve.model.attention.backend import PagedBackend
from lmserve.model.kv_cache import KVCache
from lmserve.model.paged_kv_cache import PagedKVCache
from lmserve.model.loader import LoadedModel, release_thread_pool
from lmserve.model.tuning.precision import measurement_path

from .constraints.compiler import CompiledConstraint, ConstraintCompiler
from .adapters import AdapterNotFoundError, AdapterPool
from .kv_choice import KvChoice, choose_kv_dtype
from .kv_manager import page_weight
from .outputs import GenerationChunk
from .prefix_cache import PrefixCache
from .processor import OutputProcessor, StepOutput
from .errors import RequestValidationError
from .request import FinishReason, Request, SamplingParams, ValidRequest
from .runner import ModelRunner
from .scheduler import InFlight, PrefillChunk, ScheduledBatch, Scheduler
from .threads import CoreShare, Neighbours, readable as core_use_readable
from .sequence import Sequence, SeqStatus
from .settings import EngineSettings
from .ngram import Speculation, word_classes

# auto speculation stays off where drafts would have to be accepted more often than this just to break
# even: a step verifying k drafts that costs c decode steps and keeps a*k of them yields 1 + a*k
# tokens for c, so it pays only above a = (c - 1) / k (k=4: c <= 2.0; k=8: c <= 3.0)
AUTO_SPECULATION_MAX_BREAK_EVEN = 0.25
# a cost measured over that limit while other processes kept the cores busy (threads.Neighbours) is
# measured again this many times, this many seconds apart, before speculation stays off (the fastest
# measurement counts): the start of a server is often the busiest moment of its machine (other replicas
# or peers starting), and the choice holds for its whole life. A cost measured on a quiet machine stands.
AUTO_SPECULATION_REMEASURE = 3
AUTO_SPECULATION_REMEASURE_PAUSE = 0.5
from .step_cost import StepPacer, batch_features
from .streams import ChunkStream, hand_off

log = logging.getLogger("lmserve.engine")

Sink = Callable[[GenerationChunk], None]  # called on the engine thread; or a ChunkStream (event-loop side)


class PhaseTimes:
    """Host time per phase of the engine's steps (seconds, cumulative): where a step's time goes."""

    PHASES = ("schedule", "inputs", "model", "sample", "process", "deliver")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0  # steps that ran the model

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def copy(self) -> "PhaseTimes":
        other = PhaseTimes()
        other.seconds, other.steps = dict(self.seconds), self.steps
        return other

    def per_step_ms(self, since: "PhaseTimes | None" = None) -> dict[str, float]:
        """Milliseconds per step by phase, over every step or those after the `since` copy."""
        base = since or PhaseTimes()
        steps = max(1, self.steps - base.steps)
        return {k: 1e3 * (v - base.seconds[k]) / steps for k, v in self.seconds.items()}


class EngineUnavailableError(Exception):
    """The engine is shutting down or its loop has died; no new requests."""


class EngineObserver(Protocol):
    """Hooks for metrics; called on the engine thread, must be cheap and must not raise."""

    def on_step(self, seconds: float, batch: ScheduledBatch) -> None: ...
    def on_tokens(self, seq: Sequence, count: int, gap_seconds: float | None) -> None:
        """`count` new tokens of `seq` in one step (several where a draft was accepted), `gap_seconds`
        after its previous ones (None for its first)."""
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
    slots_used: int  # slots held by running requests
    max_batch: int  # requests admitted at once (max_batch)
    slots_allocated_total: int  # slots handed to requests ...
    slots_freed_total: int  # ... and given back (freed, or kept as a prefix-cache entry)
    kv_cache_bytes: int  # the KV memory
    cached_tokens: int  # positions held by running requests
    steps: int
    kv_pages_used: int = 0  # running requests' and prefix entries' KV pages
    kv_pages_capacity: int = 0
    kv_page_bytes: int = 0
    kv_pages_allocated_total: int = 0
    kv_pages_freed_total: int = 0
    prefix_cache_entries: int = 0
    prefix_cache_pages: int = 0
    prefix_cache_evictions_total: int = 0
    prefix_queried_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    drafted_tokens_total: int = 0  # speculation: tokens drafted and verified ...
    accepted_tokens_total: int = 0  # ... and those the model agreed with
    preemptions_total: int = 0
    lora_loads_total: int = 0  # adapters written into a slot (first loads and reloads after an eviction)
    lora_evictions_total: int = 0
    lora_resident: int = 0


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV memory when --kv-cache-gb is not given: on CPU 20% of the memory this process may use
    (RAM, or the container's cgroup limit when lower), so two servers and the rest of the machine fit;
    on CUDA 90% of the device memory still free after the weights (vLLM's choice)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return int(0.2 * usable_memory_bytes())


def usable_memory_bytes() -> int:
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


STEP_COSTS_VERSION = 1  # bumped when what _seed_step_costs runs or records changes: cached seeds are then measured again


def _step_costs(d: dict) -> list[tuple[list[float], float]]:
    """The (features, ms) pairs of a recorded seeding (read_cached)."""
    return [([float(v) for v in s["features"]], float(s["ms"])) for s in d["steps"]]


class Engine:
    @staticmethod
    def _rope_regime(loaded: LoadedModel):
        """A LongRoPE model rotates a sequence whose prompt is long with its long factors from position 0
        (llama.Rotary): which, by sequence (the prefix-cache tag, and the runner's RoPE rows); None for
        every other model. Decode steps of such a model are not captured as CUDA graphs (their RoPE rows
        are not their positions)."""
        cfg = loaded.config
        return None if not isinstance(cfg.rope_scaling, LongRopeScaling) else (lambda seq: cfg.rope_row_offset(seq.prompt_len))

    def __init__(self, loaded: LoadedModel, settings: EngineSettings | None = None):
        self.settings = s = settings or EngineSettings()
        self.loaded = loaded
        cfg = loaded.config
        self.max_model_len = min(s.max_model_len or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)
        self.adapters = self._adapters(s, loaded)  # LoRA adapters (adapters.py), None when none are served
        # the attention backend steps are built with: the loaded model's, or the paged one where asked for
        self.attention = loaded.attention
        if s.attention == "paged" and not isinstance(self.attention, PagedBackend):
            self.attention = PagedBackend(loaded.device, cfg, loaded.batch_invariant)
        self.paged = isinstance(self.attention, PagedBackend)  # a paged KV cache (model/paged_kv_cache.py)
        t0 = time.perf_counter()
        self.kv_choice = self._kv_choice(s, loaded)
        self.phases = {"KV choice": time.perf_counter() - t0}  # seconds of the engine's start-up phases
        if loaded.plan is not None:
            loaded.plan.reference = None  # the probe's float32 logits, which the KV check may have used
        self.cache, kv_pages = self._kv_cache(s, loaded)
        c = self.cache
        self.max_batch = min(c.num_slots, s.max_batch or c.num_slots)  # requests admitted at once (what clients are told)
        # learns this device's step costs and sizes prefill chunks to a target step time (0: off)
        self.step_pacer = None if s.max_step_ms == 0 else StepPacer(s.max_step_ms)
        # overlapped steps: the host prepares the next step while the device runs this one (an accelerator
        # runs ahead of the host); a CPU computes the step in the call, so the plain loop stays there
        self.overlap = s.overlap_steps if s.overlap_steps is not None else loaded.device.type == "cuda"
        # CPU steps on one thread while other processes keep the cores busy (threads.py)
        threads = torch.get_num_threads()
        self.cores = (CoreShare(threads) if s.adaptive_threads and loaded.device.type == "cpu" and threads > 1
                      and core_use_readable() else None)
        # constrained decoding: compiled where requests are validated (the edge's worker threads), cached
        self.constraints = ConstraintCompiler(loaded.tokenizer, cfg.vocab_size)
        self.runner = ModelRunner(loaded.model, c, loaded.device, self.attention, self._decode_graphs(s, loaded),
                                  rope_offset=self._rope_regime(loaded))
        t0 = time.perf_counter()
        if self.step_pacer is not None:
            self._seed_step_costs()
        self.phases["step costs"] = time.perf_counter() - t0
        self.verify_cost: float | None = None  # measured by auto speculation: a verifying step / a decode step
        # long_prompt, a quarter of the context: the prompts that would make short neighbours read many empty keys
        t0 = time.perf_counter()
        speculation = self._speculation(s, loaded)
        self.phases["speculation"] = time.perf_counter() - t0
        self.scheduler = Scheduler(c.num_slots, s.max_queue, s.token_budget, long_prompt=max(2, self.max_model_len // 4),
                                   max_batch=s.max_batch, kv_pages=kv_pages, kv_page_tokens=c.page_tokens,
                                   prefix_cache=PrefixCache() if s.prefix_cache else None, release=c.release,
                                   step_pacer=self.step_pacer, speculation=speculation,
                                   prefix_tag=self._prefix_tag(loaded), layer_windows=self._kv_windows,
                                   map_pages=c.map if self.paged else None, adapters=self.adapters)
        self.processor = OutputProcessor(loaded.tokenizer)
        self.observers: list[EngineObserver] = [self.step_pacer] if self.step_pacer else []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink | ChunkStream] = {}
        self.phase_times = PhaseTimes()  # host time per step phase, for benchmarks
        self._delivering = 0  # finished requests whose final chunk is being handed off
        self._cancels: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None
        self._accepting = True

    @staticmethod
    def _adapters(s: EngineSettings, loaded: LoadedModel) -> AdapterPool | None:
        """The adapter pool where adapters are served (--lora-modules, --lora-dir): its slots attached to
        the model, --lora-modules registered (a bad one fails the start, naming it)."""
        if not s.serves_adapters:
            return None
        from lmserve.model.linear.lora import LoraSlots

        if loaded.compiled is not None and loaded.compiled.compiled:
            raise ValueError("LoRA adapters are served on eager layers: start with --compile false")
        slots = LoraSlots(loaded.config, s.max_loras, s.max_lora_rank, loaded.dtype, loaded.device)
        loaded.model.attach_lora(slots)
        pool = AdapterPool(slots, loaded.config, s.lora_dir)
        for name, path in s.lora_pairs():
            if name == loaded.config.name:
                raise ValueError(f"--lora-modules: adapter name {name!r} is the base model's")
            pool.register(name, path)
        return pool

    def _prefix_tag(self, loaded: LoadedModel):
        """The prefix cache's tag of a sequence: its RoPE regime (_rope_regime) and its adapter's
        registration, so K/V is never shared between adapters, nor with the base."""
        rope = self._rope_regime(loaded)
        if self.adapters is None:
            return rope

        def tag(seq: Sequence) -> int:
            base = rope(seq) if rope is not None else 0
            return base if seq.lora is None else hash((base, "lora", seq.lora[1]))
        return tag

    def _kv_choice(self, s: EngineSettings, loaded: LoadedModel) -> KvChoice:
        """The KV cache's dtype: kv_choice.py's choice, or the model's for the paged kernel (which reads it)."""
        if not self.paged:
            return choose_kv_dtype(s.kv_cache_dtype, loaded)  # the model's dtype or int8 (kv_choice.py)
        if s.kv_cache_dtype == "int8":
            raise ValueError("--kv-cache-dtype int8 is served by the native CPU attention kernels only, not by the "
                             "paged attention: start with --kv-cache-dtype model (or auto)")
        return KvChoice(loaded.dtype, "the paged attention kernel reads the model's dtype")

    def _kv_cache(self, s: EngineSettings, loaded: LoadedModel) -> tuple[KVCache, int]:
        """The KV cache in the chosen dtype, and its memory in pages. On CPU slots are virtual (memory is
        committed per page written): max_batch for running requests and as many again for prefix-cache
        entries. Dense (CUDA): the slots the budget holds, at most max_batch, which prefix entries share
        with running requests (a graph-replayed decode step attends over every slot, so more slots
        would cost every step).

        A virtual cache hands sliding-window layers' pages below their window back (kv_manager.py); the
        pages are then counted per group of layers of one window, `kv_page_bytes` each. A dense cache
        keeps every position of every layer: one page spans every layer, as where no layer slides."""
        self.kv_cache_bytes = budget = s.kv_cache_bytes or default_kv_cache_bytes(loaded.device)
        if self.paged:  # pages from a pool: slots are block-table rows, max_batch and as many for prefix entries
            slots = s.max_batch * (2 if s.prefix_cache else 1)
            c = PagedKVCache.from_budget(loaded.config, budget, self.max_model_len, slots, self.kv_choice.dtype,
                                         loaded.device)
            self.kv_cache_bytes, self._kv_windows, self.kv_page_bytes = c.nbytes, (), c.bytes_per_page
            return c, c.num_pages
        slots = s.max_batch * (2 if s.prefix_cache and loaded.device.type == "cpu" else 1)
        c = KVCache.from_budget(loaded.config, budget, self.max_model_len, slots, self.kv_choice.dtype, loaded.device)
        if not c.virtual:  # allocated up front: the budget is what the slots took
            self.kv_cache_bytes = c.nbytes
        self._kv_windows = loaded.config.layer_windows if c.virtual else ()
        weight = page_weight(self._kv_windows)
        self.kv_page_bytes = c.bytes_per_page // weight
        kv_pages = budget // self.kv_page_bytes if c.virtual else c.num_slots * c.pages(c.max_len)
        if kv_pages < weight * c.pages(self.max_model_len):
            raise ValueError(f"KV memory of {budget / 2**20:.0f} MiB holds no request of {self.max_model_len} tokens "
                             f"({c.pages(self.max_model_len) * c.bytes_per_page / 2**20:.0f} MiB); raise "
                             "--kv-cache-gb or lower --max-model-len")
        return c, kv_pages

    def _decode_graphs(self, s: EngineSettings, loaded: LoadedModel):
        """Decode steps captured as CUDA graphs (cuda_graphs.DecodeGraphs) where asked for on CUDA, else None."""
        if not (s.cuda_graphs and loaded.device.type == "cuda" and self._rope_regime(loaded) is None
                and not s.serves_adapters):
            return None
        from .cuda_graphs import DecodeGraphs

        try:
            return DecodeGraphs(loaded.model, self.cache, min(s.max_batch, self.cache.num_slots),
                                attention=self.attention if hasattr(self.attention, "graph_decode") else None)
        except Exception as exc:  # noqa: BLE001 - said plainly, with the way around it
            raise RuntimeError(f"capturing CUDA graphs for decode failed ({exc}); "
                               "start with --cuda-graphs false to decode eagerly") from exc

    def _speculation(self, s: EngineSettings, loaded: LoadedModel) -> Speculation | None:
        """Prompt-lookup speculation, or None. It needs the sequential loop (drafts are built from tokens
        read back; overlapped steps have the latest token still on the device) and, to give exactly the
        tokens of decoding one at a time, kernels whose rows do not depend on the batch."""
        if s.speculation == "off":
            return None
        if self.overlap:
            if s.speculation == "ngram":
                raise ValueError("--speculation ngram needs the sequential loop: start with --overlap-steps false")
            return None
        spec = Speculation(max_draft=s.draft_tokens, max_batch=s.draft_max_batch,
                           classes=word_classes(loaded.tokenizer, loaded.config.vocab_size))
        if s.speculation == "auto":
            if not loaded.batch_invariant:
                return None
            def dear(cost: float) -> bool:
                return (cost - 1.0) / spec.max_draft > AUTO_SPECULATION_MAX_BREAK_EVEN

            path = self._measured_path({"verify_cost": STEP_COSTS_VERSION, "drafts": spec.max_draft})
            self.verify_cost = (read_cached(path, "verify cost", lambda d: float(d["verify_cost"]))
                                if path is not None else None)
            if self.verify_cost is None:  # not measured by an earlier start on this machine, model, mode
                with Neighbours() as first:
                    self.verify_cost = self._verify_cost(spec.max_draft)
                with Neighbours() as neighbours:
                    for _ in range(AUTO_SPECULATION_REMEASURE if not first.quiet else 0):
                        if not dear(self.verify_cost):  # a start beside a busy neighbour measured 3.09x where
                            break                       # starts alone measured 1.7-1.9x: look again later
                        time.sleep(AUTO_SPECULATION_REMEASURE_PAUSE)
                        self.verify_cost = min(self.verify_cost, self._verify_cost(spec.max_draft))
                if path is not None and first.quiet and neighbours.quiet:
                    write_cached(path, {"verify_cost": self.verify_cost}, "speculation's verify cost")
                elif path is not None:  # measured beside busy neighbours: this start's choice, not the next one's
                    log.info("speculation's verify cost not cached: other processes used %.1f cores while it was "
                             "timed; the next start times it again", max(first.cores or 0.0, neighbours.cores or 0.0))
            if dear(self.verify_cost):
                log.info("speculation off: verifying %d drafts costs %.2fx a decode step here", spec.max_draft,
                         self.verify_cost)
                return None
        return spec

    def speculation_summary(self) -> str:
        """For the startup log and GetModelInfo: "ngram (...)" or "off (...)", with the measured cost of
        verifying when auto."""
        spec = self.scheduler.speculation
        cost = f", verifying {self.verify_cost:.2f}x a decode step" if self.verify_cost is not None else ""
        if spec is None:
            return f"off ({self.settings.speculation}{cost})"
        return f"ngram (up to {spec.max_draft} drafts while <= {spec.max_batch} decode{cost})"

    @torch.inference_mode()
    def _seed_step_costs(self, rounds: int = 2) -> None:
        """The step pacer's first fit, from steps run here before any request: decode steps of 1 and of
        up to 8 rows, new prompts of two lengths, and a chunk continuing a prompt half the context in
        (its attention over the cached part is what makes late chunks dear), alone and with the decode
        rows; what they write to the cache is handed back after. Fed only by traffic, the fit cannot
        tell a decode row's cost from a step's until it has seen decode steps of two row counts, and it
        sized a server's first prefill chunks from whichever steps came first: a warm-up whose first
        step verified a draft (5 rows) fitted cheap rows and let 16 prompt tokens ride with a wave's
        decode rows where a plain warm-up let 28-56 (speculative-decoding.md). A warm-up round, then the
        fastest of `rounds`: ~0.25 s for SmolLM2 on 2 cores in the default mode, ~0.75 s in float32. A
        failure here leaves the pacer to learn from traffic, as before, and is logged."""
        if self.max_model_len < 8:
            return
        slots = self.cache.num_slots
        rows = max(1, min(8, self.max_batch, slots - 1))
        short = min(16, self.max_model_len // 4)
        long = min(32, self.max_model_len // 2)
        far = min(2048, self.max_model_len // 2)  # where the continued chunk starts

        def seq(slot: int, prompt_len: int) -> Sequence:
            s = Sequence(Request([0] * prompt_len, SamplingParams(max_new_tokens=1)))
            s.slot, s.status = slot, SeqStatus.RUNNING
            return s

        decodes = tuple(seq(i, 1) for i in range(rows))
        prompt = slots - 1 if slots > rows else 0  # a slot of its own where there is one
        continued = PrefillChunk(seq(prompt, far + short), far, short)
        batches = [ScheduledBatch(decode=decodes[:1]), ScheduledBatch(decode=decodes),
                   ScheduledBatch(prefill=(PrefillChunk(seq(prompt, short), 0, short),)),
                   ScheduledBatch(prefill=(PrefillChunk(seq(prompt, long), 0, long),)),
                   ScheduledBatch(prefill=(continued,))]
        if slots > rows:
            batches.append(ScheduledBatch(decode=decodes, prefill=(continued,)))
        path = self._step_costs_path(batches)
        found = read_cached(path, "step costs", _step_costs) if path is not None else None
        if found is not None and len(found) == len(batches):  # measured by an earlier start on this machine, model, mode and settings
            for x, ms in found:
                self.step_pacer.model.observe(x, ms)
            return
        best = [math.inf] * len(batches)
        try:
            for r in range(rounds + 1):  # the first round warms up (first calls, pages of the cache)
                for i, batch in enumerate(batches):
                    t0 = time.perf_counter()
                    self.runner.run(batch)
                    if self.loaded.device.type == "cuda":
                        torch.cuda.synchronize(self.loaded.device)
                    if r:
                        best[i] = min(best[i], time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - the pacer then learns from traffic alone
            log.warning("the step pacer's first fit was not measured at start (%s); it learns from traffic", exc)
            return
        finally:
            for slot in {*range(rows), prompt}:
                self.cache.release(slot)
        seeds = [(batch_features(batch.decode, batch.prefill), seconds * 1000.0) for batch, seconds in zip(batches, best)]
        for x, ms in seeds:  # the fastest round: a neighbour's burst is not the step's cost
            self.step_pacer.model.observe(x, ms)
        if path is not None:
            write_cached(path, {"steps": [{"features": x, "ms": ms} for x, ms in seeds]}, "seeded step costs")

    def _step_costs_path(self, batches: list[ScheduledBatch]) -> Path | None:
        """Where _seed_step_costs keeps what it measured (_measured_path, keyed also by the seeded batches'
        shapes), so that a restart skips the steps (~2 s of a 1B model's start on 2 cores)."""
        return self._measured_path({"step_costs": STEP_COSTS_VERSION, "batches": [
            [[s.num_cached for s in b.decode], [[c.start, c.length] for c in b.prefill]] for b in batches]})

    def _measured_path(self, what: dict) -> Path | None:
        """Where a start-up measurement of steps (`what` names it) is kept beside the precision plan
        (precision.measurement_path, kernels/steps-<key>.json, keyed also by the KV dtype). None on an
        accelerator (the key names the CPU only) or without a cache directory."""
        if self.loaded.device.type != "cpu":
            return None
        if self.paged:  # another attention than the loaded model's: its own measurements
            what = {**what, "attention": self.attention.name}
        return measurement_path(self.loaded, "steps", {**what, "kv": self.kv_choice.name})

    @torch.inference_mode()
    def _verify_cost(self, k: int, rounds: int = 5) -> float:
        """A batch-1 decode step verifying k drafts over a plain one, timed on this device (the fastest
        of alternating rounds each, on slot 0, handed back after: on a shared VM a neighbour can double
        one step's time, and a median of three flipped this between 1.8x and 2.9x here, near auto's
        limit of 3x for 8 drafts)."""
        seq = Sequence(Request([0], SamplingParams(max_new_tokens=k + 1)))
        seq.slot, seq.status = 0, SeqStatus.RUNNING
        batches = (ScheduledBatch(decode=(seq,)), ScheduledBatch(decode=(seq,), drafts=((0,) * k,)))
        seconds: tuple[list[float], list[float]] = ([], [])
        for r in range(rounds + 1):  # the first round warms up
            for batch, times in zip(batches, seconds):
                t0 = time.perf_counter()
                self.runner.step(batch)
                if self.loaded.device.type == "cuda":
                    torch.cuda.synchronize(self.loaded.device)
                if r:
                    times.append(time.perf_counter() - t0)
        self.cache.release(0)
        plain, verify = (min(t) for t in seconds)
        return verify / plain

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> "Engine":
        release_thread_pool()  # the engine thread's OpenMP workers must be the only pool (see there)
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
        self.constraints.close()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ---------------------------------------------------------------------
    def validate(self, request: Request, compiled: CompiledConstraint | None = None) -> ValidRequest:
        """The request checked against the served model, its constraint compiled for it (`compiled`:
        compiled already by the caller, as the edge's tool-call grammar is); raises
        RequestValidationError naming every bad field. On the caller's thread: the edge calls this on
        its worker threads, never on the event loop. A ValidRequest is returned as it is."""
        if isinstance(request, ValidRequest):
            return request
        request.validate(self.loaded.config.vocab_size, self.max_model_len, self.settings.max_new_tokens_cap)
        if request.adapter and (self.adapters is None or request.adapter not in self.adapters.known):
            raise AdapterNotFoundError(request.adapter)
        constraint = request.params.constraint
        if compiled is None and constraint is not None:
            compiled = self.constraints.compile(constraint)
        return ValidRequest.of(request, compiled)

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request (validated here unless it is a ValidRequest already); its chunks go to `sink`
        (called on the engine thread).

        Raises RequestValidationError, QueueFullError or EngineUnavailableError; nothing is queued then.
        """
        request = self.validate(request)
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

        A reader that falls behind gets its pending chunks merged into one (streams.ChunkStream).
        Leaving the stream early (break, cancellation, error) cancels the request.
        """
        stream = ChunkStream(request.request_id, asyncio.get_running_loop())
        self.submit(request, stream)
        return self._stream(stream)

    async def _stream(self, stream: ChunkStream) -> AsyncIterator[GenerationChunk]:
        done = False
        try:
            while not done:
                chunk = await stream.get()
                done = chunk.finished
                yield chunk
        finally:
            if not done:
                self.cancel(stream.request_id)

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
        sch, kv, pc = self.scheduler, self.scheduler.kv, self.scheduler.kv.prefix_cache
        with self._lock:
            in_flight, waiting = len(self._sinks) + self._delivering, len(sch.waiting)
            return EngineStats(
                running=in_flight - waiting, waiting=waiting, slots_used=len(sch.running),
                max_batch=sch.max_batch, slots_allocated_total=kv.request_slots_total,
                slots_freed_total=kv.request_slots_returned_total, kv_cache_bytes=self.kv_cache_bytes,
                cached_tokens=sum(s.num_cached for s in sch.running), steps=self.phase_times.steps,
                kv_pages_used=kv.pages_used, kv_pages_capacity=kv.kv_pages, kv_page_bytes=self.kv_page_bytes,
                kv_pages_allocated_total=kv.pages_allocated_total, kv_pages_freed_total=kv.pages_freed_total,
                prefix_cache_entries=len(pc) if pc else 0, prefix_cache_pages=pc.pages_held if pc else 0,
                prefix_cache_evictions_total=pc.evicted_total if pc else 0,
                prefix_queried_tokens_total=kv.prefix_queried_tokens_total,
                prefix_hit_tokens_total=kv.prefix_hit_tokens_total, preemptions_total=sch.preemptions_total,
                drafted_tokens_total=sch.drafted_tokens_total, accepted_tokens_total=sch.accepted_tokens_total,
                **self._lora_stats())

    def _lora_stats(self) -> dict:
        a = self.adapters
        if a is None:
            return {}
        return dict(lora_loads_total=a.loads_total, lora_evictions_total=a.evictions_total, lora_resident=a.resident)

    def drop_prefix_cache(self) -> int:
        """Evict every prefix-cache entry (their memory goes back); returns how many."""
        with self._lock:
            return self.scheduler.kv.drop_prefix_cache()

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
            self._end_all("the server is shutting down")

    def _end_all(self, error: str) -> None:
        """The loop is ending: every request still registered gets a final SHUTDOWN chunk, even when
        retiring one of them fails (say, handing its KV pages back); no new request gets in."""
        with self._lock:
            self._accepting = False  # checked under the lock in submit: no request can slip in now
            seqs = [*self.scheduler.waiting, *self.scheduler.running]
            for seq in seqs:
                try:
                    self.scheduler.finish(seq, FinishReason.SHUTDOWN)
                except Exception:  # noqa: BLE001 - the others must still get their end
                    log.exception("retiring %s at shutdown failed", seq.request_id)
            sinks, self._sinks = self._sinks, {}
        finals = []
        for seq in seqs:
            try:
                finals.append((sinks.pop(seq.request_id, None), self._finish(seq, FinishReason.SHUTDOWN, error=error)))
            except Exception:  # noqa: BLE001 - an observer failing must not cost the request its end
                log.exception("finishing %s at shutdown failed", seq.request_id)
        # whoever is still registered (a sequence lost on the way) gets a bare final chunk
        finals += [(sink, GenerationChunk(request_id=rid, finish_reason=FinishReason.SHUTDOWN, error=error))
                   for rid, sink in sinks.items()]
        self._deliver(finals)

    def _step_once(self) -> bool:
        """One engine step; False when there was nothing to do."""
        return self._overlapped_step() if self.overlap else self._sequential_step()

    def _sequential_step(self) -> bool:
        """The heart of the engine: `batch = schedule()`, `out = run(batch)` (model + sampler),
        `postprocess(batch, out)` (record tokens, stops, detokenize, retire), then one hand-off of the
        step's chunks per event loop. The lock is held only around the scheduler's calls."""
        retired, batch = self._schedule()
        if batch.empty:
            self._deliver_step([], retired)
            return bool(retired)
        step = self._launch(batch)
        outputs = self._postprocess(step) if step is not None else []
        self._deliver_step(outputs, retired)
        if step is None:
            self._fail_batch(batch)
        return True

    def _overlapped_step(self) -> bool:
        """Overlapped steps (`overlap_steps`, on CUDA by default) keep one step in flight: step k+1 is
        scheduled and launched before step k's tokens are read back (its decode rows read them on the
        device), then step k is postprocessed and delivered while the device computes k+1. A sequence
        that ends at step k (eos, a stop string) has already been given a row in step k+1, whose token
        is dropped; a length limit is known in advance and costs no row."""
        retired, batch = self._schedule()
        step = None
        if not batch.empty:
            step = self._launch(batch)
            if step is not None:
                with self._lock:
                    self.scheduler.advance(step)
        outputs = []
        in_flight = self.scheduler.in_flight  # launched, tokens not read back: one between loop turns, two for a moment
        if len(in_flight) > (1 if step is not None else 0):  # the step before: its tokens, read back now
            self._wait_oldest()
            outputs = self._postprocess(in_flight[0])
        self._deliver_step(outputs, retired)
        if not batch.empty and step is None:
            self._fail_batch(batch)
        return bool(not batch.empty or outputs or retired)

    def _schedule(self) -> tuple[list[tuple[Sequence, FinishReason]], ScheduledBatch]:
        """Cancels applied, then the next step planned (under the lock); also what retired without compute."""
        t0 = time.perf_counter()
        with self._lock:
            retired = self._apply_cancels()
            batch = self.scheduler.schedule()
        self.phase_times.add("schedule", time.perf_counter() - t0)
        return retired + [(s, s.finish_reason) for s in batch.dropped], batch

    def _wait_oldest(self) -> None:
        """Until the oldest launched step ran (submissions and scrapes, which take the lock, never wait
        on the device); counted as a running step, so a device that hangs shows as a stuck engine."""
        self._step_started = time.monotonic()
        self.scheduler.in_flight[0].wait()
        self._step_started = None

    def _launch(self, batch: ScheduledBatch) -> InFlight | None:
        """Run (overlapped: launch) a step; None if it failed."""
        in_flight = self.scheduler.in_flight
        previous = in_flight[-1].run if in_flight else None
        timing = None
        if self.overlap and self.loaded.device.type == "cuda":  # the step's device time, read after its tokens
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        self._step_started = time.monotonic()
        t0 = time.perf_counter()
        if self.cores is not None:
            self.cores.before()
        try:
            run = self.runner.run(batch, previous)
        except Exception:  # noqa: BLE001 - a failed step fails its requests, not the server
            log.exception("engine step failed; failing its %d request(s)", len(batch.prefill) + len(batch.decode))
            self._step_started = None
            return None
        self._step_started = None
        if self.cores is not None:
            self.cores.after()
        seconds = time.perf_counter() - t0
        if timing is not None:
            timing[1].record()
        self.phase_times.add("inputs", seconds - run.model_seconds - run.sample_seconds)
        self.phase_times.add("model", run.model_seconds)
        self.phase_times.add("sample", run.sample_seconds)
        self.phase_times.steps += 1
        return InFlight(batch, run, seconds, timing)

    def _postprocess(self, step: InFlight) -> list[StepOutput]:
        """A launched step's tokens read back, recorded and turned into chunks (processor.postprocess)."""
        step.wait()
        t0 = time.perf_counter()
        with self._lock:
            for obs in self.observers:
                obs.on_step(step.seconds, step.batch)
            outputs = self.processor.postprocess(self.scheduler, step)
        self.phase_times.add("process", time.perf_counter() - t0)
        return outputs

    def _apply_cancels(self) -> list[tuple[Sequence, FinishReason]]:
        cancels, self._cancels = self._cancels, []
        retired = [s for s in cancels if s.status is not SeqStatus.FINISHED]
        for seq in retired:
            self.scheduler.finish(seq, FinishReason.CANCELLED)
        return [(s, FinishReason.CANCELLED) for s in retired]

    def _deliver_step(self, outputs: list[StepOutput], retired: list[tuple[Sequence, FinishReason]]) -> None:
        """Observers hear of every token and finish; chunks go to their streams in one hand-off.

        A finished request's id is released before its final chunk is handed off (a caller that
        has read it may reuse the id at once); until the hand-off it still counts as running."""
        t0 = time.perf_counter()
        items: list[tuple[str, GenerationChunk]] = []
        finished: list[Sequence] = []
        for o in outputs:
            if o.chunk is None:
                items.append((o.seq.request_id, self._finish(o.seq, o.reason, error="generation failed for this request")))
                finished.append(o.seq)
                continue
            for obs in self.observers:
                obs.on_tokens(o.seq, len(o.chunk.token_ids), o.gap)
            if o.reason is None:
                items.append((o.seq.request_id, o.chunk))
            else:
                items.append((o.seq.request_id, self._finish(o.seq, o.reason, chunk=o.chunk)))
                finished.append(o.seq)
        for seq, reason in retired:
            items.append((seq.request_id, self._finish(seq, reason)))
            finished.append(seq)
        sinks = [(self._sinks.get(rid), chunk) for rid, chunk in items]
        if finished:
            with self._lock:
                self._delivering += len(finished)
                for seq in finished:
                    self._sinks.pop(seq.request_id, None)
        self._deliver(sinks)
        if finished:
            with self._lock:
                self._delivering -= len(finished)
        self.phase_times.add("deliver", time.perf_counter() - t0)

    def _fail_batch(self, batch: ScheduledBatch) -> None:
        seqs = [c.seq for c in batch.prefill] + list(batch.decode)
        with self._lock:
            live = [s for s in seqs if s.status is SeqStatus.RUNNING]
            for seq in live:
                self.scheduler.finish(seq, FinishReason.ERROR)
        self._deliver_step([StepOutput(s, None, FinishReason.ERROR) for s in live], [])

    def _finish(self, seq: Sequence, reason: FinishReason, chunk: GenerationChunk | None = None,
                error: str | None = None) -> GenerationChunk:
        """Tell the observers; returns the final chunk to deliver. The scheduler already handed the
        slot's positions back (KVCache.release: they read as zeros again, so non-finite K/V of a
        poisoned prompt cancelled mid-prefill never reach the next owner), or kept them as a
        prefix-cache entry after a normal finish."""
        final = self.processor.final(seq, reason, time.monotonic(), chunk, error)
        for obs in self.observers:
            obs.on_finish(seq, final)
        return final

    def _deliver(self, items: list[tuple[Sink | ChunkStream | None, GenerationChunk]]) -> None:
        streams = []
        for sink, chunk in items:
            if isinstance(sink, ChunkStream):
                streams.append((sink, chunk))
            elif sink is not None:
                try:
                    sink(chunk)
                except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
                    log.exception("delivering to %s failed", chunk.request_id)
        if streams:
            hand_off(streams, lambda stream: self.cancel(stream.request_id))
