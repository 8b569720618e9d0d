"""The int8 KV cache against the model-dtype cache, side by side in one process.

    lmserve bench kv-cache [--concurrency 1 32] [--rounds 3]

Four parts, each with both caches:
- quality: perplexity and mean KL of the held-out text against this checkpoint in float32 (as
  precision modes are measured), every window prefilled through the cache, so each token attends
  over K/V read back from it;
- decode attention alone: the native decode kernel over all layers for 1, 8 and 32 rows at 512 and
  2,048 keys each (the step's attention time), best of several;
- served: decode tokens/s through the engine while every request decodes (the prompt prefilled
  once, the requests starting from its prefix-cache entry) at c=1 and c=32, for the chat prompt (~30 tokens) and a long one (--long-prompt
  tokens of the held-out text), 128 new tokens, EOS ignored, caches alternating (model, int8, ...),
  with where their greedy tokens first differ;
- capacity: tokens per GiB of KV memory.
This is a benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace

from lmserve.client.bench.harness import MODEL

from . import engine_wave
from .machine import load_from_arguments

FLAGS = {**MODEL, "max_new_tokens": 128, "rounds": 3, "concurrency": [1, 32], "skip": ("quality", "kernel", "served")}


def add_arguments(p) -> None:
    p.add_argument("--long-prompt", type=int, default=1500, help="tokens of the long served prompt")


def quality(loaded, model_name: str, models_dir) -> dict:
    import torch

    from lmserve.model.tuning import quality as Q
    from lmserve.model.loader import load_model

    ids = Q.text_ids(loaded.tokenizer)
    window = min(512, loaded.config.max_position_embeddings)
    ref_model = load_model(model_name, dtype="float32", quantization="none", models_dir=models_dir)
    ref = Q.logits_of(ref_model.model, ids, window)
    del ref_model
    out = {}
    for dtype in (loaded.dtype, torch.int8):
        q = Q.compare(ref, Q.logits_of(loaded.model, ids, window, loaded.attention, dtype), ids, window)
        out[str(dtype).removeprefix("torch.")] = {**q.as_dict(), "within_bounds": q.within_bounds()}
    out["bounds"] = {"max_mean_kl": Q.MAX_MEAN_KL, "max_ppl_ratio": Q.MAX_PPL_RATIO}
    return out


def decode_attention(loaded, rows=(1, 8, 32), keys=(512, 2048), repeats: int = 5) -> list[dict]:
    """ms of one step's decode attention (every layer) over each cache; slots spaced as in serving."""
    import torch

    from lmserve.model.kv_cache import KVCache

    cfg, kernel = loaded.config, loaded.attention.decode_kernel
    H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shape = SimpleNamespace(num_layers=cfg.num_layers, num_kv_heads=Hkv, head_dim=d)
    out = []
    g = torch.Generator().manual_seed(0)
    for B in rows:
        for n in keys:
            row = {"rows": B, "keys": n}
            for dtype in (loaded.dtype, torch.int8):
                cache = KVCache(shape, 2 * B, 4096, dtype)  # mapped: only what is written is resident
                slots = torch.arange(B) * 2
                if dtype == torch.int8:
                    cache.k[:, slots, :, :n] = torch.randint(-127, 128, (cfg.num_layers, B, Hkv, n, d),
                                                             dtype=torch.int8, generator=g)
                    cache.v[:, slots, :, :n] = cache.k[:, slots, :, :n]
                    cache.scales[:, slots, :n] = 0.02
                else:
                    cache.k[:, slots, :, :n] = torch.randn(cfg.num_layers, B, Hkv, n, d, generator=g).to(dtype)
                    cache.v[:, slots, :, :n] = cache.k[:, slots, :, :n]
                qkv = torch.randn(B, 1, H + 2 * Hkv, d, generator=g).to(loaded.dtype)
                q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
                pos = torch.full((B,), n)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for layer in range(cfg.num_layers):
                        kernel(q, k, v, cache.k[layer], cache.v[layer], slots, pos, *cache.scale_views(layer))
                    best = min(best, time.perf_counter() - t0)
                row[f"{str(dtype).removeprefix('torch.')}_ms"] = round(best * 1e3, 2)
                del cache
            names = [k for k in row if k.endswith("_ms")]
            row["speedup"] = round(row[names[0]] / row[names[1]], 3)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def decode_rate(w: engine_wave.Wave) -> float:
    """Tokens a second while every request of the wave decodes: those after the last request's first
    token and up to the first request's last one."""
    t0 = max(s.arrivals[0][0] for s in w.streams)
    t1 = min(s.arrivals[-1][0] for s in w.streams)
    during = sum(1 for s in w.streams for t in s.token_times() if t0 < t <= t1)
    return during / max(t1 - t0, 1e-9)


def served(loaded, prompt: list[int], concurrency: int, max_new: int, rounds: int) -> dict:
    """Decode tokens/s while all `concurrency` requests decode, with each cache, alternating rounds. The
    prompt is prefilled once first (a warm-up request), and the requests start from its prefix-cache
    entry, so they all decode together instead of waiting on each other's prefill."""
    from ..engine import Engine, EngineSettings

    rates = {"model": [], "int8": []}
    tokens = {}
    for _ in range(rounds):
        for kv in rates:  # one engine at a time
            engine = Engine(loaded, EngineSettings(max_batch=concurrency, max_model_len=len(prompt) + max_new + 8,
                                                   speculation="off", kv_cache_dtype=kv)).start()
            try:
                engine_wave.greedy(engine, [prompt], 8)  # warm-up, and the prompt's prefix-cache entry
                w = engine_wave.greedy(engine, [prompt] * concurrency, max_new)
                out, rate = [s.token_ids for s in w.streams], decode_rate(w)
            finally:
                engine.shutdown()
            rates[kv].append(rate)
            tokens.setdefault(kv, out[0])
    base, int8 = statistics.median(rates["model"]), statistics.median(rates["int8"])
    return {"concurrency": concurrency, "prompt_tokens": len(prompt), "decode_tok_s_model": round(base, 1),
            "decode_tok_s_int8": round(int8, 1), "speedup": round(int8 / base, 3),
            "rounds_model": [round(r, 1) for r in rates["model"]], "rounds_int8": [round(r, 1) for r in rates["int8"]],
            "greedy_tokens_equal_before_first_difference": next(
                (i for i, (a, b) in enumerate(zip(tokens["model"], tokens["int8"])) if a != b), len(tokens["model"]))}


def run(args) -> dict:
    import torch

    from lmserve.model.kv_cache import KVCache

    from ..engine.kv_choice import choose_kv_dtype, int8_unavailable
    from .speculation_bench import workloads

    loaded = load_from_arguments(args)
    why = int8_unavailable(loaded)
    if why:
        raise SystemExit(f"an int8 KV cache cannot serve {loaded.mode} here: {why}")
    report = {"mode": loaded.mode, "kernels": loaded.kernels,
              "attention": loaded.attention.describe(), "auto_choice": choose_kv_dtype("auto", loaded).reason,
              "capacity_tokens_per_gib": {str(dt).removeprefix("torch."): 2**30 // KVCache.bytes_per_token(loaded.config, dt)
                                          for dt in (loaded.dtype, torch.int8)}}
    print(json.dumps(report["capacity_tokens_per_gib"]), report["auto_choice"], flush=True)
    if "quality" not in args.skip:
        report["quality"] = quality(loaded, args.model, args.models_dir)
        print(json.dumps(report["quality"]), flush=True)
    if "kernel" not in args.skip:
        report["decode_attention"] = decode_attention(loaded)
    if "served" not in args.skip:
        from lmserve.model.tuning import quality as Q

        text = Q.text_ids(loaded.tokenizer)
        prompts = {"chat": workloads(loaded.tokenizer)["chat"],
                   "long": (text * (args.long_prompt // len(text) + 1))[:args.long_prompt]}
        report["served"] = []
        for name, prompt in prompts.items():
            for c in args.concurrency:
                r = {"workload": name, **served(loaded, prompt, c, args.max_new_tokens, args.rounds)}
                print(json.dumps(r), flush=True)
                report["served"].append(r)
    return report
