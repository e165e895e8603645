"""The ``replica_reduce`` capability on the cuda backend: a grid-stride numba.cuda kernel.

Each launch folds up to GROUP replicas into the first (it reads dst and GROUP sources and writes
dst once), so N replicas cost about (N + 1) * 4 / 3 passes over memory instead of 3 (N - 1) for
pairwise adds. Device arrays of any CUDA library (numba, CuPy, torch) are used in place; host
numpy replicas are uploaded, reduced and the result written back into the first.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.plugin.hookspecs import hookimpl

GROUP = 3
BLOCK = 256
BLOCKS_PER_SM = 32  # enough resident blocks to hide memory latency; the loop covers the rest

# numba.cuda, bound on first use: the kernel reads it as a module global (the simulator swaps
# module globals that are numba.cuda for its own while a kernel runs), and importing this module
# must not import numba.
cuda: Any = None
_KERNEL: list = []  # the numba.cuda dispatcher, built on first use


def replica_reduce3(dst, a, b, c, count, divisor, average):
    """dst += a + b + c (the first ``count`` of them, left to right), then / divisor if ``average``."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < dst.shape[0]:
        acc = dst[i]
        if count > 0:
            acc += a[i]
        if count > 1:
            acc += b[i]
        if count > 2:
            acc += c[i]
        if average:
            acc = acc / divisor
        dst[i] = acc
        i += stride


def _kernel(ctx: Any):
    global cuda
    if not _KERNEL:
        from optirs.backends.cuda.kernel_cache import jit as cached_jit

        cuda = ctx.cuda
        _KERNEL.append(cached_jit(replica_reduce3, "replica_reduce3"))
    return _KERNEL[0]


def device_of(array: Any) -> Optional[int]:
    """The index of the GPU an array lives on, where its library says (None: not known)."""
    dev = getattr(array, "device", None)
    if dev is not None:
        if getattr(dev, "type", None) == "cuda":  # torch
            return dev.index
        if hasattr(dev, "id"):  # cupy
            return dev.id
    gpu_data = getattr(array, "gpu_data", None)  # numba DeviceNDArray
    owner = getattr(gpu_data, "context", None)
    if owner is not None and getattr(owner, "device", None) is not None:
        return owner.device.id
    return None


def _flat_device_array(ctx: Any, array: Any, i: int) -> Any:
    if hasattr(array, "copy_to_host"):  # numba (or the simulator's) device array
        return array.reshape(-1)
    if hasattr(array, "__cuda_array_interface__"):
        return ctx.cuda.as_cuda_array(array).reshape(-1)
    raise InvalidParameterError(
        f"replicas[{i}] is a {type(array).__module__}.{type(array).__name__}, expected numpy arrays or CUDA "
        "device arrays (__cuda_array_interface__) on the cuda backend"
    )


class CudaReplicaReduce:
    """Mixin of :class:`optirs.backends.cuda.CudaBackend`."""

    @hookimpl
    def optirs_replica_reduce(self, ctx: Any, replicas: Sequence[Any], average: bool) -> None:
        host = [isinstance(r, np.ndarray) for r in replicas]
        ctx.resolve_stream(replicas[0] if len(replicas) else None)
        if all(host):
            arrays = [ctx.upload(r.reshape(-1)) for r in replicas]
            self._launch(ctx, arrays, average)
            replicas[0].reshape(-1)[...] = ctx.download(arrays[0])
            return
        if any(host):
            raise InvalidParameterError("replicas mix numpy and device arrays, expected all numpy or all device arrays")
        devices = {d for d in (device_of(r) for r in replicas) if d is not None}
        if len(devices) > 1:
            raise UnsupportedOperationError(
                f"replicas live on {len(devices)} different GPUs ({sorted(devices)}); optirs reduces on one device "
                "only. Reduce across devices with a collective: DataParallelOptimizer over torch.distributed (NCCL)"
            )
        self._launch(ctx, [_flat_device_array(ctx, r, i) for i, r in enumerate(replicas)], average)

    @staticmethod
    def _launch(ctx: Any, arrays: List[Any], average: bool) -> None:
        kernel = _kernel(ctx)
        size = int(arrays[0].shape[0])
        if ctx.simulator:  # every simulated thread is a Python thread: keep the grid tiny
            from optirs.backends.cuda.context import SIM_BLOCK, SIM_GRID

            grid, block = SIM_GRID, SIM_BLOCK
        else:
            grid, block = max(1, min(-(-size // BLOCK), ctx.sm_count * BLOCKS_PER_SM)), BLOCK
        dst, rest = arrays[0], arrays[1:]
        groups = [rest[i:i + GROUP] for i in range(0, len(rest), GROUP)] or [[]]
        divisor = np.float32(len(arrays))
        for gi, group in enumerate(groups):
            sources = group + [dst] * (GROUP - len(group))  # unused slots are never read
            kernel[grid, block, ctx.nstream](dst, *sources, np.int32(len(group)), divisor, bool(average and gi == len(groups) - 1))
