"""The opencl backend's ``measure`` capability: queue-finished host timing, a buffer copy as the yardstick."""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import numpy as np

from optirs.plugin.hookspecs import hookimpl


class OpenclMeasure:
    """Hook implementations of the ``measure`` capability for the opencl backend."""

    @hookimpl
    def optirs_measure_copy(self, ctx, size: int) -> Tuple[str, Callable[[], None]]:
        import pyopencl.array as cla

        src = cla.to_device(ctx.queue, np.random.default_rng(7).random(size, dtype=np.float32))
        dst = cla.zeros(ctx.queue, size, np.float32)
        return "buffer copy", lambda: ctx.cl.enqueue_copy(ctx.queue, dst.data, src.data)

    @hookimpl
    def optirs_measure_elapsed_ms(self, ctx, fn: Callable[[], None], reps: int) -> float:
        ctx.queue.finish()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ctx.queue.finish()
        return (time.perf_counter() - t0) * 1e3 / reps

    @hookimpl
    def optirs_torch_devices(self) -> Tuple[str, ...]:
        return ()  # torch has no OpenCL device

    @hookimpl
    def optirs_torch_device(self, ctx) -> Optional[str]:
        return None  # torch has no OpenCL device
