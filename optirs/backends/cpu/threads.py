"""How many of numba's threads a cpu step runs on.

A parallel region costs a wake-up of every worker and a barrier at its end. On an idle machine
that is a few microseconds; on a busy one (other processes on the cores) the barrier waits for a
worker the scheduler has not run yet, a whole time slice (milliseconds), and a step of a small
model became several times slower than torch's. So a step runs on one thread below
``SERIAL_BELOW`` elements (where a second thread gains less than a region costs even when idle),
and above it on as many threads as the cores other processes leave free (at least one, at most
numba's current thread count), read from the kernel's per-CPU busy time, less this process's
own, over the last quarter second.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

# Elements below which a step runs serially: an Adam step of 2^17 float32 elements takes about
# 0.35 ms on one core of the 2-core EPYC development host, where a second thread saves less than
# the region costs once a core is shared (docs/benchmarks.md, "cpu: small steps on a busy machine").
SERIAL_BELOW = 1 << 17

# How long a reading of the free cores is used before /proc/stat is read again; the first one is
# made once FIRST_S has passed since the backend opened (until then a step runs on one thread).
INTERVAL_S = 0.25
FIRST_S = 0.05

# /proc/stat's per-CPU fields counted as busy: user, nice, system, irq, softirq, steal.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def _cpu_busy_ticks(cpus: frozenset) -> Optional[int]:
    """Busy clock ticks of ``cpus`` since boot (None where /proc/stat cannot be read)."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    total = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total


class FreeCores:
    """The cores of this process's affinity that other processes leave free (module docstring)."""

    def __init__(self) -> None:
        try:
            self.cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = frozenset(range(os.cpu_count() or 1))
        self.cores = len(self.cpus)
        try:
            self._tick = 1.0 / os.sysconf("SC_CLK_TCK")
        except (ValueError, OSError, AttributeError):
            self._tick = 0.01
        self._lock = threading.Lock()
        self._last: Optional[Tuple[float, int, float]] = None
        self._wait = FIRST_S
        self.free = 1  # unknown yet: the cautious count
        self._read(time.monotonic())
        if self._last is None:  # no /proc/stat: every core
            self.free = self.cores

    def __call__(self) -> int:
        now = time.monotonic()
        last = self._last
        if last is None or now - last[0] < self._wait:
            return self.free
        with self._lock:
            self._read(now)
        return self.free

    def _read(self, now: float) -> None:
        busy = _cpu_busy_ticks(self.cpus)
        if busy is None:
            return
        times = os.times()
        own = times.user + times.system
        last = self._last
        if last is not None and now > last[0]:
            others = ((busy - last[1]) * self._tick - (own - last[2])) / (now - last[0])
            self.free = max(1, min(self.cores, self.cores - round(max(0.0, others))))
            self._wait = INTERVAL_S
        self._last = (now, busy, own)


class StepThreads:
    """The thread count of one step: :meth:`running` sets it around the step's kernels."""

    def __init__(self, serial_below: int = SERIAL_BELOW, free: Optional[FreeCores] = None) -> None:
        import numba

        self.serial_below = serial_below
        self.free = free or FreeCores()
        self._get, self._set = numba.get_num_threads, numba.set_num_threads

    def count(self, elements: int, limit: int) -> int:
        """Threads for a step of ``elements`` when numba may use ``limit``."""
        if elements < self.serial_below or limit <= 1:
            return 1
        return max(1, min(limit, self.free()))

    @contextmanager
    def running(self, elements: int) -> Iterator[int]:
        limit = self._get()
        n = self.count(elements, limit)
        if n == limit:
            yield n
            return
        self._set(n)  # numba's count is per launching thread: other threads' steps are not affected
        try:
            yield n
        finally:
            self._set(limit)
