"""Prompt and decode attention's cost, this build beside another revision's, in one run.

    lmserve bench attention-kernels --baseline-rev HEAD~1

A prompt chunk late in a long prompt attends over thousands of cached keys: with 8 streams decoding
beside it, that attention is most of a mixed step (a 16-token chunk after 2,500 keys: ~10 ms of a
~30 ms step on the 2-core Xeon VM). This times the native prompt-attention call (one layer of
SmolLM2's shape: 9 query heads, 3 kv heads, head_dim 64) for chunks of T tokens after `start`
cached ones, on a bfloat16 and an int8 cache, on the path this machine serves (AMX tiles where the
OS grants them) and on the vector path. With --baseline-rev, the same calls run on a library built
from that git revision's kernel sources, the two taking turns in every round (in turn first: on a
2-core VM a call's run right after another's was ~10% faster), so the ratio is measured side by side. Reports GFLOP/s counting 4 flops per query-key pair and head dimension.

Then the native decode-attention call (decode_rows): a step's 16 layers of Llama-3.2-1B's attention (32
query heads, 8 kv heads, head_dim 64), every row one new token over `keys` cached ones of its own slot,
on a bfloat16 and an int8 cache, each layer's cache its own (a step reads them from memory as the model
does once the weights have passed through the cache). Reports ms a step and the cache's bytes read a
second, against the same baseline. A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ...model.native import build as native
from ...model.attention.decode import DecodeAttention
from ...model.attention.prompt import PromptAttention
from .machine import taking_turns

FLAGS = {"rounds": 7}


def add_arguments(p) -> None:
    p.add_argument("--baseline-rev", default=None, help="a git revision whose kernels run beside this build's")
    p.add_argument("--calls", type=int, default=10, help="calls timed per shape and round (their median)")

SHAPES = ((16, 1000), (16, 2500), (32, 2500), (64, 2500), (512, 0), (512, 2000))
H, HKV, D, LEN = 9, 3, 64, 4096  # SmolLM2-135M's heads and head_dim; a cache slot of 4,096 positions


DECODE_SHAPES = ((1, 600), (8, 600), (32, 300), (8, 4000))  # (rows, cached keys each)
DECODE_HEADS, DECODE_KV_HEADS, DECODE_LAYERS = 32, 8, 16  # Llama-3.2-1B's attention, head_dim D


def library_at(rev: str, into: Path):
    """The native library built from git revision `rev`'s C++ sources and headers under model/ (its own cache folder),
    and the commit `rev` names."""
    root = Path(__file__).resolve().parents[2]
    src = into / "src"
    src.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", rev, "model/"],
                           capture_output=True, text=True, check=True).stdout.split()
    sources = []
    for name in names:
        if name.endswith((".cpp", ".h")):
            path = src / Path(name).name
            path.write_bytes(subprocess.run(["git", "-C", str(root), "show", f"{rev}:{name}"],
                                            capture_output=True, check=True).stdout)
            if name.endswith(".cpp"):
                sources.append(path)
    lib, why = native.build(into / "cache", sources=sorted(sources))
    if lib is None:
        raise SystemExit(f"building {rev}'s kernels failed: {why}")
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    return lib, commit


class SdpaPrompt:
    """What prompt tokens take without the kernel (the SDPA backend's per-sequence call over the cache):
    the T tokens of one slot, from position pos[0] on, attending to keys 0..their position through SDPA
    with a boolean mask, the kv heads repeated for the query heads. A bfloat16 cache only."""

    takes_int8 = False

    def allow_amx(self, on: bool) -> bool:
        return False

    def __call__(self, q, k_cache, v_cache, slots, pos, k_scales=None, v_scales=None):
        T, n = q.shape[0], int(pos[-1]) + 1
        slot, group = int(slots[0]), H // HKV
        k = k_cache[slot, :, :n].repeat_interleave(group, 0)  # [H, n, D]
        v = v_cache[slot, :, :n].repeat_interleave(group, 0)
        mask = torch.arange(n)[None, :] <= pos[:, None]  # [T, n]: True = may attend
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
        return out.transpose(0, 1).reshape(T, H * D)


def random_caches() -> dict[str, tuple]:
    """A bfloat16 and an int8 cache (with its per-position scales) of one layer and two slots, seeded:
    (k, v, k scales, v scales) by name."""
    torch.manual_seed(0)
    caches = {
        "bfloat16": (torch.randn(2, HKV, LEN, D).bfloat16(), torch.randn(2, HKV, LEN, D).bfloat16(), None, None),
        "int8": (torch.randint(-127, 128, (2, HKV, LEN, D), dtype=torch.int8),
                 torch.randint(-127, 128, (2, HKV, LEN, D), dtype=torch.int8)),
    }
    scales = torch.rand(2, LEN, 2, HKV) * 0.01  # KVCache.scale_views' layout: K and V interleaved per position
    caches["int8"] += (scales[:, :, 0], scales[:, :, 1])
    return caches


def _sample(kernels: dict, caches: dict, paths: list[str], rounds: int, calls: int) -> dict:
    """Per (cache, path, tokens, start, kernel): each round's median seconds over `calls` calls (after
    one warm-up call), the kernels taking turns on every shape."""
    samples: dict = {}
    for rnd in range(rounds):
        for cache_name, (k, v, ks, vs) in caches.items():
            for path in paths:
                for T, start in SHAPES:
                    q = torch.randn(T, H, D).bfloat16()
                    slots = torch.ones(T, dtype=torch.long)
                    pos = torch.arange(start, start + T)
                    for name, kernel in taking_turns(kernels.items(), rnd):
                        if (cache_name == "int8" and not getattr(kernel, "takes_int8", True)) or (
                                path == "amx" and isinstance(kernel, SdpaPrompt)):
                            continue
                        was = kernel.allow_amx(path == "amx")
                        kernel(q, k, v, slots, pos, ks, vs)  # warm-up
                        times = []
                        for _ in range(calls):
                            t0 = time.perf_counter()
                            kernel(q, k, v, slots, pos, ks, vs)
                            times.append(time.perf_counter() - t0)
                        kernel.allow_amx(was)
                        samples.setdefault((cache_name, path, T, start, name), []).append(statistics.median(times))
        print(f"round {rnd + 1}/{rounds}", flush=True)
    return samples


def _rows(samples: dict, baseline_rev: str | None) -> list[dict]:
    """A row per sampled call: ms per layer (median over rounds), GFLOP/s, and this build's speedup
    over the baseline where one ran."""
    rows = []
    for (cache_name, path, T, start, name), ts in samples.items():
        ms = statistics.median(ts) * 1e3
        flops = 4 * H * D * sum(start + i + 1 for i in range(T))
        rows.append({"cache": cache_name, "path": path, "tokens": T, "start": start, "kernel": name,
                     "ms_per_layer": round(ms, 4), "gflop_s": round(flops / ms / 1e6, 1)})
    for other, field in ((baseline_rev, "speedup_over_baseline"), ("sdpa", "speedup_over_sdpa")):
        base = {(r["cache"], r["tokens"], r["start"]): r["ms_per_layer"] for r in rows if other and r["kernel"] == other}
        for r in rows:
            key = (r["cache"], r["tokens"], r["start"])
            if r["kernel"] == "this build" and key in base:
                r[field] = round(base[key] / r["ms_per_layer"], 3)
    return rows


def decode_step_caches(rows: int, keys: int, dtype: torch.dtype) -> list[tuple]:
    """A step's layers of caches for `rows` slots holding `keys` positions each (one more for the new
    token), seeded: (k, v, k scales, v scales) per layer, the scales None but in an int8 cache."""
    torch.manual_seed(rows * 10_000 + keys)
    shape = (rows, DECODE_KV_HEADS, keys + 1, D)
    layers = []
    for _ in range(DECODE_LAYERS):
        if dtype == torch.int8:
            scales = torch.rand(rows, keys + 1, 2, DECODE_KV_HEADS) * 0.01 + 1e-3
            layers.append((torch.randint(-127, 128, shape, dtype=torch.int8),
                           torch.randint(-127, 128, shape, dtype=torch.int8), scales[:, :, 0], scales[:, :, 1]))
        else:
            layers.append((torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16(), None, None))
    return layers


def decode_rows(kernels: dict, rounds: int, baseline_rev: str | None) -> list[dict]:
    """Per cache dtype and DECODE_SHAPES entry, each kernel's ms for a step's layers (median over rounds),
    the cache bytes it read a second, and this build's speedup over the baseline; the kernels take turns
    on every shape in every round."""
    samples: dict = {}
    for cache_name, dtype in (("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        for rows, keys in DECODE_SHAPES:
            layers = decode_step_caches(rows, keys, dtype)
            qkv = torch.randn(rows, 1, DECODE_HEADS + 2 * DECODE_KV_HEADS, D).bfloat16()
            q, k, v = qkv[:, :, :DECODE_HEADS], qkv[:, :, DECODE_HEADS:-DECODE_KV_HEADS], qkv[:, :, -DECODE_KV_HEADS:]
            slots, pos = torch.arange(rows), torch.full((rows,), keys, dtype=torch.long)
            for rnd in range(rounds):
                for name, kernel in taking_turns(kernels.items(), rnd):
                    t0 = time.perf_counter()
                    for kc, vc, ks, vs in layers:
                        kernel(q, k, v, kc, vc, slots, pos, ks, vs)
                    samples.setdefault((cache_name, rows, keys, name), []).append(time.perf_counter() - t0)
            del layers
        print(f"decode attention: {cache_name} cache done", flush=True)
    out = []
    for (cache_name, rows, keys, name), ts in samples.items():
        seconds = statistics.median(ts)
        per_key = 2 * D * (1 if cache_name == "int8" else 2) + (8 if cache_name == "int8" else 0)  # K, V (+ scales)
        nbytes = DECODE_LAYERS * rows * DECODE_KV_HEADS * (keys + 1) * per_key
        row = {"cache": cache_name, "rows": rows, "keys": keys, "kernel": name,
               "ms_per_step": round(seconds * 1e3, 3), "cache_gb_s": round(nbytes / seconds / 1e9, 1)}
        if baseline_rev and name == "this build":
            row["speedup_over_baseline"] = round(statistics.median(samples[(cache_name, rows, keys, baseline_rev)])
                                                 / seconds, 3)
        out.append(row)
    return out


def run(args) -> dict:
    lib, _ = native.load()
    if lib is None:
        raise SystemExit("the native kernels are not built on this machine")
    prompt_built = PromptAttention.built(lib)
    kernels = {"this build": PromptAttention(lib), "sdpa": SdpaPrompt()} if prompt_built else {}
    decoders = {"this build": DecodeAttention(lib)}
    baseline_commit = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_rev:
            base_lib, baseline_commit = library_at(args.baseline_rev, Path(tmp))
            decoders[args.baseline_rev] = DecodeAttention(base_lib)
            if prompt_built:
                kernels[args.baseline_rev] = PromptAttention(base_lib)
        rows = []
        if prompt_built:
            paths = ["amx", "vector"] if kernels["this build"].uses_amx(D) else ["vector"]
            rows = _rows(_sample(kernels, random_caches(), paths, args.rounds, args.calls), args.baseline_rev)
        decode = decode_rows(decoders, args.rounds, args.baseline_rev)
    report = {"threads": torch.get_num_threads(), "shape": {"heads": H, "kv_heads": HKV, "head_dim": D},
              "baseline_commit": baseline_commit,
              "timing": "ms per layer call: medians over rounds of each round's median over calls; the kernels take "
                        "turns within every round (sdpa: what prompt tokens take without the kernel, bfloat16 "
                        "cache only)", "rows": rows,
              "prompt_kernel": "built" if prompt_built else "not built on this machine (it needs AVX2)",
              "decode_shape": {"heads": DECODE_HEADS, "kv_heads": DECODE_KV_HEADS, "head_dim": D,
                               "layers": DECODE_LAYERS},
              "decode_timing": "ms for a step's layers, one call a layer: medians over rounds; the kernels take turns "
                               "within every round",
              "decode_rows": decode}
    for r in rows:
        if r["kernel"] == "this build":
            extra = f"  {r['speedup_over_baseline']:.2f}x the baseline" if "speedup_over_baseline" in r else ""
            extra += f"  {r['speedup_over_sdpa']:.2f}x SDPA" if "speedup_over_sdpa" in r else ""
            print(f"{r['cache']:8s} {r['path']:6s} T={r['tokens']:4d} after {r['start']:5d}: "
                  f"{r['ms_per_layer']:.3f} ms ({r['gflop_s']:.0f} GFLOP/s){extra}")
    for r in decode:
        if r["kernel"] == "this build":
            extra = f"  {r['speedup_over_baseline']:.2f}x the baseline" if "speedup_over_baseline" in r else ""
            print(f"decode {r['cache']:8s} {r['rows']:3d} rows x {r['keys']:5d} keys: {r['ms_per_step']:.2f} ms a step "
                  f"({r['cache_gb_s']:.1f} GB/s){extra}")
    return report
