"""KV memory and prefix-cache benchmark: real `lmserve serve` processes with default settings, driven
over gRPC, memory read from their /metrics; prints a summary.

    lmserve bench kv-memory [--model smollm2]

What it measures (issue: KV memory that follows use, and prefix caching):
1. idle resident memory of a default server;
2. a wave of 64 concurrent requests holding ~256 tokens each: peak and resident memory after it,
   against idle + the prefix cache's bytes;
3. 256 concurrent short requests at the default max_model_len (4096): how many run at once;
4. a shared ~1,500-token system prompt: time to first token of the first and of a second request;
5. a 5-turn conversation: prompt tokens computed (not reused) at each turn;
6. a second default server started beside the first: both serve, resident memory of each.
"""

from __future__ import annotations

import asyncio
import time

from lmserve.client import AsyncClient
from lmserve.client.bench.prefix import shared_system_prompt
from lmserve.client.types import ChatMessage, SamplingParams

from . import served
from .served import Served

GiB = 2**30
FLAGS = {"model": "smollm2", "models_dir": None}


def _server(args):
    """A default server of the model (gRPC and /metrics)."""
    return served.lmserve(["--model", args.model, *(["--models-dir", args.models_dir] if args.models_dir else [])],
                          http=False, metrics=True, startup_timeout=300)


async def wait_idle(srv: Served) -> dict[str, float]:
    while True:
        m = srv.metrics()
        if m["lmserve_running_requests"] == 0 and m["lmserve_waiting_requests"] == 0:
            return m
        await asyncio.sleep(0.2)


async def poll_peak(srv: Served, names: tuple[str, ...], stop: asyncio.Event) -> dict[str, float]:
    peak = dict.fromkeys(names, 0.0)
    while not stop.is_set():
        m = await asyncio.to_thread(srv.metrics)
        for n in names:
            peak[n] = max(peak[n], m.get(n, 0.0))
        await asyncio.sleep(0.1)
    return peak


async def wave(srv: Served, prompts: list, params: SamplingParams, peaks: tuple[str, ...]) -> tuple[list, dict]:
    stop = asyncio.Event()
    async with AsyncClient(srv.grpc_target, timeout=None, max_retries=0) as client:
        poller = asyncio.create_task(poll_peak(srv, peaks, stop))
        results = await asyncio.gather(*(client.generate(p, params) for p in prompts), return_exceptions=True)
        stop.set()
        return results, await poller


def topic_prompt(i: int, words: int) -> list[ChatMessage]:
    notes = " ".join(f"note {k} about topic {i}: causes, effects, one example." for k in range(words // 9))
    return [ChatMessage("system", "You are a helpful assistant."), ChatMessage("user", f"Summarise these notes. {notes}")]


async def ttft_of(client: AsyncClient, prompt, params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    first, usage = None, None
    async for chunk in client.stream(prompt, params):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        usage = chunk.usage or usage
    return first, usage.prompt_tokens


RSS = "process_resident_memory_bytes"


async def _wave_64x256(srv: Served, idle: dict[str, float]) -> dict:
    """64 concurrent requests holding ~256 tokens each (~190-token prompt + 64 generated): peak and
    resident memory after the wave, against idle + the prefix cache's bytes."""
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    t0 = time.perf_counter()
    res, peak = await wave(srv, [topic_prompt(i, 150) for i in range(64)], params,
                           (RSS, "lmserve_kv_cache_committed_bytes", "lmserve_running_requests"))
    await wait_idle(srv)
    await asyncio.sleep(1.0)
    after = srv.metrics()
    return {
        "seconds": time.perf_counter() - t0, "failed": sum(isinstance(r, Exception) for r in res),
        "prompt_tokens_mean": sum(r.usage.prompt_tokens for r in res if not isinstance(r, Exception)) / 64,
        "peak_resident_bytes": peak[RSS], "peak_kv_held_bytes": peak["lmserve_kv_cache_committed_bytes"],
        "peak_running": peak["lmserve_running_requests"], "resident_after_bytes": after[RSS],
        "prefix_cache_bytes_after": after["lmserve_prefix_cache_bytes"],
        "after_minus_idle_minus_prefix_bytes": after[RSS] - idle[RSS] - after["lmserve_prefix_cache_bytes"]}


async def _burst_256_short(srv: Served) -> dict:
    """256 concurrent short requests at the default context length: how many ran at once."""
    res, peak = await wave(srv, [f"Count from {i} to {i + 3}:" for i in range(256)],
                           SamplingParams(max_new_tokens=16, ignore_eos=True),
                           ("lmserve_running_requests", "lmserve_kv_slots_used", "lmserve_waiting_requests"))
    return {"failed": sum(isinstance(r, Exception) for r in res), "peak_running": peak["lmserve_running_requests"],
            "peak_slots_used": peak["lmserve_kv_slots_used"], "peak_waiting": peak["lmserve_waiting_requests"],
            "context_length": 4096}


async def _shared_system_prompt(client: AsyncClient) -> dict:
    """Two questions after one ~1,500-token system prompt: the second's time to first token."""
    system = ChatMessage("system", shared_system_prompt(1500))
    one = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first, n1 = await ttft_of(client, [system, ChatMessage("user", "What is the first rule?")], one)
    second, n2 = await ttft_of(client, [system, ChatMessage("user", "Which rule matters most here?")], one)
    return {"prompt_tokens": [n1, n2], "ttft_first_s": first, "ttft_second_s": second, "speedup": first / second}


async def _conversation(srv: Served, client: AsyncClient, turns: int = 5) -> list[dict]:
    """A conversation of `turns` turns: per turn the prompt tokens computed (prompt tokens - tokens reused
    from the prefix cache) beside the new message's."""
    history = [ChatMessage("system", "You are a helpful assistant."),
               ChatMessage("user", "Tell me about the history of the printing press.")]
    rows = []
    for t in range(turns):
        before = srv.metrics()
        answer, usage, new_msg = [], None, history[-1].content
        ttft, start = None, time.perf_counter()
        async for chunk in client.stream(history, SamplingParams(max_new_tokens=48)):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            answer.append(chunk.text)
            usage = chunk.usage or usage
        m = srv.metrics()
        hit = m["lmserve_prefix_cache_hit_tokens_total"] - before["lmserve_prefix_cache_hit_tokens_total"]
        new_tokens = len((await client.tokenize(new_msg)).token_ids)
        rows.append({"turn": t + 1, "prompt_tokens": usage.prompt_tokens, "reused": hit,
                     "computed": usage.prompt_tokens - hit, "new_message_tokens": new_tokens, "ttft_s": ttft})
        history += [ChatMessage("assistant", "".join(answer)),
                    ChatMessage("user", ["Go on.", "Who used it first?", "What changed after?",
                                         "Give one number."][t % 4])]
    return rows


async def _two_servers(args, srv: Served) -> dict:
    """A second default server started beside the first: whether both serve, each one's resident memory."""
    with _server(args) as second_srv:
        async with AsyncClient(second_srv.grpc_target, timeout=None) as c2, \
                AsyncClient(srv.grpc_target, timeout=None) as c1:
            r1, r2 = await asyncio.gather(c1.generate("Hello", max_new_tokens=8), c2.generate("Hello", max_new_tokens=8))
        m1, m2 = srv.metrics(), second_srv.metrics()
        return {"both_served": bool(r1.text) and bool(r2.text), "resident_bytes": [m1[RSS], m2[RSS]]}


async def measure(args, srv: Served) -> dict:
    """The six measurements of the module's docstring, in its order, on `srv` (a second server for the last)."""
    report: dict = {}
    idle = await wait_idle(srv)
    report["idle"] = {"resident_bytes": idle[RSS], "kv_budget_bytes": idle["lmserve_kv_cache_bytes"],
                      "max_batch": idle["lmserve_kv_slots_capacity"]}
    report["wave_64x256"] = await _wave_64x256(srv, idle)
    report["burst_256_short"] = await _burst_256_short(srv)
    await wait_idle(srv)
    async with AsyncClient(srv.grpc_target, timeout=None) as client:
        report["shared_system_prompt"] = await _shared_system_prompt(client)
        report["conversation_5_turns"] = await _conversation(srv, client)
    report["two_servers"] = await _two_servers(args, srv)
    return report


def summary(r: dict) -> str:
    w, b, s = r["wave_64x256"], r["burst_256_short"], r["shared_system_prompt"]
    lines = [
        f"idle resident: {r['idle']['resident_bytes'] / GiB:.2f} GiB (KV budget {r['idle']['kv_budget_bytes'] / GiB:.2f} GiB, "
        f"max_batch {r['idle']['max_batch']:.0f})",
        f"64 x ~256 tokens: peak resident {w['peak_resident_bytes'] / GiB:.2f} GiB, KV held at peak "
        f"{w['peak_kv_held_bytes'] / GiB:.2f} GiB, after {w['resident_after_bytes'] / GiB:.2f} GiB = idle + prefix cache "
        f"{w['prefix_cache_bytes_after'] / 2**20:.0f} MiB + {w['after_minus_idle_minus_prefix_bytes'] / 2**20:.0f} MiB "
        f"({w['failed']} failed, {w['seconds']:.0f} s)",
        f"256 short at context 4096: peak running {b['peak_running']:.0f}, peak slots {b['peak_slots_used']:.0f}, "
        f"{b['failed']} failed",
        f"shared system prompt ({s['prompt_tokens'][0]} tokens): TTFT {s['ttft_first_s']:.2f} s then "
        f"{s['ttft_second_s']:.3f} s ({s['speedup']:.1f}x)",
    ]
    for t in r["conversation_5_turns"]:
        lines.append(f"turn {t['turn']}: prompt {t['prompt_tokens']}, reused {t['reused']:.0f}, computed "
                     f"{t['computed']:.0f} (new message {t['new_message_tokens']} tokens), TTFT {t['ttft_s']:.3f} s")
    two = r["two_servers"]
    lines.append(f"two default servers: both served {two['both_served']}, resident "
                 + " / ".join(f"{x / GiB:.2f} GiB" for x in two["resident_bytes"]))
    return "\n".join(lines)


def run(args) -> dict:
    import os

    with _server(args) as srv:
        report = asyncio.run(measure(args, srv))
    report["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(summary(report))
    return report
