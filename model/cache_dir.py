"""Where this machine's measurements and built kernels are cached, and how a cached file is written.

A leaf: the native build (native/build.py) and the measured choices (tuning/, the server's KV
choice) all keep their files under one cache folder.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("lmserve.model")


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/lmserve, else ~/.cache/lmserve (read when called)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmserve"


def write_cached(path: Path, data: dict, what: str) -> None:
    """A measurement's JSON written to the cache at `path` whole or not at all (a concurrent start reads
    the old file or the new one); a cache that cannot be written (read-only) is logged: measured again
    next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("%s not cached (%s)", what, exc)


__all__ = ["default_cache_dir", "write_cached"]
