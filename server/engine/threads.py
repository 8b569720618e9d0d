"""Steps on one thread while other processes hold this machine's cores (`adaptive_threads`).

A CPU step splits each kernel's rows over the intra-op threads, and every split ends in a join where
the first thread waits for the last. When another process runs on one of the cores, one of the step's
threads is preempted, and each join then waits for the scheduler to run it again: a batch-1 step of a
1B model (some 80 joins) went from 20 ms to 50-1150 ms on the 2-core Zen 4 with one core busy, where
one thread alone took 30 ms.

`CoreShare` watches what the other processes take. Every `period` seconds (at a step's end) it reads
the kernel's busy time of the cores this process may run on (/proc/stat, steal time included: a VM's
host taking the core counts too) less this process's own CPU time. When others used more than the
cores the steps leave free (cores - threads) by `margin` of a core on average, the next steps run on
one thread, with no joins to wait in; once they use less than that by `margin` / 2 again, all threads
return. Every kernel computes each output row on one thread, so the tokens are the same on any number
of threads (the kernel tests check it): only the speed changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Callable

import torch

from lmserve.model.loader import libgomp
from lmserve.model.native.build import usable_cores

log = logging.getLogger("lmserve.engine")

_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def machine_usage(cores: set[int] | None = None) -> tuple[float, float]:
    """(busy seconds of `cores` since boot, all processes; this process's CPU seconds), from
    /proc/stat's per-core lines: user, nice, system, irq, softirq and steal count as busy."""
    cores = usable_cores() if cores is None else cores
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name == "cpu" or int(name[3:]) not in cores:
                continue
            v = [int(x) for x in fields[:8]]
            busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return busy * _TICK, time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)


def _omp_set_num_threads():
    omp = libgomp()
    fn = getattr(omp, "omp_set_num_threads", None) if omp is not None else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int]
    return fn


_OMP_SET = _omp_set_num_threads()


def set_own_threads(n: int) -> None:
    """The calling thread's intra-op threads, only its own: torch.set_num_threads also sets the count
    every thread started later begins with (an engine built after one that went to one thread would
    start on one), where OpenMP's own setter changes the caller's alone. Without libgomp, torch's."""
    torch.get_num_threads()  # torch sets each thread's count on first use: let it, before overriding it
    if _OMP_SET is not None:
        _OMP_SET(n)
    else:
        torch.set_num_threads(n)


def readable() -> bool:
    """Whether this machine tells busy time per core (Linux's /proc/stat)."""
    try:
        machine_usage()
        return True
    except (OSError, ValueError):
        return False


# a start-up timing taken while other processes used more than this many cores on average (beyond the
# cores the measurement leaves free) is not kept on disk: it serves this start, and the next start
# measures again (a decision near its threshold flipped under load and was then cached for good)
BUSY_CORES = 0.5


class Neighbours:
    """What other processes took of this machine's cores while a measurement ran: `with Neighbours() as n:`
    around it, then `n.cores` (average cores used by others) and `n.quiet`. Where busy time per core
    cannot be read, cores is None and the measurement counts as quiet (as before this check)."""

    def __init__(self, usage: Callable[[], tuple[float, float]] = machine_usage, clock: Callable[[], float] = time.monotonic):
        self._usage, self._clock = usage, clock
        self.cores: float | None = None
        self._mark = None

    def __enter__(self) -> "Neighbours":
        try:
            self._mark = (self._clock(), *self._usage())
        except (OSError, ValueError):
            self._mark = None
        return self

    def __exit__(self, *exc) -> None:
        if self._mark is None:
            return
        try:
            busy, own = self._usage()
        except (OSError, ValueError):
            return
        wall0, busy0, own0 = self._mark
        self.cores = max(0.0, (busy - busy0) - (own - own0)) / max(self._clock() - wall0, 1e-6)
        free = max(0, len(usable_cores()) - torch.get_num_threads())
        self.cores = max(0.0, self.cores - free)  # cores the measurement left idle may be used freely

    @property
    def quiet(self) -> bool:
        return self.cores is None or self.cores <= BUSY_CORES


class CoreShare:
    """`before()` / `after()` around each step on the thread that runs the steps; `threads` is the
    count the next step runs on."""

    def __init__(self, threads: int, cores: int | None = None, period: float = 0.25, margin: float = 0.3,
                 usage: Callable[[], tuple[float, float]] = machine_usage, clock: Callable[[], float] = time.monotonic,
                 apply: Callable[[int], None] = set_own_threads):
        if threads < 2 or period <= 0 or margin <= 0:
            raise ValueError("CoreShare needs threads >= 2, a positive period and a positive margin")
        self.full, self.threads = threads, threads
        self.free = (len(usable_cores()) if cores is None else cores) - threads  # cores the steps leave to others
        self.period, self.margin = period, margin
        self._usage, self._clock, self._apply = usage, clock, apply
        self._mark: tuple[float, float, float] | None = None  # (wall, machine busy, own CPU) at the window's start
        self.others = 0.0  # cores the other processes used in the last window
        self.reductions = 0  # times the steps went to one thread

    def before(self) -> None:
        if self._mark is None:  # the first step: the stepping thread's own count, the first window's start
            self._apply(self.threads)
            self._mark = (self._clock(), *self._usage())

    def after(self) -> None:
        now = self._clock()
        if now - self._mark[0] < self.period:
            return
        busy, own = self._usage()
        wall0, busy0, own0 = self._mark
        self._mark = (now, busy, own)
        self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - wall0)
        if self.threads > 1 and self.others > self.free + self.margin:
            self.reductions += 1
            if self.reductions == 1 or self.reductions % 100 == 0:
                log.info("other processes are using %.1f of this machine's cores: engine steps run on one thread "
                         "until they are free (%d times so far)", self.others, self.reductions)
            self._switch(1)
        elif self.threads == 1 and self.others < self.free + self.margin / 2:
            self._switch(self.full)

    def _switch(self, threads: int) -> None:
        self.threads = threads
        self._apply(threads)
