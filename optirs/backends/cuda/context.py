"""The cuda backend's context: numba.cuda, device addresses, raw launches, compiled kernels, streams.

:class:`CudaContext` is what ``optirs_open`` returns: the kernels, the compiled-kernel and
prepared-launch caches, the chunk and pointer tables, the staging buffers and the stream in use.
:class:`PreparedLaunch` calls ``cuLaunchKernel`` once per step on an argument block marshalled
once (numba's own launch is the fallback). The hook mixins of the package use these.
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from optirs.backends.common.identity_cache import ArrayListCache, identity_key
from optirs.backends.cuda.kernel_cache import enable as enable_kernel_cache
from optirs.backends.cuda.kernel_cache import finish_build
from optirs.core.errors import DeviceMemoryError, GpuOptimError, InvalidParameterError, UnsupportedOperationError
from optirs.core.layout import aligned_offsets
from optirs.core.simulator import cuda_simulator_enabled
from optirs.plugin.hookspecs import AddressedArrays

DEFAULT_BLOCK = 256
SIM_BLOCK, SIM_GRID = 32, 2  # the simulator runs every thread as a Python thread: keep it tiny
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
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


def _array_signature(obj: Any) -> tuple:
    """What numba marshals of an array besides its address: type, dtype, shape, strides (an object
    without them stands for itself)."""
    shape = getattr(obj, "shape", None)
    if shape is None:
        return (id(obj),)
    return (type(obj), getattr(obj, "dtype", None), tuple(shape), tuple(getattr(obj, "strides", ()) or ()))


def argument_key(args: tuple) -> tuple:
    """Launch arguments as the launch caches key them: numbers and tuples of numbers (addresses) by
    value, so that a tuple made anew each step finds its launch; arrays by identity."""
    return tuple(a if isinstance(a, (int, np.integer, tuple)) else id(a) for a in args)


def _raw_handle(handle: Any) -> Optional[int]:
    """The integer of a driver handle as numba keeps it (a ctypes pointer or a cuda-python object)."""
    value = getattr(handle, "value", handle)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _event_handle(event: Any) -> Optional[int]:
    """The raw CUevent of a numba event (None where it cannot be read)."""
    return _raw_handle(getattr(event, "handle", None))


def device_address(obj: Any) -> Optional[int]:
    """Address of a device array, or None when ``obj`` is not one."""
    getter = _GETTERS.get(type(obj))
    if getter is None:
        getter = _address_getter(obj)
        if getter is None:
            return None
        _GETTERS[type(obj)] = getter
    return int(getter(obj))


# The arrays of one step with their device addresses (read once, by the caller or in ``optirs_stage``).
DeviceList = AddressedArrays


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
        # resolved here, not on the first new pointer table (a step's path)
        self.htod = self._entry("cuMemcpyHtoDAsync_v2", ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_void_p)
        self.memset = self._entry("cuMemsetD32Async", ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p)
        self.record = self._entry("cuEventRecord", ctypes.c_void_p, ctypes.c_void_p)

    def _entry(self, name: str, *argtypes: Any) -> Any:
        """The driver's entry point ``name`` returning a CUresult, or None (no driver, or an older one)."""
        if self.lib is None:
            return None
        try:
            fn = getattr(self.lib, name)
        except AttributeError:  # pragma: no cover - a driver without it
            return None
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        return fn

    def function(self, handle: int) -> ctypes.c_void_p:
        """The CUfunction of numba's handle (a CUkernel from cuLibraryLoad; returned as is otherwise)."""
        out = ctypes.c_void_p()
        try:
            if self.lib is not None and self.lib.cuKernelGetFunction(ctypes.byref(out), ctypes.c_void_p(handle)) == 0:
                return out
        except AttributeError:  # pragma: no cover - a driver before CUDA 12
            pass
        return ctypes.c_void_p(handle)

    def capture_status(self, stream: int) -> int:
        """cuStreamIsCapturing of a raw stream: 0 none, 1 active, 2 invalidated (-1: unknown).

        The legacy default stream answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while a blocking
        stream captures: reported as active, since a launch there would join or break the capture.
        """
        if self.lib is None:
            return -1
        out = ctypes.c_int()
        try:
            err = self.lib.cuStreamIsCapturing(ctypes.c_void_p(stream or None), ctypes.byref(out))
        except AttributeError:  # pragma: no cover - a driver before CUDA 10
            return -1
        if err == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
            return 1
        return int(out.value) if err == 0 else -1

    def record_event(self, event: Any, stream: int, nstream: Any, handle: Optional[int] = None) -> None:
        """cuEventRecord of a numba event on a raw stream: one ctypes call, where numba's
        ``record`` (its stream wrapper, its API-call checks) costs tens of microseconds.
        ``handle``: the event's raw handle when the caller keeps it."""
        if handle is None:
            handle = _event_handle(event)
        if self.record is None or handle is None:
            event.record(nstream)
            return
        err = self.record(handle, stream or None)
        if err:
            raise GpuOptimError(f"cuEventRecord failed with CUresult {err}")

    def copy_to_device_async(self, device_address: int, host: np.ndarray, stream: int,
                             host_address: int = 0) -> bool:
        """``cuMemcpyHtoDAsync`` of a pinned host array on a raw stream (False: not available here).
        ``host_address``: the array's address when the caller keeps it (numpy's ``.ctypes`` costs
        tens of microseconds).

        numba's copy on the legacy default stream is a synchronous cuMemcpyHtoD, which waits for
        every kernel queued before it: a step must not."""
        fn = self.htod
        if fn is None:
            return False
        err = fn(device_address, host_address or host.ctypes.data, host.nbytes, stream or None)
        if err:
            raise GpuOptimError(f"cuMemcpyHtoDAsync of {host.nbytes} bytes failed with CUresult {err}")
        return True

    def memset32(self, device_address: int, words: int, stream: int) -> None:
        """``cuMemsetD32Async``: ``words`` 32-bit words of zeros at ``device_address``, on a raw stream."""
        if self.memset is None:
            raise GpuOptimError("cuMemsetD32Async is not available from this CUDA driver")
        err = self.memset(device_address, 0, words, stream or None)
        if err:
            raise GpuOptimError(f"cuMemsetD32Async of {words} words failed with CUresult {err}")

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
        self.family: Optional[Dict[int, "PreparedLaunch"]] = None  # id(a sibling pointer table) -> its launch
        self.table_at = -1  # the argument that is a pointer table, with a family
        self.spans: List[Tuple[int, int]] = []  # each argument's run of flat values
        self.address_at: Dict[int, int] = {}  # argument -> the flat value that is its device address
        if self.fn is None:
            return
        cargs: List[Any] = []
        for i, value in enumerate(args):
            start = len(cargs)
            cargs.extend(self._marshal(i, value))
            self.spans.append((start, len(cargs)))
            address = device_address(value) if hasattr(value, "shape") else None
            found = [j for j in range(start, len(cargs)) if address and getattr(cargs[j], "value", None) == address]
            if len(found) == 1:
                self.address_at[i] = found[0]
        self._finish(cargs)

    def _marshal(self, i: int, value: Any) -> List[Any]:
        """The ctypes values of argument ``i`` (numba's marshalling of that argument alone)."""
        flat: List[Any] = []
        kernel = self.compiled.kernel
        kernel._prepare_args(kernel.argument_types[i], value, 0, [], flat)
        return [self._ctype(v) for v in flat]

    def _finish(self, cargs: List[Any]) -> None:
        self.cargs = cargs
        self.nsc = len(self.sc)
        self.sc_args = cargs[len(cargs) - self.nsc:]
        self.pointers = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])

    def sibling(self, leading: tuple) -> Optional["PreparedLaunch"]:
        """The prepared launch of this family whose arguments begin with ``leading``: the same
        arguments but another pointer table of the same :class:`PointerTables` (None when there is
        none), compared as the launch caches key them (:func:`argument_key`)."""
        family = self.family
        if family is None or len(leading) <= self.table_at:
            return None
        found = family.get(id(leading[self.table_at]))
        if found is None or argument_key(leading) != argument_key(found.args[: len(leading)]):
            return None
        return found

    def rebound(self, args: tuple) -> "PreparedLaunch":
        """A launch of the same kernel and shapes on ``args``, re-marshalling only the arguments that
        are other objects (a new pointer table: a new address set of the same tensors). Copies every
        ctypes value, so that the two launches' scalars are rewritten apart."""
        twin = object.__new__(PreparedLaunch)
        twin.compiled, twin.args, twin.grid, twin.block, twin.fn = self.compiled, args, self.grid, self.block, self.fn
        twin.sc, twin.spans, twin.address_at = args[-1], self.spans, self.address_at
        twin.family, twin.table_at = None, -1
        if twin.fn is None:
            return twin
        cargs = [type(c)(c.value) for c in self.cargs]
        for i, (new, old) in enumerate(zip(args[:-1], self.args[:-1])):
            if new is not old:
                at = self.address_at.get(i)
                if at is not None:  # same type, dtype, shape and strides: only the address differs
                    cargs[at].value = device_address(new)
                else:
                    start, stop = self.spans[i]
                    cargs[start:stop] = self._marshal(i, new)
        for cval, value in zip(cargs[len(cargs) - len(twin.sc):], twin.sc):
            cval.value = value
        twin._finish(cargs)
        return twin

    @staticmethod
    def _ctype(value: Any):
        if isinstance(value, (bool, np.bool_)):
            return ctypes.c_bool(bool(value))
        if isinstance(value, (int, np.integer)):
            return ctypes.c_int64(int(value))  # pointers, sizes, shapes, strides: all intptr-sized
        if isinstance(value, ctypes._SimpleCData):
            return value
        raise TypeError(f"cannot marshal kernel argument {value!r}")  # pragma: no cover

    def __call__(self, sc: Any, stream: int = 0, nstream: Any = 0) -> None:
        """Launch with scalars ``sc`` on the raw CUDA stream ``stream`` (0: the legacy default
        stream); ``nstream`` is the same stream as numba's launch takes it (numba's fallback)."""
        if self.fn is None:
            args = self.args[:-1] + (sc,)
            self.compiled.dispatcher[self.grid, self.block, nstream](*args)
            return
        if sc is not self.sc:
            for cval, new, old in zip(self.sc_args, sc, self.sc):
                if new != old:
                    cval.value = new
            self.sc = sc
        err = self.fn(self.compiled.handle, self.grid, 1, 1, self.block, 1, 1, 0, stream or None, self.pointers, None)
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
        try:
            self.kernel = dispatcher.compile(argtypes)  # or loaded from the disk cache (kernel_cache)
        except BaseException as exc:
            finish_build(dispatcher._cache, exc)
            raise
        finish_build(dispatcher._cache)
        try:
            cufunc = self.kernel._codelibrary.get_cufunc()
            self.cufunc = cufunc
            self.handle = ctx.launcher.function(int(cufunc.handle)) if ctx.launcher.lib is not None else None
        except Exception:  # pragma: no cover - fall back to numba's launch path
            self.handle = None

    def launch_size(self, ctx: "CudaContext", elements: int, resident_block: int = 0) -> Tuple[int, int]:
        """(grid, block) before capping the grid to the number of chunks. ``resident_block``: blocks
        of that size, as many as stay resident on the device, each looping over chunks (instead of
        the occupancy plugin's largest block and one block per chunk)."""
        if ctx.simulator:
            return SIM_GRID, SIM_BLOCK
        config = None
        # OPTIRS_CUDA_BLOCK (tuning): a resident grid of this block size for every kernel
        forced = int(os.environ.get("OPTIRS_CUDA_BLOCK", "0") or 0) or resident_block
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

        import optirs.backends.cuda.kernels as cuda_kernels

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
        self._launch_shapes: "OrderedDict[tuple, PreparedLaunch]" = OrderedDict()  # the latest per shapes
        self._staging: "OrderedDict[tuple, Any]" = OrderedDict()
        self._address_cache = ArrayListCache(2 * _LRU)  # (addresses, indices of torch tensors) per list
        self._table_siblings: Dict[int, Any] = {}  # id(device pointer table) -> weakref to its PointerTables
        self._row_tables: Dict[Tuple[str, int, int], "PointerTables"] = {}
        # Indirection for tests that simulate a failing allocation.
        self.device_array = cuda.device_array
        # The stream every launch and copy goes on (see the module docstring, "Streams"):
        # ``pinned`` is the caller's choice (options["stream"] or optirs_use_stream; None: the
        # rule), ``stream`` the raw handle in use, ``nstream`` the same stream as numba takes it.
        self._numba_streams: Dict[int, Any] = {}
        self.pinned: Optional[int] = None
        self.stream, self.nstream = 0, 0
        self.use_stream(options.get("stream"))
        if not self.simulator:
            # numba-cuda's compiler context loads its registries on first use (seconds): an opened
            # backend is ready to load its kernels, so a first step does not wait for it
            cuda_kernels.fill_kernel.targetctx.refresh()

    # ------------------------------------------------ streams

    def use_stream(self, stream: Any) -> None:
        """Pin every later launch to ``stream`` (a raw handle, or a torch/numba/CuPy stream object);
        None or "auto" returns to the rule (torch's current stream for torch tensors, else 0)."""
        self.pinned = None if stream is None or (isinstance(stream, str) and stream == "auto") else stream_handle(stream)
        self._set_stream(self.pinned or 0)

    def _set_stream(self, handle: int) -> None:
        if handle != self.stream:
            self.stream, self.nstream = handle, self.numba_stream(handle)

    def numba_stream(self, handle: int) -> Any:
        """numba's stream object for a raw handle (0 stays 0: numba's legacy default stream)."""
        if not handle:
            return 0
        hit = self._numba_streams.get(handle)
        if hit is None:
            # The simulator has no external streams; its stream objects order nothing (it runs
            # every launch to completion) and stand in for the handle.
            hit = self.cuda.stream() if self.simulator else self.cuda.external_stream(handle)
            self._numba_streams[handle] = hit
            if len(self._numba_streams) > 4 * _LRU:
                self._numba_streams.pop(next(iter(self._numba_streams)))
        return hit

    def resolve_stream(self, array: Any = None) -> int:
        """The stream of a call on ``array`` (its first device array), made the one in use.

        Pinned: that stream. Otherwise a torch CUDA tensor's calls go on torch's current stream
        of its device at the time of the call (torch's convention), anything else on the legacy
        default stream 0.
        """
        handle = self.pinned
        if handle is None:
            handle = _torch_stream(array) if type(array).__module__.startswith("torch") else 0
        self._set_stream(handle)
        return handle

    def stream_capturing(self, handle: int) -> bool:
        """Whether a CUDA graph capture is in progress on the raw stream ``handle``."""
        if self.launcher is None:  # the simulator: nothing is ever captured
            return False
        return self.launcher.capture_status(handle) in (1, 2)

    def refuse_capture(self, handle: int, what: str, also_torch: bool = False) -> None:
        """UnsupportedOperationError when ``handle`` is being captured into a CUDA graph.

        A step's per-step scalars (bias corrections, decayed learning rates) are host values
        marshalled into the launch: a captured launch would replay them unchanged every time.
        ``also_torch``: also when torch's current stream captures (before the step's stream is
        known, as when state is allocated).
        """
        if self.stream_capturing(handle) or (also_torch and _torch_capturing()):
            raise UnsupportedOperationError(
                f"{what} was called while CUDA stream {handle:#x} is being captured into a CUDA graph: its "
                "per-step scalars (step count, bias corrections, learning rate) are host values baked into "
                "the launch, so every replay would repeat this step's values (stale). Run the step outside "
                "the capture, or use optirs.torch's capturable=True (step count and learning rate on the device)"
            )

    def upload(self, host: np.ndarray):
        """A new device copy of ``host``, ordered on the stream in use."""
        return self.cuda.to_device(host, stream=self.nstream)

    def write(self, device: Any, host: np.ndarray) -> None:
        """Copy ``host`` into ``device`` on the stream in use."""
        device.copy_to_device(host, stream=self.nstream)

    def download(self, device: Any, out: Optional[np.ndarray] = None) -> np.ndarray:
        """``device``'s values on the host, after the work queued on the stream in use."""
        host = device.copy_to_host(out, stream=self.nstream) if out is not None else device.copy_to_host(stream=self.nstream)
        self.sync_stream()
        return host

    def sync_stream(self) -> None:
        """Wait for the stream in use (numba's copies on stream 0 are synchronous already)."""
        if self.nstream:
            self.nstream.synchronize()

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

    def compiled(self, name: str, pyfunc: Any, argtypes: tuple, max_registers: int = 0) -> Compiled:
        """``pyfunc`` compiled for ``argtypes`` (or loaded from the disk cache), once per context;
        ``max_registers``: a cap on the registers per thread (0: the compiler's choice)."""
        if max_registers and not self.simulator:
            name = f"{name}_r{max_registers}"  # another binary: its own cache entry
        key = (name, argtypes)
        hit = self._compiled.get(key)
        if hit is None:
            dispatcher = self._dispatchers.get(name)
            if dispatcher is None:
                if self.simulator:
                    dispatcher = self.cuda.jit(pyfunc)
                else:
                    extra = {"max_registers": max_registers} if max_registers else {}
                    dispatcher = self.cuda.jit(pyfunc, fastmath=False, **extra)
                    enable_kernel_cache(dispatcher, name)
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

    def launch(self, compiled: Compiled, args: tuple, grid: int, block: int) -> "PreparedLaunch":
        """Launch a planned kernel; ``args[-1]`` is the per-step scalars record (rewritten in place).
        Returns the prepared launch (a caller may launch it again while its arguments hold)."""
        head = (id(compiled), grid, block)
        key = head + argument_key(args[:-1])
        prepared = self._launches.get(key)
        if prepared is None:
            # The same kernel on arrays of the same shapes (another pointer table): a launch prepared
            # with the first one on another table of its pointer tables, or re-marshalling only those
            shapes = head + tuple(a if isinstance(a, (int, np.integer, tuple)) else _array_signature(a)
                                  for a in args[:-1])
            twin = self._launch_shapes.get(shapes)
            if twin is not None:
                prepared = twin.sibling(args[:-1]) or twin.rebound(args)
            else:
                prepared = PreparedLaunch(self, compiled, args, grid, block)
                self.prepare_siblings(prepared, args)
            self._launches[key] = self._launch_shapes[shapes] = prepared
            if len(self._launches) > 4 * _LRU:
                self._launches.popitem(last=False)
            if len(self._launch_shapes) > 4 * _LRU:
                self._launch_shapes.popitem(last=False)
        else:
            self._launches.move_to_end(key)
        prepared(args[-1], self.stream, self.nstream)
        return prepared

    def prepare_siblings(self, prepared: "PreparedLaunch", args: tuple) -> None:
        """Prepare the same launch on each other table of a pointer-table argument's
        :class:`PointerTables` (with the first launch of a kernel, which may take its time): the step
        that meets a new address set (the second, as a rule: torch's allocator hands the second
        backward other blocks) then only rewrites a table, and marshals no launch."""
        for i, arg in enumerate(args[:-1]):
            ref = self._table_siblings.get(id(arg))
            tables = ref() if ref is not None else None
            if tables is None or not any(t is arg for t in tables.devices):
                continue
            family = {id(arg): prepared}
            for other in tables.devices:
                if other is not arg:
                    family[id(other)] = prepared.rebound(args[:i] + (other,) + args[i + 1:])
            for launch in family.values():
                launch.family, launch.table_at = family, i
            return

    # ------------------------------------------------ tables

    def chunk_table(self, layout: Any, chunk: int, grid: int = 0):
        """Device int64[nchunks + 1, 4] (tensor, start, count, state offset), once per layout, chunk
        size and ``grid`` (``TensorLayout.chunks``). The row after the chunks starts at zero: kernels
        that claim chunks count there (the claims, then the blocks done) and the last block sets it
        back to zero."""
        key = ("cuda.chunks", chunk, grid)
        table = layout.cache.get(key)
        if table is None:
            tensor, start, stop = layout.chunks(chunk, grid)
            host = np.stack([tensor, start, stop - start, layout.offsets[tensor]], axis=1).astype(np.int64)
            host = np.concatenate([host, np.zeros((1, 4), np.int64)])
            table = layout.cache[key] = (self.upload(np.ascontiguousarray(host)), len(tensor))
        return table

    def pointer_table(self, layout: Any, paddr: Tuple[int, ...], gaddr: Tuple[int, ...]):
        """Device int64[ntensors, 2] (param address, grad address) of one address set (:class:`PointerTables`)."""
        tables = layout.cache.get("cuda.pointers")
        if tables is None:
            tables = layout.cache["cuda.pointers"] = PointerTables(self, len(paddr))
        return tables.table(paddr, gaddr)

    def row_tables(self, name: str, rows: int, columns: int) -> "PointerTables":
        """:class:`PointerTables` of ``columns`` int64 columns and room for ``rows`` rows (rounded up
        to a power of two), made once per name and size: tables that belong to no layout."""
        room = 1 << max(0, rows - 1).bit_length()
        key = (name, room, columns)
        tables = self._row_tables.get(key)
        if tables is None:
            tables = self._row_tables[key] = PointerTables(self, room, columns)
        return tables

    def addresses(self, arrays: List[Any], label: str) -> Tuple[int, ...]:
        """Device addresses of a list of arrays, cached by the arrays' identities.

        Like the optimizer's validation cache, this takes an array object to keep its memory
        between steps (true of numba and CuPy arrays; torch tensors are re-checked through
        ``data_ptr()``, since ``tensor.data`` can be reassigned). The cache
        (``optirs/backends/common/identity_cache.py``) holds the arrays weakly and drops an entry
        when one of them goes, so a model dropped with its optimizer gives its memory back at
        once, not when 16 later lists have pushed its entry out.
        """
        key = identity_key(arrays)
        hit = self._address_cache.get_by_identity(key)
        if hit is not None:
            out, swappable = hit
            # A torch tensor can change storage under the same object (``tensor.data = ...``):
            # its data_ptr() is cheap, so check those before trusting the cached addresses.
            if not swappable or all(arrays[i].data_ptr() == out[i] for i in swappable):
                return out
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
        self._address_cache.put(key, arrays, (out, swappable), key)
        return out

    # ------------------------------------------------ staging numpy inputs

    def staging(self, shapes: Tuple[Tuple[int, ...], ...], sizes: List[int]):
        """Reused device buffers (params, grads) and pinned host buffers for one model's shapes."""
        hit = self._staging.get(shapes)
        if hit is None:
            starts, end = aligned_offsets(sizes)  # each tensor where the layout puts its state
            offsets = np.append(starts, end).astype(np.int64)
            total = max(1, end)
            dp, dg = self.empty(total, np.float32), self.empty(total, np.float32)
            try:
                hp = self.cuda.pinned_array(total, dtype=np.float32)
                hg = self.cuda.pinned_array(total, dtype=np.float32)
            except Exception:
                hp, hg = np.empty(total, np.float32), np.empty(total, np.float32)
            hp.fill(0)  # the gaps between tensors: copied, never stepped
            hg.fill(0)
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


class PointerTables:
    """The pointer tables of one layout: up to ``_LRU`` device tables of int64 rows (``columns`` a
    row: a parameter's and a gradient's address, or what a fingerprint launch reads of each array),
    made once, each holding one address set (gradients are often new tensors every step, at
    addresses the allocator reuses).

    A known address set reuses its table; a new one rewrites the least recently used table with an
    asynchronous copy from its own pinned buffer on the step's stream, so a step neither allocates
    nor waits for the device: the copy is ordered before the launch that reads it and after every
    earlier launch on that stream that read the old contents. Before a pinned buffer is rewritten
    its last copy must have been read (its event); a table last written on another stream waits
    for that stream's work first.
    """

    def __init__(self, ctx: "CudaContext", ntensors: int, columns: int = 2):
        self.ctx, self.ntensors, self.columns = ctx, max(1, ntensors), columns
        self.by_key: "OrderedDict[tuple, list]" = OrderedDict()
        self.slots: List[list] = []  # [device table, pinned host table, its copy's event, stream handle, index]
        self.last: tuple = ((), None)  # the last columns asked for and their slot

    def _allocate(self) -> None:
        """Every table's device and pinned memory at once (pinned memory costs a millisecond per
        allocation: the second step, whose gradients are new tensors, must not pay it)."""
        ctx, shape = self.ctx, (_LRU, self.ntensors, self.columns)
        try:
            hosts = ctx.cuda.pinned_array(shape, dtype=np.int64)
        except Exception:  # pinned memory refused: a synchronous copy from ordinary memory
            hosts = np.empty(shape, np.int64)
        devices = ctx.empty(_LRU * self.columns * self.ntensors, np.int64).reshape(shape)
        self.hosts = [hosts[k] for k in range(_LRU)]
        self.devices = [devices[k] for k in range(_LRU)]
        self.host_addresses = [h.__array_interface__["data"][0] for h in self.hosts]
        self.device_addresses = [device_address(d) for d in self.devices]
        siblings = ctx._table_siblings
        if len(siblings) > 64 * _LRU:  # forget the tables of layouts that are gone
            for key in [k for k, ref in siblings.items() if ref() is None]:
                del siblings[key]
        for table in self.devices:
            siblings[id(table)] = weakref.ref(self)
        # events too: with a raw launcher, each pinned buffer's last copy is tracked by one (recorded
        # once now, so that numba binds its event calls here and not on a step's first new table)
        self.events = [ctx.cuda.event(timing=False) if ctx.launcher is not None else None for _ in range(_LRU)]
        self.event_handles = [None if e is None else _event_handle(e) for e in self.events]
        for event in self.events:
            if event is not None:
                event.record(ctx.nstream)

    def table(self, *columns: Tuple[int, ...]):
        """The device table holding ``columns`` (one tuple of int64 values per column, row k of each
        the table's row k), written on the stream in use if no table holds them yet."""
        return self._slot(columns)[0]

    def address(self, *columns: Tuple[int, ...]) -> int:
        """:meth:`table`'s device address."""
        k = self._slot(columns)[4]
        return self.device_addresses[k]

    def _slot(self, columns: Tuple[Tuple[int, ...], ...]) -> list:
        last = self.last
        if len(last[0]) == len(columns) and all(a is b for a, b in zip(last[0], columns)):
            return last[1]  # the caller's very tuples of the last step: no hashing
        slot = self.by_key.get(columns)
        if slot is not None:
            self.by_key.move_to_end(columns)
            self.last = (columns, slot)
            return slot
        ctx = self.ctx
        if len(self.slots) < _LRU:
            if not self.slots:
                self._allocate()
            k = len(self.slots)
            slot = [self.devices[k], self.hosts[k], self.events[k], ctx.stream, k]
            self.slots.append(slot)
            written = False
        else:
            _, slot = self.by_key.popitem(last=False)
            written = True
        device, host, event, stream, k = slot
        if written and event is not None:
            event.synchronize()  # the pinned buffer's last copy has been read (long done, as a rule)
        if stream != ctx.stream:
            ctx.numba_stream(stream).synchronize() if stream else ctx.cuda.default_stream().synchronize()
        for j, column in enumerate(columns):
            if column:
                host[: len(column), j] = column
        launcher = ctx.launcher
        if launcher is None or not launcher.copy_to_device_async(self.device_addresses[k], host, ctx.stream,
                                                                  self.host_addresses[k]):
            device.copy_to_device(host, stream=ctx.nstream)
        if event is not None:
            launcher.record_event(event, ctx.stream, ctx.nstream, self.event_handles[k])
        slot[3] = ctx.stream
        self.by_key[columns] = slot
        self.last = (columns, slot)
        return slot


def stream_handle(stream: Any) -> int:
    """The raw CUstream of a handle or stream object (torch.cuda.Stream, numba Stream, CuPy Stream)."""
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool) and int(stream) >= 0:
        return int(stream)
    for attr in ("cuda_stream", "ptr"):  # torch, CuPy
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    handle = getattr(stream, "handle", None)  # numba
    if handle is not None:
        value = getattr(handle, "value", handle)
        if value is None or isinstance(value, int):
            return int(value or 0)
    raise InvalidParameterError(
        f"stream={stream!r}, expected a raw CUDA stream handle (int >= 0, 0: the legacy default stream), a "
        "torch.cuda.Stream, a numba or CuPy stream, or None/'auto' (torch's current stream for torch tensors)"
    )


def _torch_stream(tensor: Any) -> int:
    """torch's current stream on a CUDA tensor's device (0 for anything that is not one)."""
    device = getattr(tensor, "device", None)
    if getattr(device, "type", None) != "cuda":
        return 0
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the handle without a Stream object
    if raw is not None and device.index is not None:
        return int(raw(device.index))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _torch_capturing() -> bool:
    """torch's current stream is being captured (False when torch or its CUDA is not in use)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _head_types(family: str) -> tuple:
    """numba types of a kernel family's arguments before the scalars record (see cuda_kernels)."""
    from numba import types

    table, i64, acc = types.int64[:, ::1], types.int64, types.float64[:, ::1]
    return {"step": (table, table, i64, i64, i64, i64, i64, i64, i64),
            "scalars": (i64, i64, i64, i64, i64, i64),
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
