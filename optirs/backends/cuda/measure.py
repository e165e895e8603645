"""The cuda backend's ``measure`` capability: CUDA events, a device-to-device copy as the yardstick."""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import numpy as np

from optirs.plugin.hookspecs import hookimpl


class CudaMeasure:
    """Hook implementations of the ``measure`` capability for the cuda backend."""

    @hookimpl
    def optirs_measure_copy(self, ctx, size: int) -> Tuple[str, Callable[[], None]]:
        src = ctx.cuda.to_device(np.random.default_rng(7).random(size, dtype=np.float32))
        dst = ctx.cuda.device_array(size, np.float32)
        return "device-to-device copy", lambda: dst.copy_to_device(src, stream=ctx.nstream)

    @hookimpl
    def optirs_measure_elapsed_ms(self, ctx, fn: Callable[[], None], reps: int) -> float:
        if ctx.simulator:  # the simulator has no events: host timing
            ctx.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            ctx.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3 / reps
        start, stop = ctx.cuda.event(), ctx.cuda.event()
        start.record(stream=ctx.nstream)  # the stream the launches go on (see CudaContext.use_stream)
        for _ in range(reps):
            fn()
        stop.record(stream=ctx.nstream)
        stop.synchronize()
        return start.elapsed_time(stop) / reps

    @hookimpl
    def optirs_torch_devices(self) -> Tuple[str, ...]:
        return ("cuda",)

    @hookimpl
    def optirs_torch_device(self, ctx) -> Optional[str]:
        if ctx.simulator:
            return None
        try:
            import torch
        except ImportError:
            return None
        return "cuda" if torch.cuda.is_available() else None
