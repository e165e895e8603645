"""The ``cuda`` backend: numba.cuda kernels, device-resident state, one launch per step.

* State slots are flat device arrays (``optirs_alloc``), laid out by :class:`optirs.core.layout.TensorLayout`.
* numpy inputs are copied into one reused device buffer per step (params and grads), stepped, and
  copied back in ``Staged.finish``. Device inputs (anything with ``__cuda_array_interface__``:
  numba device arrays, CuPy arrays, torch CUDA tensors) are stepped in place: the kernel reads
  their addresses from a small device pointer table, so there is no host copy.
* A step is one kernel launch for the whole model (LAMB: a moments pass and an apply pass, plus a
  norm pass with global gradient clipping), see :mod:`optirs.backends.cuda.kernels`.
* Host overhead: the compiled kernels, the chunk and pointer tables and the marshalled launch
  arguments are cached; a step updates the per-step scalars in the cached argument block and
  calls ``cuLaunchKernel`` once through ctypes.
* Launch sizes come from the analysis plugins (``optirs_launch_config``, answered by the occupancy
  plugin from the compiled kernel's registers and shared memory); without an answer the default
  is 256 threads per block and as many blocks as the compiled kernel keeps resident on every SM
  at once (the driver's occupancy query), never more blocks than chunks.

numba.cuda is imported by ``optirs_probe`` / ``optirs_open``, never by ``import optirs``.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from optirs.core.errors import DeviceMemoryError, GpuOptimError, InvalidParameterError
from optirs.backends.cuda.fake_quant import CudaFakeQuant
from optirs.core.simulator import cuda_simulator_enabled
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, hookimpl
from optirs.backends.cuda.adafactor import CudaAdafactor
from optirs.backends.cuda.measure import CudaMeasure
from optirs.backends.cuda.replica_reduce import CudaReplicaReduce
from optirs.backends.cuda.mixed_precision import CudaMixedPrecision
from optirs.backends.cuda.sparse import CudaSparse
from optirs.backends.cuda.fusion import CudaFusion

DEFAULT_BLOCK = 256
SIM_BLOCK, SIM_GRID = 32, 2  # the simulator runs every thread as a Python thread: keep it tiny
CUDA_ERROR_OUT_OF_MEMORY = 2
_LRU = 8  # cached pointer tables per layout, prepared launches per context


def _simulator() -> bool:
    return cuda_simulator_enabled()


# ------------------------------------------------------------------ arrays and addresses


def _address_getter(obj: Any):
    """The cheapest way to read a device array's address, per type (looked up once per type)."""
    cls = type(obj)
    module = cls.__module__
    if module.startswith("torch"):
        return lambda a: a.data_ptr()
    if module.startswith("cupy"):
        return lambda a: a.data.ptr
    if cls.__name__ == "FakeCUDAArray":  # simulator: the wrapped numpy array's memory
        return lambda a: a._ary.__array_interface__["data"][0]
    if hasattr(obj, "device_ctypes_pointer"):  # numba DeviceNDArray
        return lambda a: a.device_ctypes_pointer.value or 0
    if hasattr(obj, "__cuda_array_interface__"):
        return lambda a: a.__cuda_array_interface__["data"][0] or 0
    return None


_GETTERS: Dict[type, Any] = {}


def device_address(obj: Any) -> Optional[int]:
    """Address of a device array, or None when ``obj`` is not one."""
    getter = _GETTERS.get(type(obj))
    if getter is None:
        getter = _address_getter(obj)
        if getter is None:
            return None
        _GETTERS[type(obj)] = getter
    return int(getter(obj))


class DeviceList(list):
    """The arrays of one step, with their device addresses (read once, in ``optirs_stage``)."""

    def __init__(self, arrays: Sequence[Any], addresses: Tuple[int, ...]):
        super().__init__(arrays)
        self.addresses = addresses


# ------------------------------------------------------------------ raw launches


class _Launcher:
    """Calls cuLaunchKernel on a prepared argument block (one ctypes call per step)."""

    def __init__(self) -> None:
        self.fn = self.lib = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernel
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            fn.restype = ctypes.c_int
            self.fn, self.lib = fn, lib
        except (OSError, AttributeError):  # pragma: no cover - numba's own launch is the fallback
            self.fn = None

    def function(self, handle: int) -> ctypes.c_void_p:
        """The CUfunction of numba's handle (a CUkernel from cuLibraryLoad; returned as is otherwise)."""
        out = ctypes.c_void_p()
        try:
            if self.lib is not None and self.lib.cuKernelGetFunction(ctypes.byref(out), ctypes.c_void_p(handle)) == 0:
                return out
        except AttributeError:  # pragma: no cover - a driver before CUDA 12
            pass
        return ctypes.c_void_p(handle)

    def active_blocks(self, function: ctypes.c_void_p, block: int) -> int:
        """Blocks of ``block`` threads the compiled kernel keeps resident per SM (the driver's occupancy)."""
        out = ctypes.c_int()
        if self.lib is None or self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(out), function, ctypes.c_int(block), ctypes.c_size_t(0)) != 0:
            raise GpuOptimError("cuOccupancyMaxActiveBlocksPerMultiprocessor failed")
        return int(out.value)


class PreparedLaunch:
    """One kernel with its arguments marshalled once; ``__call__(sc)`` updates the scalars and launches.

    numba's own marshalling (``_Kernel._prepare_args``) flattens the arguments; the flat values
    are kept as ctypes objects and the scalars record (the last argument) is rewritten in place
    when it changes. Without a usable libcuda (or under the simulator) it falls back to numba's
    launch.
    """

    def __init__(self, ctx: "CudaContext", compiled: "Compiled", args: tuple, grid: int, block: int):
        self.compiled, self.args, self.grid, self.block = compiled, args, grid, block
        raw = os.environ.get("OPTIRS_CUDA_RAW_LAUNCH", "1") != "0"  # 0: numba's launch (for comparison)
        self.fn = ctx.launcher.fn if (raw and compiled.handle is not None and not ctx.simulator) else None
        self.sc = args[-1]
        if self.fn is None:
            return
        flat: List[Any] = []
        kernel = compiled.kernel
        for ty, val in zip(kernel.argument_types, args):
            kernel._prepare_args(ty, val, 0, [], flat)
        self.cargs = [self._ctype(v) for v in flat]
        self.nsc = len(self.sc)
        self.sc_args = self.cargs[len(self.cargs) - self.nsc:]
        self.pointers = (ctypes.c_void_p * len(self.cargs))(*[ctypes.addressof(c) for c in self.cargs])

    @staticmethod
    def _ctype(value: Any):
        if isinstance(value, (bool, np.bool_)):
            return ctypes.c_bool(bool(value))
        if isinstance(value, (int, np.integer)):
            return ctypes.c_int64(int(value))  # pointers, sizes, shapes, strides: all intptr-sized
        if isinstance(value, ctypes._SimpleCData):
            return value
        raise TypeError(f"cannot marshal kernel argument {value!r}")  # pragma: no cover

    def __call__(self, sc: Any) -> None:
        if self.fn is None:
            args = self.args[:-1] + (sc,)
            self.compiled.dispatcher[self.grid, self.block](*args)
            return
        if sc is not self.sc:
            for cval, new, old in zip(self.sc_args, sc, self.sc):
                if new != old:
                    cval.value = new
            self.sc = sc
        err = self.fn(self.compiled.handle, self.grid, 1, 1, self.block, 1, 1, 0, None, self.pointers, None)
        if err:
            if err == CUDA_ERROR_OUT_OF_MEMORY:
                raise DeviceMemoryError(f"cuLaunchKernel of {self.compiled.name} ran out of device memory")
            raise GpuOptimError(f"cuLaunchKernel of {self.compiled.name} failed with CUresult {err}")


class Compiled:
    """A kernel compiled for one argument signature, with its driver handle and launch size."""

    def __init__(self, ctx: "CudaContext", name: str, dispatcher: Any, argtypes: tuple):
        self.name, self.dispatcher = name, dispatcher
        self.kernel = None
        self.handle = None
        if ctx.simulator:
            return
        self.kernel = dispatcher.compile(argtypes)
        try:
            cufunc = self.kernel._codelibrary.get_cufunc()
            self.cufunc = cufunc
            self.handle = ctx.launcher.function(int(cufunc.handle)) if ctx.launcher.lib is not None else None
        except Exception:  # pragma: no cover - fall back to numba's launch path
            self.handle = None

    def launch_size(self, ctx: "CudaContext", elements: int) -> Tuple[int, int]:
        """(grid, block) before capping the grid to the number of chunks."""
        if ctx.simulator:
            return SIM_GRID, SIM_BLOCK
        config = None
        forced = int(os.environ.get("OPTIRS_CUDA_BLOCK", "0") or 0)  # tuning: resident grid of this block size
        if not forced:
            try:
                from optirs.plugin.registry import REGISTRY

                config = REGISTRY.launch_config(self.kernel, ctx.device, elements)
            except Exception:
                config = None
        limit = int(getattr(self.kernel, "max_threads_per_block", 1024) or 1024)  # registers can lower it
        if config is not None:
            grid, block = int(config[0]), min(int(config[1]), limit)
        else:
            block = min(forced or DEFAULT_BLOCK, limit)
            try:
                per_sm = ctx.launcher.active_blocks(self.handle, block)
            except Exception:
                per_sm = 2048 // block
            grid = max(1, per_sm) * ctx.sm_count
        return max(1, grid), block


# ------------------------------------------------------------------ the context


class CudaContext:
    """The opened backend: numba.cuda, the kernels, caches of compiled kernels and launches."""

    def __init__(self, options: Dict[str, Any]):
        from numba import cuda

        from optirs.backends.cuda import kernels as cuda_kernels

        self.cuda = cuda
        self.kernels = cuda_kernels
        self.simulator = _simulator()
        device = options.get("device")
        if device is not None and not self.simulator:
            cuda.select_device(_device_index(device))
        self.device = cuda.get_current_device()
        name = getattr(self.device, "name", "numba CUDA simulator")
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self.context = None if self.simulator else cuda.current_context()
        self.sm_count = 1 if self.simulator else int(self.device.MULTIPROCESSOR_COUNT)
        self.launcher = _Launcher() if not self.simulator else None
        self._dispatchers: Dict[str, Any] = {}
        self._compiled: Dict[Tuple[str, Any], Compiled] = {}
        self._launches: "OrderedDict[tuple, PreparedLaunch]" = OrderedDict()
        self._staging: "OrderedDict[tuple, Any]" = OrderedDict()
        self._address_cache: "OrderedDict[tuple, Any]" = OrderedDict()
        # Indirection for tests that simulate a failing allocation.
        self.device_array = cuda.device_array

    # ------------------------------------------------ memory

    def memory_info(self) -> Tuple[Optional[int], Optional[int]]:
        try:
            free, total = self.cuda.current_context().get_memory_info()
            return int(free), int(total)
        except Exception:
            return None, None

    def empty(self, size: int, dtype: Any):
        """A device array, or DeviceMemoryError with the sizes asked and free."""
        dtype = np.dtype(dtype)
        try:
            return self.device_array(int(size), dtype=dtype)
        except Exception as exc:
            if _is_oom(exc):
                free, total = self.memory_info()
                raise DeviceMemoryError(
                    f"could not allocate {int(size) * dtype.itemsize} bytes of device memory "
                    f"({int(size)} x {dtype}) on {self.device_name}: free {free} of {total} bytes"
                ) from exc
            raise

    # ------------------------------------------------ kernels

    def compiled(self, name: str, pyfunc: Any, argtypes: tuple) -> Compiled:
        key = (name, argtypes)
        hit = self._compiled.get(key)
        if hit is None:
            dispatcher = self._dispatchers.get(name)
            if dispatcher is None:
                dispatcher = self.cuda.jit(pyfunc, fastmath=False) if not self.simulator else self.cuda.jit(pyfunc)
                self._dispatchers[name] = dispatcher
            hit = self._compiled[key] = Compiled(self, name, dispatcher, argtypes)
        return hit

    def plan(self, name: str, pyfunc: Any, family: str, scalars: Any, layout: Any) -> Tuple[Compiled, int, int, int]:
        """(compiled kernel, chunk elements, grid, block) for this kernel on this layout, once per layout.

        The block comes from the launch configuration (occupancy plugin, or the default); the
        chunk is sized so that every thread moves at least MIN_VECTORS_PER_THREAD float4 vectors
        per chunk (short-lived blocks measured slower), and the grid is capped at one block per chunk.
        """
        key = ("cuda.plan", name)
        plan = layout.cache.get(key)
        if plan is None:
            import numba

            compiled = self.compiled(name, pyfunc, _head_types(family) + (numba.typeof(scalars),))
            grid, block = compiled.launch_size(self, (layout.total + 3) // 4)
            chunk = self.kernels.chunk_elements(block)
            nchunks = len(layout.chunks(chunk)[0])
            plan = layout.cache[key] = (compiled, chunk, max(1, min(grid, nchunks)), block)
        return plan

    def launch(self, compiled: Compiled, args: tuple, grid: int, block: int) -> None:
        """Launch a planned kernel; ``args[-1]`` is the per-step scalars record (rewritten in place)."""
        key = (id(compiled), grid, block) + tuple(a if isinstance(a, (int, np.integer)) else id(a) for a in args[:-1])
        prepared = self._launches.get(key)
        if prepared is None:
            prepared = PreparedLaunch(self, compiled, args, grid, block)
            self._launches[key] = prepared
            if len(self._launches) > 4 * _LRU:
                self._launches.popitem(last=False)
        else:
            self._launches.move_to_end(key)
        prepared(args[-1])

    # ------------------------------------------------ tables

    def chunk_table(self, layout: Any, chunk: int):
        """Device int64[nchunks, 4] (tensor, start, count, state offset), once per layout and chunk size."""
        key = ("cuda.chunks", chunk)
        table = layout.cache.get(key)
        if table is None:
            tensor, start, stop = layout.chunks(chunk)
            host = np.stack([tensor, start, stop - start, layout.offsets[tensor]], axis=1).astype(np.int64)
            if len(host) == 0:
                host = np.zeros((1, 4), np.int64)
            table = layout.cache[key] = (self.cuda.to_device(np.ascontiguousarray(host)), len(tensor))
        return table

    def pointer_table(self, layout: Any, paddr: Tuple[int, ...], gaddr: Tuple[int, ...]):
        """Device int64[ntensors, 2] (param address, grad address), cached per address set."""
        tables = layout.cache.get("cuda.pointers")
        if tables is None:
            tables = layout.cache["cuda.pointers"] = OrderedDict()
        key = (paddr, gaddr)
        table = tables.get(key)
        if table is None:
            host = np.ascontiguousarray(np.array([paddr, gaddr], dtype=np.int64).T)
            table = tables[key] = self.cuda.to_device(host)
            if len(tables) > _LRU:
                tables.popitem(last=False)
        else:
            tables.move_to_end(key)
        return table

    def addresses(self, arrays: List[Any], label: str) -> Tuple[int, ...]:
        """Device addresses of a list of arrays, cached by the arrays' identities.

        Like the optimizer's validation cache, this takes an array object to keep its memory
        between steps (true of numba and CuPy arrays; torch tensors are re-checked through
        ``data_ptr()``, since ``tensor.data`` can be reassigned); the entry keeps the arrays alive,
        so the identities stay theirs.
        """
        key = tuple(map(id, arrays))
        hit = self._address_cache.get(key)
        # A torch tensor can change storage under the same object (``tensor.data = ...``):
        # its data_ptr() is cheap, so check those before trusting the cached addresses.
        if hit is not None and all(arrays[i].data_ptr() == hit[1][i] for i in hit[2]):
            self._address_cache.move_to_end(key)
            return hit[1]
        found = []
        for i, a in enumerate(arrays):
            addr = device_address(a)
            if addr is None:
                raise InvalidParameterError(
                    f"{label}[{i}] is a {type(a).__module__}.{type(a).__qualname__}, expected a numpy array or "
                    "a CUDA device array (__cuda_array_interface__) on the cuda backend"
                )
            found.append(addr)
        out = tuple(found)
        swappable = tuple(i for i, a in enumerate(arrays) if hasattr(a, "data_ptr"))
        self._address_cache[key] = (list(arrays), out, swappable)
        if len(self._address_cache) > 2 * _LRU:
            self._address_cache.popitem(last=False)
        return out

    # ------------------------------------------------ staging numpy inputs

    def staging(self, shapes: Tuple[Tuple[int, ...], ...], sizes: List[int]):
        """Reused device buffers (params, grads) and pinned host buffers for one model's shapes."""
        hit = self._staging.get(shapes)
        if hit is None:
            total = max(1, sum(sizes))
            dp, dg = self.empty(total, np.float32), self.empty(total, np.float32)
            try:
                hp = self.cuda.pinned_array(total, dtype=np.float32)
                hg = self.cuda.pinned_array(total, dtype=np.float32)
            except Exception:
                hp, hg = np.empty(total, np.float32), np.empty(total, np.float32)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            pbase, gbase = device_address(dp), device_address(dg)
            paddr = tuple(int(pbase + 4 * o) for o in offsets[:-1])
            gaddr = tuple(int(gbase + 4 * o) for o in offsets[:-1])
            hit = (dp, dg, hp, hg, offsets, paddr, gaddr)
            self._staging[shapes] = hit
            while len(self._staging) > 2:  # big buffers: keep only the latest models
                self._staging.popitem(last=False)
        else:
            self._staging.move_to_end(shapes)
        return hit


def _head_types(family: str) -> tuple:
    """numba types of a kernel family's arguments before the scalars record (see cuda_kernels)."""
    from numba import types

    table, i64, acc = types.int64[:, ::1], types.int64, types.float64[:, ::1]
    return {"step": (table, table, i64, i64, i64, i64, i64),
            "grad_norm": (table, table, i64, acc, i64, i64),
            "lamb": (table, table, i64, i64, i64, acc, i64, i64)}[family]


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    code = getattr(exc, "code", None)
    try:
        if code is not None and int(code) == CUDA_ERROR_OUT_OF_MEMORY:
            return True
    except (TypeError, ValueError):
        pass
    return "OUT_OF_MEMORY" in str(exc).upper().replace(" ", "_")


def _device_index(device: Any) -> int:
    from numba import cuda

    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        return int(device)
    if isinstance(device, str):
        names = [(d.id, d.name.decode() if isinstance(d.name, bytes) else str(d.name)) for d in cuda.gpus]
        for i, name in names:
            if device.lower() in name.lower():
                return i
        raise InvalidParameterError(f"device={device!r}, expected an index or a substring of one of {[n for _, n in names]}")
    raise InvalidParameterError(f"device={device!r}, expected a CUDA device index or name substring")


# ------------------------------------------------------------------ why numba.cuda does not import

# Text of errors raised when numba or numba-cuda use a numpy API that the installed numpy removed
# (numba-cuda 0.30.4 overloads ``np.row_stack``, which numpy 2.5 removed) or reject its version.
_NUMPY_MISMATCH = ("module 'numpy' has no attribute", "numpy.core", "numba needs numpy", "numpy version")


def _version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def import_failure_reason(exc: BaseException) -> str:
    """Why ``from numba import cuda`` failed: the exception, the likely cause and the fix."""
    error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    numpy_v, numba_v, cuda_v = np.__version__, _version("numba"), _version("numba-cuda")
    versions = f"numpy {numpy_v}, numba {numba_v or 'not installed'}, numba-cuda {cuda_v or 'not installed'}"
    if cuda_v is None or numba_v is None:
        cause = "numba-cuda is not installed; fix: pip install 'optirs[cuda]'"
    elif any(m in error.lower() for m in _NUMPY_MISMATCH):
        major_minor = ".".join(numpy_v.split(".")[:2])
        cause = (f"numpy {numpy_v} is newer than numba-cuda {cuda_v} supports (it uses a numpy API that numpy "
                 f"{major_minor} removed or changed); fix: pip install 'numpy<{major_minor}' (optirs[cuda] pins "
                 f"it), or a numba-cuda release that supports numpy {major_minor}")
    else:
        cause = ("the installed numba-cuda, numba and numpy may not work together; "
                 "fix: pip install --upgrade 'optirs[cuda]'")
    return f"numba-cuda is not importable ({error}); {versions}: likely cause: {cause}"


# ------------------------------------------------------------------ the plugin


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
            from numba.cuda.cudadrv.driver import driver

            count = driver.get_device_count()
        except Exception as exc:
            if any(m in str(exc).lower() for m in _NUMPY_MISMATCH):  # numba.cuda's driver module did not import
                return ProbeResult(False, import_failure_reason(exc))
            return ProbeResult(False, "no CUDA GPU: " + " ".join(str(exc).split()))
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
        out = ctx.empty(size, dtype)
        if size:
            if ctx.simulator:
                out.copy_to_device(np.full(size, fill, dtype=out.dtype))
            else:
                grid = min(ctx.sm_count * 8, (int(size) + DEFAULT_BLOCK - 1) // DEFAULT_BLOCK)
                ctx.kernels.fill_kernel[grid, DEFAULT_BLOCK](out, out.dtype.type(fill))
        return out

    @hookimpl
    def optirs_to_device(self, ctx: CudaContext, array: Any):
        host = np.ascontiguousarray(array).reshape(-1)
        out = ctx.empty(host.size, host.dtype)
        if host.size:
            out.copy_to_device(host)
        return out

    @hookimpl
    def optirs_to_host(self, ctx: CudaContext, array: Any) -> np.ndarray:
        if hasattr(array, "copy_to_host"):
            return np.asarray(array.copy_to_host()).reshape(-1)
        return np.asarray(ctx.cuda.as_cuda_array(array).copy_to_host()).reshape(-1)

    @hookimpl
    def optirs_stage(self, ctx: CudaContext, params: List[Any], grads: List[Any]) -> Staged:
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
        for a, b, o, n in zip(params, grads, offsets[:-1], sizes):
            hp[o : o + n] = a.reshape(-1)
            hg[o : o + n] = b.reshape(-1)
        total = int(offsets[-1])
        if total:
            dp[:total].copy_to_device(hp[:total])
            dg[:total].copy_to_device(hg[:total])

        def finish() -> None:
            if total:
                dp[:total].copy_to_host(hp[:total])
            for a, o, n in zip(params, offsets[:-1], sizes):
                a.reshape(-1)[...] = hp[o : o + n]

        return Staged(DeviceList([dp] * len(params), paddr), DeviceList([dg] * len(grads), gaddr), finish)

    @hookimpl
    def optirs_synchronize(self, ctx: CudaContext) -> None:
        ctx.cuda.synchronize()


from optirs.backends.cuda.steps import CudaSteps  # noqa: E402  (it uses device_address above)


class CudaBackend(CudaDevice, CudaSteps, CudaReplicaReduce, CudaFakeQuant, CudaMixedPrecision, CudaSparse, CudaFusion, CudaAdafactor, CudaMeasure):
    """numba.cuda kernels on an NVIDIA GPU (or numba's CUDA simulator): one mixin per capability."""


plugin = CudaBackend()
