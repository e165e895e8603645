"""The opencl backend's device hooks: probing, opening, memory, transfer and staging."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from optirs.backends.opencl.context import (_MISSING, OpenclContext, _cl_array, _NoDevice, describe_device,
                                            select_device)
from optirs.core.errors import BackendUnavailableError, InvalidParameterError
from optirs.core.layout import pack_into
from optirs.plugin.hookspecs import ProbeResult, Staged, hookimpl


class OpenclDevice:
    """OpenCL C kernels through pyopencl, on the device the options (or PYOPENCL_CTX) choose."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        info = {"summary": "pyopencl: OpenCL C float4 kernels on any OpenCL device (GPU preferred; PoCL on CPUs)"}
        try:
            from importlib import metadata

            info["version"] = f"pyopencl {metadata.version('pyopencl')}"
        except Exception:
            pass
        return info

    @hookimpl
    def optirs_probe(self, options: Dict[str, Any]) -> ProbeResult:
        try:
            import pyopencl  # noqa: F401
        except ImportError as exc:
            return ProbeResult(False, f"pyopencl is not installed ({exc}); pip install 'optirs[opencl]' or 'optirs[pocl]'")
        try:
            platform, device, pairs = select_device(options)
        except _NoDevice as exc:
            return ProbeResult(False, str(exc))
        devices = [describe_device(platform, device, selected=True)]
        devices += [describe_device(p, d) for p, d in pairs if d != device]
        return ProbeResult(True, "", tuple(devices))

    @hookimpl
    def optirs_open(self, options: Dict[str, Any]) -> OpenclContext:
        try:
            import pyopencl  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(f"backend 'opencl' needs pyopencl: {exc}") from exc
        try:
            platform, device, _ = select_device(options)
        except _NoDevice as exc:
            raise BackendUnavailableError(f"backend 'opencl' cannot open: {exc}") from None
        return OpenclContext(platform, device, profiling=bool(options.get("profiling", False)))

    # ------------------------------------------------------------ memory and transfer

    @hookimpl
    def optirs_alloc(self, ctx: OpenclContext, size: int, dtype: Any, fill: float) -> Any:
        return ctx.empty(size, dtype, fill)

    @hookimpl
    def optirs_to_device(self, ctx: OpenclContext, array: Any) -> Any:
        host = np.ascontiguousarray(array).reshape(-1)
        out = ctx.empty(host.size, host.dtype)
        if host.size:
            ctx.cl.enqueue_copy(ctx.queue, out.base_data, host, is_blocking=True)
        return out

    @hookimpl
    def optirs_to_host(self, ctx: OpenclContext, array: Any) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array.reshape(-1).copy()
        if not _cl_array(array) or not hasattr(array, "get"):
            raise InvalidParameterError(f"array of type {type(array).__name__}, expected a pyopencl.array.Array")
        return array.get(queue=ctx.queue).reshape(-1)

    @hookimpl
    def optirs_stage(self, ctx: OpenclContext, params: List[Any], grads: List[Any], fmt: Any) -> Staged:
        if fmt is not None:
            return self._formats_stage(ctx, params, grads, fmt)
        return self._stage(ctx, params, grads)

    def _stage(self, ctx: OpenclContext, params: List[Any], grads: List[Any]) -> Staged:
        if all(isinstance(a, np.ndarray) for a in params):
            return _stage_numpy(ctx, params, grads)  # the caller checked that grads match params
        ours, foreign = ctx.queue, {}
        for what, arrays in (("params", params), ("grads", grads)):
            for i, a in enumerate(arrays):
                q = getattr(a, "queue", _MISSING)
                if q is ours:  # the common case: an array made on our queue is ours to step
                    continue
                if isinstance(a, np.ndarray):
                    raise InvalidParameterError(
                        f"{what}[{i}] is a numpy array among pyopencl arrays, expected all numpy or all pyopencl arrays")
                if q is _MISSING or not _cl_array(a) or not hasattr(a, "base_data"):
                    raise InvalidParameterError(
                        f"{what}[{i}] is a {type(a).__module__}.{type(a).__name__}, expected a numpy array or a "
                        "pyopencl.array.Array on the opencl backend")
                if a.size and a.context != ctx.context:
                    raise InvalidParameterError(
                        f"{what}[{i}] belongs to another OpenCL context, expected arrays made on "
                        "optirs.get_backend('opencl').ctx.context (or its .queue)")
                if q is not None and q != ours:
                    foreign[q.int_ptr] = q
        return _stage_device(ctx, params, grads, list(foreign.values()))

    @hookimpl
    def optirs_synchronize(self, ctx: OpenclContext) -> None:
        ctx.queue.finish()


# ---------------------------------------------------------------- staging


def _stage_numpy(ctx: OpenclContext, params: List[np.ndarray], grads: List[np.ndarray]) -> Staged:
    sizes = tuple(int(p.size) for p in params)
    if sum(sizes) == 0:
        return Staged(list(params), list(grads))  # nothing to step
    area = ctx.staging(sizes)
    cl, q = ctx.cl, ctx.queue
    try:
        if area.host_g is None:
            cl.enqueue_copy(q, area.params.flat.base_data, params[0].reshape(-1), is_blocking=True)
            cl.enqueue_copy(q, area.grads.flat.base_data, grads[0].reshape(-1), is_blocking=True)
        else:
            cl.enqueue_copy(q, area.params.flat.base_data, pack_into(area.host_p, params, area.offsets),
                            is_blocking=True)
            cl.enqueue_copy(q, area.grads.flat.base_data, pack_into(area.host_g, grads, area.offsets),
                            is_blocking=True)
    except cl.Error as exc:
        raise ctx.translate(exc, f"uploading {area.total} parameters") from exc

    def finish() -> None:
        if area.host_p is None:
            cl.enqueue_copy(q, params[0].reshape(-1), area.params.flat.base_data, is_blocking=True)
            return
        cl.enqueue_copy(q, area.host_p, area.params.flat.base_data, is_blocking=True)
        for p, o, n in zip(params, area.offsets, area.sizes):
            np.copyto(p.reshape(-1), area.host_p[int(o): int(o) + n])

    return Staged(area.params, area.grads, finish)


def _stage_device(ctx: OpenclContext, params: List[Any], grads: List[Any], foreign: List[Any]) -> Staged:
    """In place. Arrays tied to another queue of the context are ordered with ours by markers."""
    if not foreign:
        return Staged(params, grads)
    cl = ctx.cl
    # Our queue waits for what their queues have queued so far ...
    cl.enqueue_barrier(ctx.queue, wait_for=[cl.enqueue_marker(q) for q in foreign])

    def finish() -> None:  # ... and their queues wait for the step.
        done = cl.enqueue_marker(ctx.queue)
        for q in foreign:
            cl.enqueue_barrier(q, wait_for=[done])

    return Staged(params, grads, finish)
