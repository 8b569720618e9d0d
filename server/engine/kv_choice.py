"""Which dtype the KV cache holds: the model's, or int8 codes with a scale per position and head.

An int8 cache (model/kv_cache.py) holds nearly twice the tokens in the same memory, and decode
attention, which at batch 32 mostly streams K/V from memory, reads about half the bytes. Only the
native CPU attention kernels read it (decode and prompt, which then serve every step), and float32
stays the token-exact reference, so int8 needs a bfloat16 model on the native backend. `auto` takes
int8 there when (1) on the held-out text, prefilled through each cache and measured against the
float32 reference (as every precision mode is), the int8 cache adds at most MAX_MEAN_KL to the mean
KL of the model-dtype cache and at most MAX_PPL_RATIO - 1 to its perplexity ratio, and the mode stays
within quality.py's bounds; and (2) the decode kernel, timed on this machine over both caches (32
rows x 1,024 keys, one layer), is not clearly slower on int8 (at least SPEED_FLOOR of the model
dtype's speed: a tie still doubles the tokens that fit). Measuring against float32 rather than
against the model-dtype cache keeps two lossy paths from being charged each other's noise: with one
int8 activation code per product (native-int4-a8), a small change in K/V moves activation codes
across rounding steps, and the two caches differed from each other more than either differed from
float32. Both are measured once per loaded model, so every engine built on it holds the same cache
(a timing near the floor must not give two engines different bits), and kept on disk beside the
precision plan (`<cache_dir>/kernels/kv-<key>.json`, keyed like the plan by the machine, the
checkpoint file, the served mode and kernels), so a restart skips it and makes the same choice.
It scores the precision probe's first sample of the text (quality.FIRST_TOKENS): at a start that measured
the precision mode it takes the probe's float32 reference logits (precision.Plan.reference), else it
reads the checkpoint again for them (~3 s of a SmolLM2 start on 2 cores). The choice and its numbers go in the startup line and GetModelInfo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lmserve.model.cache_dir import read_cached
from lmserve.model.tuning import quality as Q
from lmserve.model.tuning.precision import measurement_path
from lmserve.model.attention.backend import NativeCpuBackend
from lmserve.model.errors import ModelLoadError

from .settings import KV_CACHE_DTYPES as CHOICES

# what the int8 cache may add to a mode's distance from float32 (quality.py): a quarter of each bound
MAX_MEAN_KL = Q.MAX_MEAN_KL / 4
MAX_PPL_RATIO = 1 + (Q.MAX_PPL_RATIO - 1) / 4
QUALITY_TOKENS = Q.FIRST_TOKENS  # the precision probe's first sample: its float32 reference serves both
SPEED_FLOOR = 0.8  # int8 is passed over only when its decode kernel runs below this fraction of the model dtype's speed
log = logging.getLogger("lmserve.engine")
CHECK_VERSION = 3  # bumped when what measure_int8 / decode_speedup measure changes: cached checks are then redone


@dataclass(frozen=True)
class KvChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def int8_unavailable(loaded) -> str | None:
    """Why this loaded model cannot keep an int8 cache, or None when it can."""
    if loaded.device.type != "cpu":
        return f"it is served on CPU only (the native attention kernels), not {loaded.device.type}"
    if loaded.dtype != torch.bfloat16:
        return f"it needs bfloat16 activations ({str(loaded.dtype).removeprefix('torch.')} is served; float32 is the token-exact reference)"
    backend = loaded.attention
    if not isinstance(backend, NativeCpuBackend) or backend.prompt_kernel is None:
        return "it needs the native decode and prompt attention kernels (AVX2), which do not serve here"
    return None


@dataclass(frozen=True)
class CacheQuality:
    """The held-out text through each cache, both against the float32 reference."""
    model: Q.Quality  # the model-dtype cache
    int8: Q.Quality

    @property
    def added_kl(self) -> float:
        return self.int8.mean_kl - self.model.mean_kl

    @property
    def added_ppl(self) -> float:
        return self.int8.ppl_ratio - self.model.ppl_ratio

    def acceptable(self) -> bool:
        return self.int8.within_bounds() and self.added_kl <= MAX_MEAN_KL and self.added_ppl <= MAX_PPL_RATIO - 1

    def describe(self) -> str:
        return (f"mean KL {self.int8.mean_kl:.4f} against float32 with it, {self.model.mean_kl:.4f} with the "
                f"model-dtype cache ({self.added_kl:+.4f}); perplexity x{self.int8.ppl_ratio:.4f} vs "
                f"x{self.model.ppl_ratio:.4f}")


def measure_int8(loaded, tokens: int = QUALITY_TOKENS) -> CacheQuality:
    """Both caches on the held-out text against the float32 reference (quality.compare's numbers)."""
    from lmserve.model.loader import reference_logits

    ids = Q.text_ids(loaded.tokenizer, tokens)
    window = min(512, loaded.config.max_position_embeddings)
    kept = loaded.plan.reference if loaded.plan is not None else None
    if kept is not None and kept[0] == ids and kept[1] == window:  # the precision probe's, at a first start
        ref = kept[2]
    else:
        ref = reference_logits(loaded.source, ids, window)
    return CacheQuality(*(Q.compare(ref, Q.logits_of(loaded.model, ids, window, loaded.attention, dtype), ids, window)
                          for dtype in (loaded.dtype, torch.int8)))


def measured(loaded) -> tuple[CacheQuality, float]:
    """(measure_int8, decode_speedup) of this loaded model: read from the disk cache where this machine
    already checked this checkpoint in this mode, else measured (~3 s for SmolLM2-135M on 2 cores, the
    float32 reference included) and written there, unless other processes kept the cores busy while
    the kernel was timed (threads.Neighbours): the next start then times it again, and this loaded
    model keeps the numbers in memory so that every engine on it holds the same cache."""
    from .threads import Neighbours

    if "kv" in loaded.measured:
        return loaded.measured["kv"]
    path = cache_path(loaded)
    found = read_cached(path, "int8 KV check", _parse) if path is not None else None
    if found is None:
        quality = measure_int8(loaded)
        with Neighbours() as neighbours:
            found = (quality, decode_speedup(loaded))
        if path is not None and neighbours.quiet:
            _write(path, found)
        else:
            loaded.measured["kv"] = found
            if path is not None:
                log.info("int8 KV check not cached: other processes used %.1f cores while it was timed; the "
                         "next start times it again", neighbours.cores)
    return found


def cache_path(loaded) -> Path | None:
    """Where this loaded model's check is cached, or None (no cache directory)."""
    return measurement_path(loaded, "kv", {"kv_check": CHECK_VERSION, "tokens": QUALITY_TOKENS})


def _parse(d: dict) -> tuple[CacheQuality, float]:
    fields = ("tokens", "perplexity", "reference_perplexity", "mean_kl", "top1_agreement")
    q = CacheQuality(*(Q.Quality(**{f: d[which][f] for f in fields}) for which in ("model", "int8")))
    return q, float(d["decode_speedup"])


def _write(path: Path, found: tuple[CacheQuality, float]) -> None:
    from lmserve.model.cache_dir import write_cached

    q, speedup = found
    write_cached(path, {"model": q.model.as_dict(), "int8": q.int8.as_dict(), "decode_speedup": speedup},
                 "int8 KV check")


def decode_speedup(loaded, rows: int = 32, keys: int = 1024, repeats: int = 7) -> float:
    """The decode kernel's time over a model-dtype cache / over an int8 cache, one layer of this model's
    attention shape, best of `repeats` each (~0.1 s)."""
    import time
    from types import SimpleNamespace

    from lmserve.model.kv_cache import KVCache

    cfg = loaded.config
    kernel = loaded.attention.decode_kernel
    shape = SimpleNamespace(num_layers=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, 1, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim, generator=g).to(loaded.dtype)
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
    slots, pos = torch.arange(rows), torch.full((rows,), keys - 1)
    best = {}
    for dtype in (loaded.dtype, torch.int8):
        cache = KVCache(shape, rows, keys, dtype, virtual=False)
        if dtype == torch.int8:
            cache.k.random_(-127, 128, generator=g), cache.v.random_(-127, 128, generator=g)
            cache.scales.fill_(0.02)
        else:
            cache.k.normal_(generator=g), cache.v.normal_(generator=g)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel(q, k, v, cache.k[0], cache.v[0], slots, pos, *cache.scale_views(0))
            times.append(time.perf_counter() - t0)
        best[dtype] = min(times)
    return best[loaded.dtype] / best[torch.int8]


def choose_kv_dtype(request: str, loaded) -> KvChoice:
    """The cache dtype for --kv-cache-dtype `request` (auto, model or int8); ValueError when int8 is
    asked for and cannot be served, saying why."""
    if request not in CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(CHOICES)}, got {request!r}")
    model = str(loaded.dtype).removeprefix("torch.")
    if request == "model":
        return KvChoice(loaded.dtype, f"{model}, the model's dtype (asked)")
    why = int8_unavailable(loaded)
    if request == "int8" and why:
        raise ValueError(f"--kv-cache-dtype int8 cannot be served: {why}; use --kv-cache-dtype model")
    if why:
        return KvChoice(loaded.dtype, f"{model}, the model's dtype: an int8 cache {why}")
    try:
        q, speedup = measured(loaded)
    except (OSError, ModelLoadError) as exc:  # the checkpoint was moved or changed since it was loaded
        unread = f"the checkpoint could not be read again for the float32 reference ({exc})"
        if request == "int8":
            return KvChoice(torch.int8, f"int8 (asked; its quality not measured: {unread})")
        return KvChoice(loaded.dtype, f"{model}: the int8 cache's quality could not be measured: {unread}")
    numbers = q.describe()
    if request == "int8":
        return KvChoice(torch.int8, f"int8 (asked; {numbers})")
    if not q.acceptable():
        return KvChoice(loaded.dtype, f"{model}: an int8 cache would move quality too far ({numbers}; bounds "
                                      f"+{MAX_MEAN_KL:.4f} mean KL, +{MAX_PPL_RATIO - 1:.4f} perplexity ratio)")
    speed = f"decode attention {speedup:.2f}x the {model} cache's speed at 32 rows x 1,024 keys"
    if speedup < SPEED_FLOOR:
        return KvChoice(loaded.dtype, f"{model}: an int8 cache is slower here ({speed}; {numbers})")
    return KvChoice(torch.int8, f"int8: within the quality bounds ({numbers}), {speed}")


__all__ = ["CHOICES", "CacheQuality", "KvChoice", "cache_path", "choose_kv_dtype", "decode_speedup", "int8_unavailable",
           "measure_int8", "measured"]
