"""optirs.optim.data_parallel.reduce_replicas: the single-device reduction kernel on cpu, cuda (simulator) and opencl,
checked bit for bit against numpy's float32 left fold."""

from __future__ import annotations

import numpy as np
import pytest

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.optim.data_parallel import reduce_across_devices, reduce_replicas


def _kind_available(kind: str) -> str:
    try:
        if kind == "cuda":
            from numba import cuda

            if not cuda.is_available():
                return "numba.cuda finds no GPU (run with NUMBA_ENABLE_CUDASIM=1 for the simulator)"
        if kind == "opencl":
            import pyopencl as cl

            if not cl.get_platforms():
                return "no OpenCL platform"
    except Exception as exc:  # noqa: BLE001 - shown in the skip reason
        return f"{type(exc).__name__}: {exc}"
    return ""


def _kinds():
    out = []
    for kind in ("cpu", "cuda", "opencl"):
        why = _kind_available(kind)
        marks = [getattr(pytest.mark, kind)] + ([pytest.mark.skip(reason=why)] if why else [])
        out.append(pytest.param(kind, marks=marks, id=kind))
    return out


@pytest.fixture(scope="module")
def cl_queue():
    import pyopencl as cl

    ctx = cl.Context(cl.get_platforms()[0].get_devices()[:1])
    return cl.CommandQueue(ctx)


def _to(kind, host, request):
    if kind == "cpu":
        return host.copy()
    if kind == "cuda":
        from numba import cuda

        return cuda.to_device(host)
    import pyopencl.array as cla

    return cla.to_device(request.getfixturevalue("cl_queue"), host)


def _back(kind, arr):
    if kind == "cpu":
        return arr.copy()
    return arr.copy_to_host() if kind == "cuda" else arr.get()


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("n", [1, 2, 4, 5, 7])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_equals_float32_left_fold(kind, n, op, request):
    rng = np.random.default_rng(n)
    shape = (3, 37) if kind == "cuda" else (5, 301)  # the simulator runs each thread in Python
    hosts = [(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for _ in range(n)]
    expected = hosts[0].copy()
    for h in hosts[1:]:
        expected = expected + h  # float32 + float32, left to right
    if op == "mean":
        expected = expected / np.float32(n)
    arrays = [_to(kind, h, request) for h in hosts]
    out = reduce_replicas(arrays, op=op)
    assert out is arrays[0]
    np.testing.assert_array_equal(_back(kind, arrays[0]), expected)
    for a, h in zip(arrays[1:], hosts[1:]):
        np.testing.assert_array_equal(_back(kind, a), h)  # sources untouched


def test_reduce_opencl_views_with_offsets(cl_queue):
    """pyopencl arrays that are views at an offset into a larger buffer reduce at the right place."""
    if _kind_available("opencl"):
        pytest.skip("no OpenCL")
    import pyopencl.array as cla

    rng = np.random.default_rng(1)
    host = rng.standard_normal(40).astype(np.float32)
    big = cla.to_device(cl_queue, host)
    a, b = big[3:13], big[20:30]
    reduce_replicas([a, b], op="sum")
    expected = host.copy()
    expected[3:13] = host[3:13] + host[20:30]
    np.testing.assert_array_equal(big.get(), expected)


class _FakeTorchCuda:
    """Just enough of a CUDA tensor for the checks: an interface and a device index (never launched)."""

    def __init__(self, index, ptr):
        self.device = type("dev", (), {"type": "cuda", "index": index})()
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


def test_replicas_on_two_devices_are_refused():
    with pytest.raises(UnsupportedOperationError, match="DataParallelOptimizer"):
        reduce_replicas([_FakeTorchCuda(0, 4096), _FakeTorchCuda(1, 8192)])
    with pytest.raises(UnsupportedOperationError, match="torch.distributed"):
        reduce_across_devices([np.zeros(3, np.float32)])


def test_bad_replicas_change_nothing():
    a, b = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    cases = [
        (lambda: reduce_replicas([a, b], op="max"), InvalidParameterError, "op='max'"),
        (lambda: reduce_replicas([]), InvalidParameterError, "non-empty"),
        (lambda: reduce_replicas([a, np.ones(5, np.float32)]), ShapeMismatchError, "(5,)"),
        (lambda: reduce_replicas([a, np.ones(4)]), ShapeMismatchError, "float64"),
        (lambda: reduce_replicas([a, a]), InvalidParameterError, "same memory"),
        (lambda: reduce_replicas([np.ones((4, 4), np.float32)[:, 0], a]), ShapeMismatchError, "C-contiguous"),
    ]
    for call, err, words in cases:
        with pytest.raises(err) as info:
            call()
        assert words in str(info.value)
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ShapeMismatchError, match="read-only"):
        reduce_replicas([ro, b])
    np.testing.assert_array_equal(a, 1.0)
    np.testing.assert_array_equal(b, 2.0)
