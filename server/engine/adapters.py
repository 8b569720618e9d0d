"""The adapters a server knows and the pool of those resident: names, paths, slots, pins, LRU.

Known adapters are names with a path (from --lora-modules, or loaded at runtime under --lora-dir).
At most `max_loras` of them are resident at once, each in a slot of the model's LoraSlots
(model/linear/lora.py) in the activation dtype. A request naming an adapter takes it when the scheduler
admits the request (`acquire`, on the engine thread): already resident, it is pinned; otherwise it is
read from its path into a free slot, or into the least recently used slot no running request pins
(an eviction). When every slot is pinned the request waits in the queue. A finished or preempted
request unpins it (`release`).

Registering and unregistering happen on the edge's threads (under the lock); slots are written only
on the engine thread, between steps. An adapter unloaded while requests run keeps its slot until
the last of them finishes; a new request naming it is refused (AdapterNotFoundError).

Each registration gets a new `uid`: the prefix cache keys on it (the scheduler's prefix tag), so K/V
computed with one adapter is never served to another, nor to an adapter later loaded under the same
name from other files.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from lmserve.model.linear.lora import AdapterError, LoraAdapter, LoraSlots, read_peft

_uids = itertools.count(1)


class AdapterNotFoundError(LookupError):
    """A request or an unload names an adapter the server does not know."""

    def __init__(self, name: str):
        super().__init__(f"the model {name!r} does not exist: neither the base model nor a loaded LoRA adapter")
        self.name = name


@dataclass
class KnownAdapter:
    name: str
    path: Path
    uid: int
    rank: int
    held: LoraAdapter | None = None  # its weights read at registration, dropped once written to a slot


class AdapterPool:
    def __init__(self, slots: LoraSlots, cfg, lora_dir: str | Path | None = None):
        self.slots = slots
        self.cfg = cfg
        self.max_loras, self.max_rank = slots.max_loras, slots.max_rank
        self.lora_dir = Path(lora_dir).resolve() if lora_dir else None
        self._lock = threading.Lock()
        self.known: dict[str, KnownAdapter] = {}
        self._resident: OrderedDict[int, int] = OrderedDict()  # uid -> slot, least recently used first
        self._pins: dict[int, int] = {}  # uid -> running requests holding it
        self._free = list(range(self.max_loras - 1, -1, -1))
        self.loads_total = 0  # adapters written into a slot (first loads and reloads after an eviction)
        self.evictions_total = 0

    # ---- registry (any thread) -----------------------------------------------------------
    def register(self, name: str, path: str | Path) -> KnownAdapter:
        """Read and check the adapter at `path` and know it as `name` (replacing a former one of that
        name). Raises AdapterError (bad files) before anything changes."""
        adapter = read_peft(path, self.cfg, self.max_rank)
        known = KnownAdapter(name, Path(path), next(_uids), adapter.rank, adapter)
        with self._lock:
            former = self.known.get(name)
            self.known[name] = known
            if former is not None:
                self._forget(former.uid)
        return known

    def unregister(self, name: str) -> None:
        with self._lock:
            known = self.known.pop(name, None)
            if known is None:
                raise AdapterNotFoundError(name)
            self._forget(known.uid)

    def _forget(self, uid: int) -> None:
        """A registration that is gone: its slot is free now, or when its last running request finishes."""
        if uid in self._resident and not self._pins.get(uid):
            self._free.append(self._resident.pop(uid))

    def resolve_path(self, path: str) -> Path:
        """A runtime load's path, inside --lora-dir (relative to it, or absolute within it); AdapterError
        when it points elsewhere."""
        if self.lora_dir is None:
            raise AdapterError("runtime adapter loading is off: start the server with --lora-dir DIR")
        p = Path(path)
        full = (p if p.is_absolute() else self.lora_dir / p).resolve()
        if full != self.lora_dir and self.lora_dir not in full.parents:
            raise AdapterError(f"lora_path {path!r} is outside the adapter directory (--lora-dir)")
        return full

    def uid(self, name: str) -> int:
        """The registration of `name`; AdapterNotFoundError when unknown."""
        known = self.known.get(name)
        if known is None:
            raise AdapterNotFoundError(name)
        return known.uid

    def listing(self) -> list[KnownAdapter]:
        with self._lock:
            return sorted(self.known.values(), key=lambda k: k.name)

    @property
    def resident(self) -> int:
        return len(self._resident)

    # ---- residency (engine thread) ----------------------------------------------------------
    def acquire(self, name: str) -> tuple[int, int] | None:
        """(slot, uid) of adapter `name` for a request being admitted, pinned until release(uid); None
        when every slot is pinned by running requests (the request waits). AdapterNotFoundError when
        the adapter was unloaded since the request was validated; AdapterError when its files no longer
        read."""
        with self._lock:
            known = self.known.get(name)
            if known is None:
                raise AdapterNotFoundError(name)
            slot = self._resident.get(known.uid)
            if slot is None:
                slot = self._take_slot()
                if slot is None:
                    return None
                held, known.held = known.held, None
                try:
                    self.slots.write(slot, held if held is not None else read_peft(known.path, self.cfg, self.max_rank))
                except AdapterError:
                    self.slots.clear(slot)
                    self._free.append(slot)
                    raise
                self._resident[known.uid] = slot
                self.loads_total += 1
            self._resident.move_to_end(known.uid)
            self._pins[known.uid] = self._pins.get(known.uid, 0) + 1
            return slot, known.uid

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for uid, slot in self._resident.items():  # least recently used first
            if not self._pins.get(uid):
                del self._resident[uid]
                self.evictions_total += 1
                return slot
        return None

    def release(self, uid: int) -> None:
        with self._lock:
            n = self._pins.get(uid, 0) - 1
            if n > 0:
                self._pins[uid] = n
                return
            self._pins.pop(uid, None)
            if uid in self._resident and all(k.uid != uid for k in self.known.values()):  # unloaded meanwhile
                self._free.append(self._resident.pop(uid))


__all__ = ["AdapterNotFoundError", "AdapterPool", "KnownAdapter"]
