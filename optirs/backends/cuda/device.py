"""The cuda backend's device hooks: probing, opening, memory, transfer and staging."""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

import numpy as np

from optirs.backends.cuda.context import (DEFAULT_BLOCK, CudaContext, DeviceList, _simulator, import_failure_reason,
                                          _NUMPY_MISMATCH)
from optirs.core.errors import InvalidParameterError
from optirs.core.layout import pack_into
from optirs.plugin.hookspecs import AddressedArrays, DeviceInfo, ProbeResult, Staged, hookimpl


class CudaDevice:
    """The device hooks: probing, opening, memory, staging."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        return {"summary": "numba.cuda kernels on NVIDIA GPUs (one launch per step, in-place device arrays)"}

    @hookimpl
    def optirs_probe(self, options: Dict[str, Any]) -> ProbeResult:
        try:
            import numba
            from numba import cuda
        except Exception as exc:  # not only ImportError: an incompatible numpy fails with AttributeError
            return ProbeResult(False, import_failure_reason(exc))
        if _simulator():
            return ProbeResult(True, "", (DeviceInfo("numba CUDA simulator", "simulator", None, 1,
                                                     {"numba": numba.__version__}),))
        try:
            # The compiler's array support is what an incompatible numpy breaks (numba-cuda 0.30.4
            # with numpy 2.5: np.row_stack is gone); import it here so the probe says so, rather
            # than the first step.
            importlib.import_module("numba.cuda.np.arrayobj")
        except ModuleNotFoundError:
            pass  # a numba-cuda laid out differently: the first compile will tell
        except Exception as exc:
            return ProbeResult(False, import_failure_reason(exc))
        try:
            from numba.cuda.cudadrv.driver import driver

            count = driver.get_device_count()
        except Exception as exc:
            if any(m in str(exc).lower() for m in _NUMPY_MISMATCH):  # numba.cuda's driver module did not import
                return ProbeResult(False, import_failure_reason(exc))
            # numba's driver-init message ends in " :" (an empty detail): the line ends at its last word
            return ProbeResult(False, "no CUDA GPU: " + " ".join(str(exc).split()).rstrip(" :"))
        if not count:
            return ProbeResult(False, "no CUDA GPU: the driver reports 0 devices")
        devices = []
        try:
            for gpu in cuda.gpus:
                with gpu:
                    d = cuda.get_current_device()
                    name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                    free, total = cuda.current_context().get_memory_info()
                    cc = d.compute_capability
                    devices.append(DeviceInfo(name, "gpu", int(total), int(d.MULTIPROCESSOR_COUNT),
                                              {"compute_capability": f"{cc[0]}.{cc[1]}", "id": d.id,
                                               "numba": numba.__version__}))
        except Exception as exc:
            return ProbeResult(False, "no usable CUDA GPU: " + " ".join(str(exc).split()))
        return ProbeResult(True, "", tuple(devices))

    @hookimpl
    def optirs_open(self, options: Dict[str, Any]) -> CudaContext:
        return CudaContext(options)

    # ------------------------------------------------ memory and transfer

    @hookimpl
    def optirs_alloc(self, ctx: CudaContext, size: int, dtype: Any, fill: float):
        ctx.refuse_capture(ctx.stream, "allocating optimizer state", also_torch=True)
        out = ctx.empty(size, dtype)
        if size:
            if ctx.simulator:
                ctx.write(out, np.full(size, fill, dtype=out.dtype))
            else:
                grid = min(ctx.sm_count * 8, (int(size) + DEFAULT_BLOCK - 1) // DEFAULT_BLOCK)
                ctx.kernels.fill_kernel[grid, DEFAULT_BLOCK, ctx.nstream](out, out.dtype.type(fill))
            # State is made once, before the first step resolves its stream: wait for the fill,
            # so that a step on any stream reads the filled values.
            ctx.sync_stream() if ctx.nstream else ctx.cuda.default_stream().synchronize()
        return out

    @hookimpl
    def optirs_to_device(self, ctx: CudaContext, array: Any):
        host = np.ascontiguousarray(array).reshape(-1)
        out = ctx.empty(host.size, host.dtype)
        if host.size:
            ctx.write(out, host)
            ctx.sync_stream()  # like allocation: usable from any stream afterwards
        return out

    @hookimpl
    def optirs_to_host(self, ctx: CudaContext, array: Any) -> np.ndarray:
        ctx.resolve_stream(array)
        if not hasattr(array, "copy_to_host"):
            array = ctx.cuda.as_cuda_array(array)
        return np.asarray(ctx.download(array)).reshape(-1)

    @hookimpl
    def optirs_stage(self, ctx: CudaContext, params: List[Any], grads: List[Any], fmt: Any) -> Staged:
        # The step's stream (pinned, or torch's current one for torch tensors: one
        # current_stream() call), then the capture guard, before anything is queued.
        if type(params) is AddressedArrays and type(grads) is AddressedArrays:
            # the caller read the addresses and vouches for the arrays: nothing to look at again
            ctx.refuse_capture(ctx.resolve_stream(params[0] if params else None), "an optimizer step")
            return Staged(params, grads)
        if fmt is not None:
            return self._formats_stage(ctx, params, grads, fmt)
        ctx.refuse_capture(ctx.resolve_stream(params[0] if params else None), "an optimizer step")
        host = [isinstance(a, np.ndarray) for a in params] + [isinstance(a, np.ndarray) for a in grads]
        if all(host):
            return self._stage_host(ctx, params, grads)
        if any(host):
            raise InvalidParameterError(
                "params/grads mix numpy and device arrays, expected all numpy (uploaded) or all device arrays"
            )
        return Staged(DeviceList(params, ctx.addresses(params, "params")), DeviceList(grads, ctx.addresses(grads, "grads")))

    def _stage_host(self, ctx: CudaContext, params: List[np.ndarray], grads: List[np.ndarray]) -> Staged:
        shapes = tuple(a.shape for a in params)
        sizes = [int(a.size) for a in params]
        dp, dg, hp, hg, offsets, paddr, gaddr = ctx.staging(shapes, sizes)
        pack_into(hp, params, offsets[:-1])
        pack_into(hg, grads, offsets[:-1])
        total = int(offsets[-1])
        if total:
            ctx.write(dp[:total], hp[:total])
            ctx.write(dg[:total], hg[:total])

        def finish() -> None:
            if total:
                ctx.download(dp[:total], hp[:total])
            for a, o, n in zip(params, offsets[:-1], sizes):
                a.reshape(-1)[...] = hp[o : o + n]

        return Staged(DeviceList([dp] * len(params), paddr), DeviceList([dg] * len(grads), gaddr), finish)

    @hookimpl
    def optirs_synchronize(self, ctx: CudaContext) -> None:
        ctx.cuda.synchronize()  # the whole context: the stream in use and every other
