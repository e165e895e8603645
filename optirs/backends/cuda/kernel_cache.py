"""The CUDA kernels' disk cache: numba-cuda's own (its cubins, per compute capability), keyed so
that a kernel built by a closure loads in the next process.

numba-cuda keys a cached kernel by its bytecode and its pickled closure cells; the step kernels
are closures over compiled element functions, whose pickles carry an id drawn anew in every
process, so numba-cuda's own key never hits for them. Here the key is the kernel's name in the
context (one name, one kernel: :meth:`CudaContext.compiled`), its signature, numba-cuda's version
and the state of every source file the kernel can be built from (the cuda backend, the shared
element code and the core definitions): any edit there compiles anew, never loads a stale
kernel. A cold build is reported by the compile log (:func:`optirs.core.compile_cache.compiling`).
"""

from __future__ import annotations

from typing import Any, Optional

from optirs.core.compile_cache import key_named_cache, source_state
from optirs.core.simulator import cuda_simulator_enabled

_SOURCES = ("backends/cuda", "backends/common", "core")  # what a CUDA kernel can be built from


def enable(dispatcher: Any, name: str) -> bool:
    """Give ``dispatcher`` (a numba-cuda kernel dispatcher) a disk cache keyed by ``name``; False
    where numba-cuda's cache classes are not the ones this was written for (it then compiles in
    every process, as before)."""
    try:
        from numba.cuda.dispatcher import CUDACache
    except Exception:  # noqa: BLE001 - a numba-cuda without a kernel cache
        return False

    class KernelCache(CUDACache):
        """numba-cuda's cache with the key above; a miss opens the compile log's record of the build
        that follows, the save after it (or :func:`finish_build`) closes it."""

        def __init__(self, py_func: Any):
            self.optirs_key = (name, source_state(*_SOURCES))
            self.build: Optional[Any] = None
            super().__init__(py_func)
            # the kernels of one builder share an index (one function): file per key
            key_named_cache(self)

        def _index_key(self, sig: Any, codegen: Any) -> tuple:
            import numba_cuda

            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self.optirs_key)
            launch = getattr(self, "_launch_config_key", None)
            return key if launch is None else key + (("launch_config", launch),)

        def load_overload(self, sig: Any, target_context: Any) -> Any:
            kernel = super().load_overload(sig, target_context)
            if kernel is None and self.build is None:
                from optirs.core.compile_cache import compiling

                self.build = compiling(f"cuda.{name}", self.cache_path)
                self.build.__enter__()
            return kernel

        def save_overload(self, sig: Any, data: Any) -> None:
            super().save_overload(sig, data)
            finish_build(self)

    try:
        dispatcher._cache = KernelCache(dispatcher.py_func)
    except Exception:  # noqa: BLE001 - e.g. no usable cache directory: compile every run
        return False
    return True


def jit(pyfunc: Any, name: str) -> Any:
    """``numba.cuda.jit(pyfunc)`` with the disk cache above under ``name`` (one name per kernel
    source: a builder's closure included), for kernels launched through numba's own dispatcher.
    Under the simulator (kernels run as Python) there is nothing to cache."""
    from numba import cuda

    dispatcher = cuda.jit(pyfunc)
    if not cuda_simulator_enabled():
        enable(dispatcher, name)
    return dispatcher


def finish_build(cache: Any, error: Optional[BaseException] = None) -> None:
    """Close the compile log's record of a build that ``cache`` saw start (if any)."""
    build = getattr(cache, "build", None)
    if build is None:
        return
    cache.build = None
    if error is None:
        build.__exit__(None, None, None)
    else:
        build.__exit__(type(error), error, error.__traceback__)


__all__ = ["enable", "finish_build", "jit"]
