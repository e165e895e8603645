"""Shared fixtures: the ``backend`` fixture runs a test on every installed backend that opens.

Under ``NUMBA_ENABLE_CUDASIM=1`` the ``cuda`` backend is numba's CUDA simulator; tests
parametrized with it carry the ``cuda`` marker, so ``pytest -m cuda`` is the simulator pass.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import optirs
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, hookimpl
from optirs.plugin.registry import REGISTRY

BUILTIN_BACKENDS = ("cpu", "cuda", "opencl")
# The third-party example backend (tests/plugins/optirs_numpy_backend), registered by the
# ``feature_backend`` fixture so feature tests run on it like on the built-ins.
THIRD_PARTY_BACKEND = "numpy"
THIRD_PARTY_DIR = Path(__file__).parent / "plugins" / "optirs_numpy_backend"
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

def _simulator_for_short_switches() -> None:
    """numba's simulator runs every CUDA thread as a Python thread and releases a syncthreads barrier
    from a polling loop that keeps the GIL for a whole switch interval (5 ms by default) each time it
    gets it: a barrier then costs several intervals. At 0.2 ms the block kernels' tests run 3x faster.

    Threads then interleave where they rarely did, and the simulator's ``cuda.shared.array`` makes
    a block's array on the first thread that asks without a lock (numba-cuda 0.30: check, then
    insert), so two threads could get two arrays. Here the same lookup (by the calling line, as
    the simulator keys it) is made under a lock."""
    import threading

    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    original = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's refusal
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(key)
            if found is None:
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array
    sys.setswitchinterval(2e-4)


if SIMULATOR:
    _simulator_for_short_switches()


def _status():
    return {s.name: s for s in optirs.list_backends()}


def _builtin_params():
    """One pytest param per built-in backend, marked with its name and skipped (saying why) where it cannot open."""
    status = _status()
    params = []
    for name in BUILTIN_BACKENDS:
        s = status.get(name)
        marks = [getattr(pytest.mark, name)]
        if s is None:
            marks.append(pytest.mark.skip(reason=f"backend {name} is not installed"))
        elif not s.available:
            marks.append(pytest.mark.skip(reason=f"backend {name} cannot open here: {s.reason}"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", _builtin_params())
    if "feature_backend" in metafunc.fixturenames:
        params = _builtin_params() + [pytest.param(THIRD_PARTY_BACKEND, id=THIRD_PARTY_BACKEND)]
        metafunc.parametrize("feature_backend", params, indirect=True)


def register_third_party_backend() -> None:
    """Register the example numpy backend (once per registry load) under THIRD_PARTY_BACKEND.

    With its folder on sys.path, pip's build metadata there can make the registry find it as an
    entry point by itself; then it is already registered.
    """
    if str(THIRD_PARTY_DIR) not in sys.path:
        sys.path.insert(0, str(THIRD_PARTY_DIR))
    REGISTRY.pm
    if THIRD_PARTY_BACKEND in REGISTRY.records and not REGISTRY.records[THIRD_PARTY_BACKEND].broken:
        return
    if str(THIRD_PARTY_DIR) not in sys.path:
        sys.path.insert(0, str(THIRD_PARTY_DIR))
    import optirs_numpy_backend

    optirs.register_plugin(optirs_numpy_backend, THIRD_PARTY_BACKEND)


@pytest.fixture
def feature_backend(request):
    """A backend name: every built-in that opens, and the third-party numpy example."""
    if request.param == THIRD_PARTY_BACKEND:
        register_third_party_backend()
    return request.param


def pytest_configure(config):
    for name in BUILTIN_BACKENDS:
        config.addinivalue_line("markers", f"{name}: runs on the {name} backend")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def fresh_registry():
    """A registry reloaded before and after the test, so plugins a test adds never leak."""
    REGISTRY.reload()
    yield REGISTRY
    REGISTRY.reload()


def to_backend_array(backend_name: str, host: np.ndarray):
    """A device array of the backend's own kind holding ``host`` (numpy for cpu)."""
    if backend_name == "cpu":
        return host.copy()
    if backend_name == "cuda":
        from numba import cuda

        if host.dtype.name == "bfloat16":  # CUDA arrays hold ml_dtypes' bfloat16 as its 16-bit patterns
            host = host.view(np.uint16)
        return cuda.to_device(host)
    if backend_name == "opencl":
        import pyopencl.array as cla

        return cla.to_device(optirs.get_backend("opencl").ctx.queue, host)
    raise ValueError(backend_name)


def from_backend_array(array) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array.copy()
    if hasattr(array, "copy_to_host"):
        return array.copy_to_host()
    return array.get()


class FakeHostBackend:
    """A minimal backend on host memory, for registry and validation tests; availability is set by the test."""

    def __init__(self, available=True):
        self.available = available

    @hookimpl
    def optirs_probe(self, options):
        return ProbeResult(self.available, "" if self.available else "no fake device", (DeviceInfo("fake"),))

    @hookimpl
    def optirs_open(self, options):
        return object()

    @hookimpl
    def optirs_alloc(self, size, dtype, fill):
        return np.full(size, fill, dtype)

    @hookimpl
    def optirs_to_device(self, array):
        return np.array(array).reshape(-1)

    @hookimpl
    def optirs_to_host(self, array):
        return np.array(array)

    @hookimpl
    def optirs_stage(self, params, grads):
        return Staged(params, grads)


def backend_step(backend, name, params, grads, state, layout, scalars, *, step=1, seed=0, found_inf=None,
                 check_finite=False, device=None, fmt=None, format_state=None):
    """One call of an opened backend's ``optirs_step`` (``backend.step``) for optimizer ``name``."""
    from optirs.core.definitions import DEFINITIONS
    from optirs.plugin.hookspecs import StepControls, StepRequest

    backend.step(backend.ctx, StepRequest(DEFINITIONS[name], params, grads, state, layout, scalars,
                                          StepControls(step, seed, found_inf, check_finite, device), fmt,
                                          format_state))


def interrupt_at(line_event, package="/optirs/"):
    """A trace function that sends SIGINT to the main thread (as Ctrl-C does) at the given line
    event (counted over optirs' own frames), and the counter of those events; install it with
    ``sys.settrace``."""
    import _thread

    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == line_event:
                _thread.interrupt_main()
        return local

    def global_trace(frame, event, arg):
        return local if package in frame.f_code.co_filename else None

    return global_trace, count
