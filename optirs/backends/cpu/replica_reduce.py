"""The ``replica_reduce`` capability on the cpu backend: one parallel loop over the elements.

Each element reads every replica once and is written once, so N replicas cost N + 1 passes over
memory. numba is imported when the kernel is first needed, not when the backend is imported.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import hookimpl

_KERNEL: list = []  # the compiled loop, built on first use


def _kernel():
    if not _KERNEL:
        from numba import prange
        from optirs.core.compile_cache import cached_njit

        from optirs.core.compile_cache import prepare_kernel_compilation

        prepare_kernel_compilation()

        @cached_njit(parallel=True, error_model="numpy")
        def replica_reduce(replicas, divisor, average):
            dst = replicas[0]
            for i in prange(dst.shape[0]):
                acc = dst[i]
                for r in range(1, len(replicas)):  # left to right, as numpy's float32 fold
                    acc += replicas[r][i]
                if average:
                    acc = acc / divisor
                dst[i] = acc

        _KERNEL.append(replica_reduce)
    return _KERNEL[0]


class CpuReplicaReduce:
    """Mixin of :class:`optirs.backends.cpu.CpuBackend`: replicas are host numpy arrays."""

    @hookimpl
    def optirs_replica_reduce(self, ctx: Any, replicas: Sequence[Any], average: bool) -> None:
        for i, r in enumerate(replicas):
            if not isinstance(r, np.ndarray):
                raise InvalidParameterError(
                    f"replicas[{i}] is a {type(r).__module__}.{type(r).__name__}, expected a numpy array on the cpu backend"
                )
        from numba.typed import List

        flat = List()
        for r in replicas:
            flat.append(r.reshape(-1))
        _kernel()(flat, np.float32(len(replicas)), bool(average))
