"""The ``replica_reduce`` capability on the opencl backend: ``optirs_replica_reduce.cl``.

Replicas are ``pyopencl.array.Array`` s of one OpenCL context (views at an offset into a larger
buffer are fine: the kernel takes element offsets); the reduction runs on the first replica's
queue. Host numpy replicas are uploaded to the backend's queue, reduced and written back.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Sequence

import numpy as np

from optirs.backends.common.opencl_source import program_source
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.plugin.hookspecs import hookimpl

KERNEL_FILE = "optirs_replica_reduce.cl"
GROUP = 3  # replicas folded per launch (the kernel's a, b, c)
GLOBAL_LIMIT = 1 << 20  # work items per launch at most; the kernel loops over the rest
F32 = np.dtype(np.float32)

# (backend context, OpenCL context pointer) -> the built kernel; dropped with the backend context.
_KERNELS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _kernel(ctx: Any, context: Any, device: Any) -> Any:
    per_ctx = _KERNELS.setdefault(ctx, {})
    kernel = per_ctx.get(context.int_ptr)
    if kernel is None:
        import pyopencl as cl

        from optirs.backends.opencl.context import build_program

        # The sum is exact IEEE float32; the mean's division must be too (numba and numpy round it).
        options = []
        if device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
            options.append("-cl-fp32-correctly-rounded-divide-sqrt")
        kernel = build_program(context, device, program_source(KERNEL_FILE), options, "replica_reduce").replica_reduce3
        per_ctx[context.int_ptr] = kernel
    return kernel


def _is_cl_array(a: Any) -> bool:
    return type(a).__module__.startswith("pyopencl") and hasattr(a, "base_data")


class OpenclReplicaReduce:
    """Mixin of :class:`optirs.backends.opencl.OpenclBackend`."""

    @hookimpl
    def optirs_replica_reduce(self, ctx: Any, replicas: Sequence[Any], average: bool) -> None:
        host = [isinstance(r, np.ndarray) for r in replicas]
        if all(host):
            import pyopencl.array as cla

            arrays = [cla.to_device(ctx.queue, np.ascontiguousarray(r).reshape(-1)) for r in replicas]
            self._launch(ctx, arrays, ctx.queue, average)
            replicas[0].reshape(-1)[...] = arrays[0].get(queue=ctx.queue)
            return
        for i, r in enumerate(replicas):
            if not _is_cl_array(r):
                raise InvalidParameterError(
                    f"replicas[{i}] is a {type(r).__module__}.{type(r).__name__}, expected numpy arrays or "
                    "pyopencl.array.Array s on the opencl backend"
                )
        context = replicas[0].context
        for i, r in enumerate(replicas):
            if r.context != context:
                raise UnsupportedOperationError(
                    f"replicas[{i}] belongs to another OpenCL context than replicas[0]; optirs reduces within one "
                    "context only. Reduce across devices with a collective: DataParallelOptimizer over torch.distributed"
                )
        queue = replicas[0].queue if replicas[0].queue is not None else ctx.queue
        if queue.context != context:
            raise InvalidParameterError("replicas[0] has no queue and belongs to another context than the backend's, "
                                        "expected arrays made with a queue")
        self._launch(ctx, list(replicas), queue, average)

    @staticmethod
    def _launch(ctx: Any, arrays: List[Any], queue: Any, average: bool) -> None:
        kernel = _kernel(ctx, queue.context, queue.device)
        size = int(arrays[0].size)
        dst, rest = arrays[0], arrays[1:]
        groups = [rest[i:i + GROUP] for i in range(0, len(rest), GROUP)] or [[]]
        divisor = np.float32(len(arrays))
        for gi, group in enumerate(groups):
            sources = group + [dst] * (GROUP - len(group))  # unused slots are never read
            args = [dst.base_data, np.int64(dst.offset // F32.itemsize)]
            for s in sources:
                args += [s.base_data, np.int64(s.offset // F32.itemsize)]
            kernel(queue, (min(size, GLOBAL_LIMIT),), None, *args, np.int64(size), np.int32(len(group)), divisor,
                   np.int32(average and gi == len(groups) - 1))
