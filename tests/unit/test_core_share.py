"""CoreShare (server/engine/threads.py): engine steps go to one thread while other processes keep the
cores busy, and come back to all threads once they are free. The rule is checked on busy times and a
clock given step by step; the machine's own counts are checked against a process that spins; the
engine is checked to step through it and to give the same tokens as an engine that keeps its threads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lmserve.server.engine.threads import CoreShare, machine_usage, readable, set_own_threads
from test_engine_helpers import collect, greedy, random_prompt, random_tiny, running, trained  # noqa: F401 - fixtures by name


class Machine:
    """Feeds CoreShare a clock and busy times: each step takes `step` seconds, in which this process uses
    `own` cores and the others `others` cores."""

    def __init__(self, cores=2, threads=2, **kwargs):
        self.now, self.busy, self.own, self.applied = 0.0, 0.0, 0.0, []
        self.share = CoreShare(threads, cores=cores, usage=lambda: (self.busy, self.own), clock=lambda: self.now,
                               apply=self.applied.append, **kwargs)

    def steps(self, n: int, others: float, own: float = 2.0, step: float = 1 / 32) -> list[int]:
        """n steps; the threads each ran on."""
        seen = []
        for _ in range(n):
            self.share.before()
            seen.append(self.share.threads)
            self.now += step
            self.own += own * step
            self.busy += (own + others) * step
            self.share.after()
        return seen


def test_busy_cores_send_steps_to_one_thread_and_free_ones_bring_them_back():
    m = Machine(period=0.125)  # a window is 4 steps of 1/32 s
    assert m.steps(20, others=0.05) == [2] * 20  # background noise: all threads
    assert m.steps(4, others=1.0) == [2] * 4  # a spinning process: the window's end decides
    assert m.share.threads == 1 and m.share.reductions == 1 and m.share.others == pytest.approx(1.0)
    assert m.steps(20, others=1.0, own=1.0) == [1] * 20  # still busy: one thread
    assert m.steps(4, others=0.0, own=1.0) == [1] * 4  # it stopped: the window's end brings them back
    assert m.steps(10, others=0.0) == [2] * 10
    assert m.applied == [2, 1, 2]  # the stepping thread's count set first, then each switch


def test_the_bounds_leave_room_for_the_cores_the_steps_do_not_use():
    """On 8 cores with 2 threads, others may use 6 cores before the steps feel them; one thread
    returns to two only below 6.15 (hysteresis: no flapping at the edge)."""
    m = Machine(cores=8, threads=2, period=0.125)
    assert m.steps(8, others=6.2) == [2] * 8
    assert m.steps(4, others=6.5) == [2] * 4 and m.share.threads == 1
    assert m.steps(8, others=6.2, own=1.0) == [1] * 8
    assert m.steps(4, others=6.1, own=1.0) == [1] * 4 and m.share.threads == 2


def test_a_window_spans_idle_time_between_steps():
    """The engine may idle between steps: others' use is averaged over the whole window's wall time."""
    m = Machine(period=0.125)
    m.steps(1, others=0.0)
    m.now += 10.0  # ten idle seconds, nothing else busy
    assert m.steps(1, others=0.0) == [2] and m.share.others == pytest.approx(0.0)
    assert m.share.threads == 2


def test_it_needs_two_threads():
    for kwargs in ({"threads": 1}, {"threads": 2, "period": 0}, {"threads": 2, "margin": 0}):
        with pytest.raises(ValueError):
            CoreShare(**kwargs)


@pytest.mark.skipif(not readable(), reason="no /proc/stat on this system")
def test_the_machine_counts_see_another_process_spin():
    """A process that spins for 0.5 s of its own CPU time (however long the machine takes to give it)
    shows in the cores' busy time less this process's own: at least that, less the kernel's tick."""
    busy0, own0 = machine_usage()
    spinner = subprocess.Popen([sys.executable, "-c",
                                "import time\nwhile time.process_time() < 0.5: pass"])
    spinner.wait()
    busy1, own1 = machine_usage()
    assert (busy1 - busy0) - (own1 - own0) >= 0.45


async def test_the_engine_steps_through_it_and_gives_the_same_tokens(random_tiny):
    """An engine told that others hold every core, then none, then every core (windows of one step)
    switches its threads; its greedy tokens are those of an engine that keeps them (adaptive_threads
    off), and its switches reached the stepping thread."""
    import random

    prompt = random_prompt(random.Random(5), 30, random_tiny.config.vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with running(random_tiny, adaptive_threads=False) as engine:
            assert engine.cores is None
            fixed, _ = await collect(engine, greedy_request(prompt))
        seen, t = [], [0.0, 0.0]

        def apply(n):
            set_own_threads(n)
            seen.append(torch.get_num_threads())

        def usage():  # others busy for 3 of every 6 windows
            t[0] += 1.0
            t[1] += 0.0 if int(t[0]) % 6 < 3 else 2.0
            return t[1] + 2.0 * t[0], 2.0 * t[0]

        with running(random_tiny) as engine:
            assert (engine.cores is not None) == readable()
            engine.cores = CoreShare(2, cores=2, period=1e-9, usage=usage, apply=apply)
            flipped, _ = await collect(engine, greedy_request(prompt))
    finally:
        torch.set_num_threads(threads)
    assert flipped.token_ids == fixed.token_ids and len(fixed.token_ids) == 24
    assert engine.cores.reductions >= 3 and seen[:3] == [2, 1, 2]


def test_a_threads_count_set_for_steps_stays_on_that_thread():
    """Set on the stepping thread, the count changes neither this thread's nor a later thread's (an
    engine started after one that went to one thread must not start on one)."""
    import threading

    seen = {}

    def stepping():
        set_own_threads(1)
        seen["stepping"] = torch.get_num_threads()

    threads = torch.get_num_threads()
    t = threading.Thread(target=stepping)
    t.start()
    t.join()
    t = threading.Thread(target=lambda: seen.setdefault("later", torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == {"stepping": 1, "later": threads} and torch.get_num_threads() == threads


def greedy_request(prompt):
    from lmserve.server.engine.request import Request

    return Request(prompt, greedy(24, ignore_eos=True))


@pytest.mark.parametrize("others,quiet", [(0.0, True), (0.4, True), (0.7, False), (1.8, False)])
def test_neighbours_tell_a_measurement_beside_busy_processes(others, quiet, monkeypatch):
    """Neighbours (a start-up timing that may be cached): the cores other processes took while it ran,
    beyond those the measurement's threads left free, against BUSY_CORES."""
    from lmserve.server.engine import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    clock = {"now": 10.0, "busy": 100.0, "own": 5.0}
    n = threads.Neighbours(usage=lambda: (clock["busy"], clock["own"]), clock=lambda: clock["now"])
    with n:
        clock["now"] += 2.0
        clock["own"] += 2 * 2.0  # this process on both cores
        clock["busy"] += (2 + others) * 2.0
    assert n.cores == pytest.approx(others) and n.quiet is quiet


def test_neighbours_count_as_quiet_where_busy_time_cannot_be_read():
    from lmserve.server.engine.threads import Neighbours

    def unreadable():
        raise OSError("no /proc/stat")
    with Neighbours(usage=unreadable) as n:
        pass
    assert n.cores is None and n.quiet
