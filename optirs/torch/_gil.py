"""A shorter GIL switch interval while CPUOffload's chunk steps run.

CPython hands the GIL to a waiting thread when the holder blocks, or after the switch interval
(5 ms by default) at the latest. CPUOffload's chunk steps hand it back and forth between threads
many times a chunk (the workers' front-end step around each kernel, the copies queued back,
``step()``'s checks, autograd's hooks when the steps run in backward), and a thread that wants it
while another runs Python waits up to the interval at each handoff. Beside a thread that runs
Python in bursts of about 5 ms, a step over the 194 small tensors of GPT-2 1.3B's second param
group took 189 ms with Python's interval and 36 ms with this one on the 2-core machine (7 ms with
no such thread; bursts of 0.5 ms or less cost nothing either way: `benchmarks/bench_offload_gil.py`).

:func:`responsive_gil` lowers the interval to :data:`SWITCH_INTERVAL` while any chunk step runs,
and restores what was there when the last one ends: process-wide, as the interval is, and never
higher than what was set (a caller's shorter interval stays). A caller who changes the interval
meanwhile keeps their own value: it is restored only if it is still the lowered one.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

SWITCH_INTERVAL = 5e-4  # seconds

_LOCK = threading.Lock()
_ACTIVE = [0, 0.0, 0.0]  # chunk steps running, the interval found when the first started, the one set


@contextlib.contextmanager
def responsive_gil() -> Iterator[None]:
    with _LOCK:
        if _ACTIVE[0] == 0:
            _ACTIVE[1] = _ACTIVE[2] = sys.getswitchinterval()
            if _ACTIVE[1] > SWITCH_INTERVAL:
                sys.setswitchinterval(SWITCH_INTERVAL)
                _ACTIVE[2] = sys.getswitchinterval()  # as Python keeps it (whole microseconds)
        _ACTIVE[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0 and _ACTIVE[2] != _ACTIVE[1] and sys.getswitchinterval() == _ACTIVE[2]:
                sys.setswitchinterval(_ACTIVE[1])


__all__ = ["SWITCH_INTERVAL", "responsive_gil"]
