"""The cpu backend's device hooks: probing, opening, memory and staging (host memory is the device's)."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from optirs.backends.cpu.context import CpuContext, _available_memory, _total_memory, cpu_name
from optirs.core.errors import DeviceMemoryError, InvalidParameterError
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, hookimpl


class CpuDevice:
    """The device hooks: probing, opening, memory, staging."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        return {"summary": "numba.njit(parallel) kernels on the host CPU"}

    @hookimpl
    def optirs_probe(self, options: Dict[str, Any]) -> ProbeResult:
        try:
            import numba
        except ImportError as exc:  # pragma: no cover - numba is a dependency
            return ProbeResult(False, f"numba is not importable: {exc}")
        threads = numba.config.NUMBA_NUM_THREADS
        return ProbeResult(True, "", (DeviceInfo(cpu_name(), "cpu", _total_memory(), threads,
                                                 {"numba": numba.__version__, "threads": threads}),))

    @hookimpl
    def optirs_open(self, options: Dict[str, Any]) -> CpuContext:
        import optirs.backends.cpu.kernels as cpu_kernels

        # numba's CPU target loads its registries on the first compiled call (about 0.5 s): an
        # opened backend has made one (a cached builder), so a first step does not wait for it
        cpu_kernels.typed_list([np.zeros(1, np.float32)])
        return CpuContext(cpu_kernels)

    @hookimpl
    def optirs_alloc(self, ctx: CpuContext, size: int, dtype: Any, fill: float) -> np.ndarray:
        try:
            return np.full(size, fill, dtype=dtype)
        except MemoryError as exc:
            raise DeviceMemoryError(
                f"could not allocate {size * np.dtype(dtype).itemsize} bytes of host memory "
                f"({size} x {np.dtype(dtype)}); free: {_available_memory()} bytes"
            ) from exc

    @hookimpl
    def optirs_to_device(self, ctx: CpuContext, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True).reshape(-1)

    @hookimpl
    def optirs_to_host(self, ctx: CpuContext, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True)

    @hookimpl
    def optirs_stage(self, ctx: CpuContext, params: List[Any], grads: List[Any], fmt: Any) -> Staged:
        if fmt is not None:
            return self._formats_stage(ctx, params, grads, fmt)
        for i, p in enumerate(params):
            if not isinstance(p, np.ndarray):
                raise InvalidParameterError(
                    f"params[{i}] is a {type(p).__name__}, expected a numpy array on the cpu backend"
                )
        return Staged(*ctx.typed_lists(params, grads))

    @hookimpl
    def optirs_host_view(self, ctx: CpuContext, array: np.ndarray) -> np.ndarray:
        return array.reshape(-1)  # host memory is this backend's memory

    @hookimpl
    def optirs_synchronize(self, ctx: CpuContext) -> None:
        return None
