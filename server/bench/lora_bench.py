"""LoRA adapters beside the base alone: c concurrent greedy chat requests (default 32) through the engine,
spread over 1, 4 and 16 distinct random rank-16 adapters (every projection targeted), and the same
requests on the base model, taking turns in every round, in one run.

    lmserve bench lora [--model smollm2] [--adapters 1 4 16] [--rank 16]

Reports output tokens/s of each, its ratio to the base's (medians over the rounds), the engine's
adapter loads, and the resident memory the adapters cost against their own bytes: the RSS of a process
holding every adapter in its slot less that of one serving the base alone (each loads the model in a
fresh interpreter, builds its engine, writes the adapters, returns freed memory, then reads its RSS;
two of each, taking turns, the least of each kind: one process's freed and reused memory would hide or
inflate a few hundred MB). The adapters are PEFT directories written with random weights (in a
temporary directory) at the model's shapes. In the default CPU mode adapter rows run inside the native
step (docs/lora.md).
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

from .engine_wave import chat_prompts, wave
from .machine import load_from_arguments, taking_turns

FLAGS = {"model": "smollm2", "models_dir": None, "dtype": "auto", "quantization": "auto", "device": None,
         "threads": None, "concurrency": [32], "max_new_tokens": 64, "rounds": 2}


def add_arguments(p) -> None:
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16],
                   help="distinct adapters the requests are spread over: one measurement each (default: 1 4 16)")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank (default: 16)")


def write_adapters(root: Path, cfg, n: int, rank: int) -> list[str]:
    """`n` PEFT adapter directories of random weights on every projection; their NAME=PATH specs."""
    import torch
    from safetensors.torch import save_file

    from lmserve.model.linear.lora import PARENT, projection_shapes

    specs = []
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(cfg.num_layers):
            for m, (k, out) in projection_shapes(cfg).items():
                key = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1 / rank ** 0.5
        d = root / f"adapter-{a}"
        d.mkdir()
        save_file(tensors, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                           "target_modules": list(PARENT), "bias": "none"}))
        specs.append(f"a{a}={d}")
    return specs


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _engine_settings(args, c: int, max_len: int, specs: list[str]):
    from lmserve.server.engine.settings import EngineSettings

    lora = dict(lora_modules=tuple(specs), max_loras=len(specs), max_lora_rank=args.rank) if specs else {}
    # no prefix cache: every wave computes its prompts (a hit left from an earlier wave would time one
    # side's prompts and not the other's: waves measured 60-250 tok/s by what the cache still held)
    return EngineSettings(max_batch=c, max_model_len=max_len, speculation="off", prefix_cache=False, **lora)


def _resident(args, c: int, max_len: int, specs: list[str]) -> int:
    """RSS (bytes) of a process that loaded the model and built its engine with `specs`' adapters, every one
    written into its slot (a spawned interpreter runs this)."""
    from lmserve.model.loader import release_freed_memory
    from lmserve.server.engine import Engine

    engine = Engine(load_from_arguments(args), _engine_settings(args, c, max_len, specs))
    if specs:
        for known in engine.adapters.listing():
            engine.adapters.release(engine.adapters.acquire(known.name)[1])
    release_freed_memory()
    return _rss()


def adapters_rss(args, c: int, max_len: int, specs: list[str], rounds: int = 2) -> int:
    """What holding `specs`' adapters resident costs in RSS: fresh processes without them and with them,
    taking turns, the least RSS of each kind (a start that measures what an earlier one cached holds more
    memory for a moment than one that reads it)."""
    import multiprocessing

    rss: dict[bool, list[int]] = {False: [], True: []}
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for _ in range(rounds):
            for with_adapters in (False, True):
                rss[with_adapters].append(pool.apply(_resident, (args, c, max_len, specs if with_adapters else [])))
    return min(rss[True]) - min(rss[False])


def run(args) -> dict:
    from lmserve.server.engine import Engine, Request, SamplingParams

    loaded = load_from_arguments(args)
    c = args.concurrency[0]
    room = loaded.config.max_position_embeddings - args.max_new_tokens - 8  # a small model's short context
    prompts = [p[:room] for p in chat_prompts(loaded.tokenizer, c)]
    max_len = max(map(len, prompts)) + args.max_new_tokens + 8
    most = max(args.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        specs = write_adapters(Path(tmp), loaded.config, most, args.rank)
        rss_slots = adapters_rss(args, c, max_len, specs)
        engine = Engine(loaded, _engine_settings(args, c, max_len, specs))
        slots_bytes = engine.adapters.slots.nbytes
        engine.start()
        try:
            def requests(n_adapters: int):
                names = [""] * c if n_adapters == 0 else [f"a{i % n_adapters}" for i in range(c)]
                random.Random(0).shuffle(names)
                return [Request(list(p), SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True),
                                adapter=n) for p, n in zip(prompts, names)]

            wave(engine, requests(0))  # the first steps warmed
            wave(engine, requests(most))
            rates: dict[int, list[float]] = {n: [] for n in (0, *args.adapters)}
            for r in range(args.rounds):
                for n in taking_turns(rates, r):
                    t0 = time.perf_counter()
                    w = wave(engine, requests(n))
                    rates[n].append(w.tokens / (time.perf_counter() - t0))
            stats = engine.stats()
        finally:
            engine.shutdown()
    base = statistics.median(rates[0])
    results = [{"adapters": n, "tok_s": round(statistics.median(rates[n]), 1),
                "ratio_to_base": round(statistics.median(rates[n]) / base, 3),
                "rounds": [round(x, 1) for x in rates[n]]} for n in args.adapters]
    out = {"mode": loaded.mode, "kernels": loaded.kernels, "concurrency": c, "rank": args.rank,
           "max_new_tokens": args.max_new_tokens, "base_tok_s": round(base, 1),
           "base_rounds": [round(x, 1) for x in rates[0]], "results": results,
           "lora_loads": stats.lora_loads_total, "lora_evictions": stats.lora_evictions_total,
           "adapter_slots_bytes": slots_bytes, "adapter_slots_rss_bytes": rss_slots,
           "adapter_slots_rss_ratio": round(rss_slots / slots_bytes, 3),
           "adapter_path": "inside the native step" if loaded.model.native_step is not None else "torch layers"}
    print(json.dumps(out, indent=1))
    return out
