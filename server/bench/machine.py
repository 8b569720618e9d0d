"""What the in-process benchmarks share about this machine: its cache size, the order candidates take
turns in, and the model the shared flags name."""

from __future__ import annotations

from pathlib import Path


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size in bytes as sysfs gives it for CPU 0 (`default` where it gives none).
    A benchmark that means to read from memory must first read past this: it ranged from 32 MiB (the
    EPYCs) to 480 MiB (a Xeon VM) on the machines seen so far."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        try:
            n = int(text.rstrip("KMG"))
        except ValueError:
            continue
        sizes.append(n << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
    return max(sizes, default=default)


def taking_turns(items, round_index: int) -> list:
    """`items` in the order a benchmark round runs them: as given in even rounds, reversed in odd ones. On
    the 2-core VMs a pass run right after another ran ~10% faster, so no candidate may always go second."""
    items = list(items)
    return items if round_index % 2 == 0 else items[::-1]


def load_from_arguments(args, **kwargs):
    """The model the shared flags name (--model, --models-dir, --dtype, --quantization, --device), loaded
    with the precision chosen as the server chooses it; --threads, when given, set first."""
    import torch

    from lmserve.model.loader import load_model

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=args.dtype, quantization=args.quantization, models_dir=args.models_dir,
                      device=args.device, **kwargs)


__all__ = ["last_level_cache_bytes", "load_from_arguments", "taking_turns"]
