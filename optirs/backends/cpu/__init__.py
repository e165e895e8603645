"""The ``cpu`` backend: numba.njit(parallel) loops over the model's chunk table.

One call steps every tensor of the model: a parallel loop over chunks (optirs.core.layout) whose
body calls the shared per-element math in :mod:`optirs.backends.common.elementwise`. Kernels are
cached on disk (``cache=True``), so a second process does not recompile. numba is imported
when the backend opens, not when optirs is imported.
"""

from __future__ import annotations

import os
import platform
from collections import OrderedDict
from typing import Any, Dict, List

import numpy as np

from optirs.backends.cpu.adafactor import CpuAdafactor
from optirs.backends.cpu.fake_quant import CpuFakeQuant
from optirs.backends.cpu.formats import CpuFormats
from optirs.backends.cpu.fusion import CpuFusion
from optirs.backends.cpu.measure import CpuMeasure
from optirs.backends.cpu.mixed_precision import CpuMixedPrecision
from optirs.backends.cpu.replica_reduce import CpuReplicaReduce
from optirs.backends.cpu.sparse import CpuSparse
from optirs.backends.cpu.steps import CHUNK, CpuSteps
from optirs.backends.cpu.streams import CpuStreams
from optirs.backends.cpu.typed_lists import cached_typed_list
from optirs.core.errors import DeviceMemoryError, InvalidParameterError
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, hookimpl


def cpu_name() -> str:
    """The host processor's model name (for device listings and benchmark records)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class CpuContext:
    """The opened CPU backend: the kernels module and a small cache of typed lists."""

    # Cached typed lists per role. An entry keeps its arrays alive (so the ids stay theirs):
    # parameters are the same memory step after step, but gradients are often new arrays every
    # step (torch's zero_grad(set_to_none=True)), so only the latest gradient list is kept;
    # a longer cache would hold old gradients, a model's worth each.
    CACHED = {"params": 4, "grads": 1}

    def __init__(self, kernels: Any):
        self.kernels = kernels
        # The numba typed lists of recent lists, keyed by the arrays' identities.
        self.lists: Dict[str, "OrderedDict[tuple, tuple]"] = {role: OrderedDict() for role in self.CACHED}
        # The same for the word views the formats capability stages (optirs.backends.cpu.formats).
        self.format_lists: Dict[str, "OrderedDict[tuple, tuple]"] = {role: OrderedDict() for role in self.CACHED}

    def typed_list(self, arrays: List[np.ndarray], role: str = "params"):
        return cached_typed_list(self.lists[role], arrays, self.CACHED[role],
                                 lambda a: self.kernels.typed_list([x.reshape(-1) for x in a]))


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
        from optirs.backends.cpu import kernels as cpu_kernels

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
        return Staged(ctx.typed_list(params, "params"), ctx.typed_list(grads, "grads"))

    @hookimpl
    def optirs_host_view(self, ctx: CpuContext, array: np.ndarray) -> np.ndarray:
        return array.reshape(-1)  # host memory is this backend's memory

    @hookimpl
    def optirs_synchronize(self, ctx: CpuContext) -> None:
        return None


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class CpuBackend(CpuDevice, CpuSteps, CpuReplicaReduce, CpuFakeQuant, CpuMixedPrecision, CpuSparse, CpuFusion, CpuAdafactor, CpuMeasure, CpuStreams,
                 CpuFormats):
    """numba.njit kernels on the host's cores: one mixin per capability."""


plugin = CpuBackend()
