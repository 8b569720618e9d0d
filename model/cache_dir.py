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


def read_cached(path: Path, what: str, parse):
    """parse(the JSON at `path`) as written by write_cached, or None: absent (never measured), or
    unreadable (logged: measured again and written over)."""
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the cached %s at %s is unreadable (%s); measuring again", what, path, exc)
        return None


__all__ = ["default_cache_dir", "read_cached", "write_cached"]
