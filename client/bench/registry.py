"""The benchmarks ``lmserve bench NAME`` runs, one line each.

A benchmark is a module with ``FLAGS`` (the shared flags it takes, with its defaults: harness.SHARED),
optionally ``add_arguments(parser)`` for flags of its own, and ``run(args) -> dict | None`` (its
results, which the harness stamps and writes; None: nothing to report). Client benchmarks drive a
server that is already running and import no torch; the others load a model or start servers on
this machine and need the server extra.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    summary: str  # the line `lmserve bench --help` shows
    client: bool = False  # True: imports no torch, drives a running server, writes a report only when asked


BENCHMARKS = {b.name: b for b in (
    Benchmark("load", "lmserve.client.bench.load",
              "streaming load on a running server (gRPC or any OpenAI API): TTFT, ITL, tokens/s", client=True),
    Benchmark("mixed", "lmserve.client.bench.mixed",
              "steady streams plus long prompts on a running server: ITL during prefill, TTFT", client=True),
    Benchmark("engine", "lmserve.server.bench.engine_bench",
              "output tokens/s: the engine, transformers and the gRPC server side by side"),
    Benchmark("host-ceiling", "lmserve.server.bench.host_ceiling",
              "the engine and both edges around a zero-cost model: the host's tokens/s ceiling"),
    Benchmark("vocab-head", "lmserve.server.bench.vocab_head",
              "the host's cost per token at two vocabularies (49k, 262k): sampling, logprobs, masks, drafts"),
    Benchmark("edge-ttft", "lmserve.server.bench.edge_ttft",
              "time to first token through gRPC and the HTTP API of one server"),
    Benchmark("constrained", "lmserve.server.bench.constrained_bench",
              "inter-token latency with and without a JSON schema; schema compile times"),
    Benchmark("speculation", "lmserve.server.bench.speculation_bench",
              "speculative decoding on and off: tokens/s, acceptance, identical tokens"),
    Benchmark("kv-cache", "lmserve.server.bench.kv_cache_bench",
              "the int8 KV cache beside the model-dtype one: quality, attention time, decode rate"),
    Benchmark("kv-memory", "lmserve.server.bench.kv_memory",
              "memory of default servers under load, and what the prefix cache reuses"),
    Benchmark("lora", "lmserve.server.bench.lora_bench",
              "c=32 over 1, 4 and 16 LoRA adapters beside the base alone: tokens/s ratios, adapter memory"),
    Benchmark("step-profile", "lmserve.server.bench.step_profile",
              "where a batch-1 decode step's time goes: linears, attention, the rest"),
    Benchmark("core-share", "lmserve.server.bench.core_share",
              "decode speed with other processes busy on the cores: steps on one thread beside every thread"),
    Benchmark("quant-kernels", "lmserve.server.bench.quant_kernels",
              "the weight-only linear kernels on a GGUF's weights against the read bandwidth"),
    Benchmark("kquant-kernels", "lmserve.server.bench.kquant_kernels",
              "the K-quant kernel beside the int4 and int8 ones at Llama-3.2-1B's shapes, weights from memory"),
    Benchmark("attention-kernels", "lmserve.server.bench.attention_kernels",
              "prompt and decode attention, beside another revision's kernels if asked"),
    Benchmark("machine-peaks", "lmserve.server.bench.machine_peaks",
              "this CPU's int8 product rate and the rate a decode step's weights are read at"),
    Benchmark("matcher-choice", "lmserve.server.bench.matcher_choice",
              "grammar matcher libraries timed on the same vocabulary and constraints"),
    Benchmark("peer", "lmserve.server.bench.peer_bench",
              "lmserve beside llama.cpp's llama-server on the same GGUF and prompts"),
    Benchmark("house-ab", "lmserve.server.bench.house_ab",
              "served and engine tokens/s and TTFT: this checkout beside another (--base), taking turns"),
    Benchmark("shapes", "lmserve.server.bench.shapes_bench",
              "Llama-3.2-1B/3B and 3.1-8B shapes (random weights): start, memory, chat beside llama.cpp, read bound"),
)}
