"""KV memory and prefix-cache benchmark: real `lmserve serve` processes with default settings, driven
over gRPC, memory read from their /metrics. Writes reports/kv_memory.json and prints a summary.

    python -m lmserve.server.bench.kv_memory [--out reports/kv_memory.json] [--model smollm2]

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

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lmserve.client import AsyncClient
from lmserve.client.bench_prefix import shared_system_prompt
from lmserve.client.types import ChatMessage, SamplingParams

from .machine import lscpu

GiB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *flags: str):
        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lmserve.client.cli", "serve", "--model", model, "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--http-port", "0", "--log-level", "WARNING", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            try:
                self.metrics()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {self.proc.stderr.read()[-2000:]}")
                time.sleep(0.5)
        raise RuntimeError("server did not start")

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not s.labels:
                    out[s.name] = s.value
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def wait_idle(srv: Server) -> dict[str, float]:
    while True:
        m = srv.metrics()
        if m["lmserve_running_requests"] == 0 and m["lmserve_waiting_requests"] == 0:
            return m
        await asyncio.sleep(0.2)


async def poll_peak(srv: Server, names: tuple[str, ...], stop: asyncio.Event) -> dict[str, float]:
    peak = dict.fromkeys(names, 0.0)
    while not stop.is_set():
        m = await asyncio.to_thread(srv.metrics)
        for n in names:
            peak[n] = max(peak[n], m.get(n, 0.0))
        await asyncio.sleep(0.1)
    return peak


async def wave(srv: Server, prompts: list, params: SamplingParams, peaks: tuple[str, ...]) -> tuple[list, dict]:
    stop = asyncio.Event()
    async with AsyncClient(srv.target, timeout=None, max_retries=0) as client:
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


async def run(model: str) -> dict:
    report: dict = {}
    rss = "process_resident_memory_bytes"
    srv = Server(model)
    try:
        idle = await wait_idle(srv)
        report["idle"] = {"resident_bytes": idle[rss], "kv_budget_bytes": idle["lmserve_kv_cache_bytes"],
                          "max_batch": idle["lmserve_kv_slots_capacity"]}

        # 2. 64 concurrent requests holding ~256 tokens each (~190-token prompt + 64 generated)
        params = SamplingParams(max_new_tokens=64, ignore_eos=True)
        t0 = time.perf_counter()
        res, peak = await wave(srv, [topic_prompt(i, 150) for i in range(64)], params,
                               (rss, "lmserve_kv_cache_committed_bytes", "lmserve_running_requests"))
        after = await wait_idle(srv)
        await asyncio.sleep(1.0)
        after = srv.metrics()
        report["wave_64x256"] = {
            "seconds": time.perf_counter() - t0, "failed": sum(isinstance(r, Exception) for r in res),
            "prompt_tokens_mean": sum(r.usage.prompt_tokens for r in res if not isinstance(r, Exception)) / 64,
            "peak_resident_bytes": peak[rss], "peak_kv_held_bytes": peak["lmserve_kv_cache_committed_bytes"],
            "peak_running": peak["lmserve_running_requests"], "resident_after_bytes": after[rss],
            "prefix_cache_bytes_after": after["lmserve_prefix_cache_bytes"],
            "after_minus_idle_minus_prefix_bytes": after[rss] - idle[rss] - after["lmserve_prefix_cache_bytes"]}

        # 3. 256 concurrent short requests at the default context length
        res, peak = await wave(srv, [f"Count from {i} to {i + 3}:" for i in range(256)],
                               SamplingParams(max_new_tokens=16, ignore_eos=True),
                               ("lmserve_running_requests", "lmserve_kv_slots_used", "lmserve_waiting_requests"))
        report["burst_256_short"] = {"failed": sum(isinstance(r, Exception) for r in res),
                                     "peak_running": peak["lmserve_running_requests"],
                                     "peak_slots_used": peak["lmserve_kv_slots_used"],
                                     "peak_waiting": peak["lmserve_waiting_requests"],
                                     "context_length": 4096}
        await wait_idle(srv)

        # 4. a shared ~1,500-token system prompt
        system = ChatMessage("system", shared_system_prompt(1500))
        one = SamplingParams(max_new_tokens=4, ignore_eos=True)
        async with AsyncClient(srv.target, timeout=None) as client:
            first, n1 = await ttft_of(client, [system, ChatMessage("user", "What is the first rule?")], one)
            second, n2 = await ttft_of(client, [system, ChatMessage("user", "Which rule matters most here?")], one)
            report["shared_system_prompt"] = {"prompt_tokens": [n1, n2], "ttft_first_s": first, "ttft_second_s": second,
                                              "speedup": first / second}

            # 5. a 5-turn conversation: tokens computed per turn = prompt tokens - tokens reused
            history = [ChatMessage("system", "You are a helpful assistant."),
                       ChatMessage("user", "Tell me about the history of the printing press.")]
            turns = []
            for t in range(5):
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
                turns.append({"turn": t + 1, "prompt_tokens": usage.prompt_tokens, "reused": hit,
                              "computed": usage.prompt_tokens - hit, "new_message_tokens": new_tokens, "ttft_s": ttft})
                history += [ChatMessage("assistant", "".join(answer)),
                            ChatMessage("user", ["Go on.", "Who used it first?", "What changed after?",
                                                 "Give one number."][t % 4])]
            report["conversation_5_turns"] = turns

        # 6. a second default server beside the first
        second_srv = Server(model)
        try:
            async with AsyncClient(second_srv.target, timeout=None) as c2, AsyncClient(srv.target, timeout=None) as c1:
                r1, r2 = await asyncio.gather(c1.generate("Hello", max_new_tokens=8), c2.generate("Hello", max_new_tokens=8))
            m1, m2 = srv.metrics(), second_srv.metrics()
            report["two_servers"] = {"both_served": bool(r1.text) and bool(r2.text),
                                     "resident_bytes": [m1[rss], m2[rss]]}
        finally:
            second_srv.stop()
    finally:
        srv.stop()
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default="reports/kv_memory.json")
    args = ap.parse_args(argv)
    report = asyncio.run(run(args.model))
    report["date"] = datetime.date.today().isoformat()
    report["host"] = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                      "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "lscpu": lscpu()}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
