"""optirs.optim.data_parallel.reduce_replicas: the ``replica_reduce`` capability of cpu, cuda (simulator) and opencl,
checked bit for bit against numpy's float32 left fold, and refused by a backend without it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BUILTIN_BACKENDS, from_backend_array, to_backend_array

import optirs
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.optim.data_parallel import reduce_across_devices, reduce_replicas


def _opencl_missing() -> str:
    try:
        import pyopencl as cl

        if not cl.get_platforms():
            return "no OpenCL platform"
    except Exception as exc:  # noqa: BLE001 - shown in the skip reason
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.fixture(scope="module")
def cl_queue():
    """A queue on a context of the test's own (not the backend's): replicas carry their context."""
    import pyopencl as cl

    ctx = cl.Context(cl.get_platforms()[0].get_devices()[:1])
    return cl.CommandQueue(ctx)


def _left_fold(hosts, op):
    expected = hosts[0].copy()
    for h in hosts[1:]:
        expected = expected + h  # float32 + float32, left to right
    if op == "mean":
        expected = expected / np.float32(len(hosts))
    return expected


def _replicas(n, shape, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4, 5, 7])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_equals_float32_left_fold(backend, n, op):
    shape = (3, 37) if backend == "cuda" else (5, 301)  # the simulator runs each thread in Python
    hosts = _replicas(n, shape, n)
    expected = _left_fold(hosts, op)
    arrays = [to_backend_array(backend, h) for h in hosts]
    out = reduce_replicas(arrays, op=op, backend=backend)
    assert out is arrays[0]
    np.testing.assert_array_equal(from_backend_array(arrays[0]), expected)
    for a, h in zip(arrays[1:], hosts[1:]):
        np.testing.assert_array_equal(from_backend_array(a), h)  # sources untouched


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_host_replicas_reduce_on_every_backend(backend, op):
    """numpy replicas on a device backend are uploaded, reduced there and written back."""
    hosts = _replicas(5, (4, 9), 3)
    expected = _left_fold(hosts, op)
    arrays = [h.copy() for h in hosts]
    assert reduce_replicas(arrays, op=op, backend=optirs.get_backend(backend)) is arrays[0]
    np.testing.assert_array_equal(arrays[0], expected)
    for a, h in zip(arrays[1:], hosts[1:]):
        np.testing.assert_array_equal(a, h)


def test_the_optimizers_backend_reduces():
    opt = optirs.GpuAdam(optirs.AdamParams(), optirs.GpuOptimizerConfig(backend="cpu"))
    hosts = _replicas(3, (17,), 5)
    arrays = [h.copy() for h in hosts]
    reduce_replicas(arrays, op="mean", backend=opt)
    np.testing.assert_array_equal(arrays[0], _left_fold(hosts, "mean"))
    with pytest.raises(InvalidParameterError, match="backend=42"):
        reduce_replicas(arrays, backend=42)


def test_a_backend_without_the_capability_refuses(feature_backend):
    bound = optirs.get_backend(feature_backend)
    hosts = _replicas(2, (6,), 7)
    arrays = [h.copy() for h in hosts]
    if feature_backend in BUILTIN_BACKENDS:
        assert bound.supports("replica_reduce")
        reduce_replicas(arrays, op="sum", backend=bound)
        np.testing.assert_array_equal(arrays[0], _left_fold(hosts, "sum"))
        return
    assert not bound.supports("replica_reduce")  # the third-party example implements the dense steps only
    with pytest.raises(UnsupportedOperationError) as info:
        reduce_replicas(arrays, op="sum", backend=bound)
    assert repr(feature_backend) in str(info.value) and "'replica_reduce'" in str(info.value)
    np.testing.assert_array_equal(arrays[0], hosts[0])  # nothing changed


@pytest.mark.opencl
def test_reduce_opencl_views_with_offsets(cl_queue):
    """pyopencl arrays that are views at an offset into a larger buffer reduce at the right place."""
    if _opencl_missing():
        pytest.skip(_opencl_missing())
    import pyopencl.array as cla

    rng = np.random.default_rng(1)
    host = rng.standard_normal(40).astype(np.float32)
    big = cla.to_device(cl_queue, host)
    a, b = big[3:13], big[20:30]
    reduce_replicas([a, b], op="sum", backend="opencl")
    expected = host.copy()
    expected[3:13] = host[3:13] + host[20:30]
    np.testing.assert_array_equal(big.get(), expected)


class _FakeTorchCuda:
    """Just enough of a CUDA tensor for the checks: an interface and a device index (never launched)."""

    def __init__(self, index, ptr):
        self.device = type("dev", (), {"type": "cuda", "index": index})()
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


@pytest.mark.cuda
def test_replicas_on_two_gpus_are_refused():
    status = {s.name: s for s in optirs.list_backends()}["cuda"]
    if not status.available:
        pytest.skip(f"backend cuda cannot open here: {status.reason}")
    with pytest.raises(UnsupportedOperationError, match="DataParallelOptimizer"):
        reduce_replicas([_FakeTorchCuda(0, 4096), _FakeTorchCuda(1, 8192)], backend="cuda")


@pytest.mark.opencl
def test_replicas_in_two_opencl_contexts_are_refused(cl_queue):
    if _opencl_missing():
        pytest.skip(_opencl_missing())
    import pyopencl.array as cla

    host = np.arange(8, dtype=np.float32)
    mine = cla.to_device(cl_queue, host)
    theirs = cla.to_device(optirs.get_backend("opencl").ctx.queue, host + 1)
    with pytest.raises(UnsupportedOperationError, match="another OpenCL context"):
        reduce_replicas([mine, theirs], backend="opencl")
    np.testing.assert_array_equal(mine.get(), host)


def test_reducing_across_devices_points_to_torch_distributed():
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
