"""The cpu backend's ``measure`` capability: host timing, a parallel copy on every core as the yardstick."""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import numpy as np

from optirs.plugin.hookspecs import hookimpl


_COPY: list = []


def _parallel_copy() -> Callable[[np.ndarray, np.ndarray], None]:
    """The yardstick's copy loop, compiled once per process (a benchmark measures it per case)."""
    if not _COPY:
        from numba import njit, prange

        @njit(parallel=True, cache=False)
        def parallel_copy(a, b):  # every core, as the optimizer kernels use them
            for i in prange(a.shape[0]):
                b[i] = a[i]

        _COPY.append(parallel_copy)
    return _COPY[0]


class CpuMeasure:
    """Hook implementations of the ``measure`` capability for the cpu backend."""

    @hookimpl
    def optirs_measure_copy(self, ctx, size: int) -> Tuple[str, Callable[[], None]]:
        copy = _parallel_copy()
        src = np.random.default_rng(7).random(size, dtype=np.float32)
        dst = np.zeros(size, np.float32)
        copy(src[:64], dst[:64])
        return "numba parallel copy", lambda: copy(src, dst)

    @hookimpl
    def optirs_measure_elapsed_ms(self, ctx, fn: Callable[[], None], reps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps

    @hookimpl
    def optirs_torch_devices(self) -> Tuple[str, ...]:
        return ("cpu",)

    @hookimpl
    def optirs_torch_device(self, ctx) -> Optional[str]:
        return "cpu"
