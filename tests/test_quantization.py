"""optirs.analysis.quantization against its authorities: torch 2.x CPU (fake-quant values, their
autograd gradients, observers' scale and zero point) and ml_dtypes (FP8 casts), bit for bit, on
every fake-quant backend installed here (numpy, cpu, cuda or its simulator, opencl)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optirs import (AdamParams, GpuAdam, GpuOptimizerConfig, GpuSgd, InvalidParameterError, ShapeMismatchError,
                    SgdParams, UnsupportedOperationError)
import optirs
from optirs.core import reference
from optirs.core.simulator import cuda_simulator_enabled
from optirs.analysis import quantization as qz
from optirs.analysis.quantization import (Fp8Format, IntDtype, QuantParams, QuantScheme, QuantTarget, RoundingMode,
                                          fake_quant_backward, fake_quant_fp8, fake_quant_int,
                                          fake_quant_int_per_channel, per_channel_params, per_tensor_params)
from optirs.optim.qat import QatConfig, QatOptimizer

from conftest import FakeHostBackend, from_backend_array, to_backend_array  # noqa: E402

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
from torch.ao.quantization import (MinMaxObserver, MovingAverageMinMaxObserver,  # noqa: E402
                                   MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver)

pytestmark = pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning")


# ------------------------------------------------------------------ backends


def _cuda_reason():
    try:
        from numba import cuda

        return "" if cuda.is_available() else "no CUDA device (set NUMBA_ENABLE_CUDASIM=1 for the simulator)"
    except Exception as exc:  # pragma: no cover
        return f"numba.cuda unusable: {exc}"


def _opencl_reason():
    try:
        import pyopencl as cl

        return "" if any(p.get_devices() for p in cl.get_platforms()) else "no OpenCL device"
    except Exception as exc:
        return f"pyopencl unusable: {exc}"


def _backend_params():
    out = [pytest.param("numpy", id="numpy"), pytest.param("cpu", marks=pytest.mark.cpu, id="cpu")]
    for name, reason in (("cuda", _cuda_reason()), ("opencl", _opencl_reason())):
        marks = [getattr(pytest.mark, name)]
        if reason:
            marks.append(pytest.mark.skip(reason=f"{name}: {reason}"))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


BACKENDS = _backend_params()


def small(backend: str, n: int) -> int:
    """The simulator runs one Python thread per element: keep its arrays tiny."""
    return min(n, 96) if backend == "cuda" else n


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.int32)


def assert_bits_equal(actual, expected, what=""):
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, (a.shape, e.shape)
    bad = np.flatnonzero(a.ravel() != e.ravel())
    assert bad.size == 0, (f"{what}: {bad.size} mismatches, first at {bad[:5]}: "
                           f"{np.asarray(actual).ravel()[bad[:5]]} vs {np.asarray(expected).ravel()[bad[:5]]}")


# ------------------------------------------------------------------ inputs


SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e30, -1e30, 3e38, -3e38, 1e-45, -1e-45, 1e-38, 1e19, -1e19],
                    np.float32)


def edge_inputs(rng, scale, zp, qmin, qmax, n):
    """Random values over and beyond the range, plus exact ties (k + 0.5 in the quantized
    domain), the grid points at and around the clamp boundaries and their float neighbours,
    zeros and non-finite values."""
    s = np.float32(scale)
    k = np.arange(qmin - 3, qmax + 4, dtype=np.float64)
    grid = ((k - zp) * s).astype(np.float32)
    ties = ((k + 0.5 - zp) * s).astype(np.float32)
    near = np.concatenate([np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    span = float(s) * (qmax - qmin)
    rand = (rng.uniform(-0.7, 0.7, n) * span + (qmin + qmax) / 2 * float(s) - zp * float(s)).astype(np.float32)
    x = np.concatenate([SPECIALS, grid, ties, near, rand]).astype(np.float32)
    return x[rng.permutation(x.size)]


def torch_fq_tensor(x, scale, zp, qmin, qmax):
    t = torch.from_numpy(x.copy()).requires_grad_()
    y = torch.fake_quantize_per_tensor_affine(t, float(scale), int(zp), qmin, qmax)
    return y.detach().numpy(), t


def torch_fq_channel(x, scale, zp, axis, qmin, qmax):
    t = torch.from_numpy(x.copy()).requires_grad_()
    y = torch.fake_quantize_per_channel_affine(t, torch.from_numpy(np.array(scale, np.float32)),
                                               torch.from_numpy(np.array(zp, np.int32)), axis, qmin, qmax)
    return y, t


# Scale, zero point and range: power-of-two scales (the ties are exact ties), arbitrary scales,
# int8 / uint8 / int4 / uint4 / reduced ranges.
PER_TENSOR_CASES = [
    (0.25, 0, -128, 127),
    (0.037, 0, -128, 127),
    (0.0625, 131, 0, 255),
    (0.1173, 17, 0, 255),
    (0.5, 0, -8, 7),
    (0.31, 3, 0, 15),
    (2.0, 0, -64, 63),
    (0.019, 100, 0, 127),
    (1.7e-4, -5, -128, 127),
    (3.0e4, 0, -128, 127),
    (1e-40, 0, -128, 127),  # subnormal: 1 / scale is inf, as in torch
]


# ------------------------------------------------------------------ integer fake-quant vs torch


@pytest.mark.parametrize("qbackend", BACKENDS)
@pytest.mark.parametrize("scale,zp,qmin,qmax", PER_TENSOR_CASES)
def test_per_tensor_matches_torch(qbackend, scale, zp, qmin, qmax, rng):
    x = edge_inputs(rng, scale, zp, qmin, qmax, 400)[: small(qbackend, 10**6)]
    x = np.concatenate([SPECIALS, x])  # keep the specials in the simulator's short array too
    expected, _ = torch_fq_tensor(x, scale, zp, qmin, qmax)
    out, mask = fake_quant_int(x, QuantParams(scale, zp, qmin, qmax), backend=qbackend, return_mask=True)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert_bits_equal(out, expected, f"per-tensor {qbackend}")
    # the mask is torch's straight-through gradient
    t = torch.from_numpy(x.copy()).requires_grad_()
    torch.fake_quantize_per_tensor_affine(t, float(scale), zp, qmin, qmax).sum().backward()
    np.testing.assert_array_equal(mask, t.grad.numpy() == 1)


def test_operation_order_matters(rng):
    """Dividing by the scale instead of multiplying by its float32 inverse disagrees with torch:
    the order of operations is part of the specification, not a detail."""
    scale = np.float32(0.1)
    k = rng.integers(-120, 120, 20000)
    x = ((k + 0.5) * scale).astype(np.float32)  # near-ties, where one rounding decides
    expected, _ = torch_fq_tensor(x, scale, 0, -128, 127)
    by_division = (np.clip(np.rint(x / scale), -128, 127) * scale).astype(np.float32)
    assert (bits(by_division) != bits(expected)).any()
    assert_bits_equal(fake_quant_int(x, QuantParams(scale, 0)), expected)


@pytest.mark.parametrize("qbackend", BACKENDS)
def test_per_tensor_shapes_and_constant_tensors(qbackend, rng):
    qp = QuantParams(0.05, -3, -128, 127)
    for x in (np.full((3, 4), 0.7, np.float32), np.zeros((2, 3, 2), np.float32), np.float32(1.234) * np.ones(5, np.float32),
              rng.standard_normal((2, 3, 4)).astype(np.float32), np.array(0.3, np.float32)):
        expected, _ = torch_fq_tensor(x, 0.05, -3, -128, 127)
        assert_bits_equal(fake_quant_int(x, qp, backend=qbackend), expected, str(x.shape))
    empty = np.zeros((0, 3), np.float32)
    assert fake_quant_int(empty, qp, backend=qbackend).shape == (0, 3)


@pytest.mark.parametrize("qbackend", BACKENDS)
@pytest.mark.parametrize("shape,axis", [((6, 5), 0), ((4, 7), 1), ((3, 4, 5), 1), ((2, 3, 4), 2), ((2, 3, 4), -1), ((9,), 0)])
@pytest.mark.parametrize("qrange", [(-128, 127), (0, 255), (-8, 7), (0, 15)])
def test_per_channel_matches_torch(qbackend, shape, axis, qrange, rng):
    qmin, qmax = qrange
    nch = shape[axis]
    scale = rng.uniform(0.01, 0.5, nch).astype(np.float32)
    scale[0] = 0.25  # a power of two: exact ties below
    zp = rng.integers(qmin, qmax + 1, nch).astype(np.int32)
    x = (rng.uniform(-1.2, 1.2, shape) * (qmax - qmin) * scale.max()).astype(np.float32)
    flat = x.reshape(-1)
    # specials, and ties and boundaries of channel 0 (elements with index 0 along axis)
    chan0 = np.flatnonzero(np.indices(shape)[axis % len(shape)].reshape(-1) == 0)
    picks = np.concatenate([SPECIALS, ((np.array([qmin, qmax, qmin - 1, qmax + 1, 0]) - zp[0] + 0.5) * 0.25),
                            (np.array([qmin, qmax]) - zp[0]) * 0.25]).astype(np.float32)
    flat[chan0[: picks.size]] = picks[: chan0.size]
    y, t = torch_fq_channel(x, scale, zp, axis % len(shape), qmin, qmax)
    qp = QuantParams(scale, zp, qmin, qmax, axis=axis)
    out, mask = fake_quant_int_per_channel(x, qp, backend=qbackend, return_mask=True)
    assert_bits_equal(out, y.detach().numpy(), f"per-channel {qbackend}")
    y.sum().backward()
    np.testing.assert_array_equal(mask, t.grad.numpy() == 1)


@pytest.mark.parametrize("qbackend", BACKENDS)
def test_per_channel_nonfinite_follow_torch(qbackend):
    """torch casts q to int64 per channel: NaN, +inf and huge values become INT64_MIN -> quant_min."""
    x = np.array([[np.nan, np.inf, -np.inf, 1e30, -1e30, 1e19, 3.0]], np.float32)
    y, _ = torch_fq_channel(x, [0.5], [2], 0, -128, 127)
    out = fake_quant_int_per_channel(x, QuantParams(np.array([0.5], np.float32), np.array([2]), -128, 127, axis=0),
                                     backend=qbackend)
    assert_bits_equal(out, y.detach().numpy())
    per_tensor, _ = torch_fq_tensor(x, 0.5, 2, -128, 127)
    assert per_tensor[0, 1] != out[0, 1]  # +inf: quant_max per tensor, quant_min per channel, as torch


F32_TINY, F32_HUGE = float(np.float32(1e-38)), float(np.float32(1e30))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_parameters_and_bit_patterns_match_torch(data):
    """Any float32 bit pattern as input, scales over the whole positive float32 range."""
    qmin, qmax = data.draw(st.sampled_from([(-128, 127), (0, 255), (-8, 7), (0, 15), (-64, 63), (0, 127)]))
    scale = data.draw(st.floats(F32_TINY, F32_HUGE, width=32))
    zp = data.draw(st.integers(qmin, qmax))
    raw = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
    x = np.array(raw, np.uint32).view(np.float32)
    x = np.concatenate([x, (np.array(data.draw(st.lists(st.floats(-300, 300, width=32), max_size=40)), np.float32)
                            * np.float32(scale))]).astype(np.float32)
    expected, _ = torch_fq_tensor(x, scale, zp, qmin, qmax)
    qp = QuantParams(scale, zp, qmin, qmax)
    for backend in ("numpy", "cpu"):
        assert_bits_equal(fake_quant_int(x, qp, backend=backend), expected, backend)
    xc = np.concatenate([x, x[:1]]) if x.size % 2 else x
    xc = xc.reshape(2, -1)
    scales = np.array([scale, data.draw(st.floats(F32_TINY, F32_HUGE, width=32))], np.float32)
    zps = np.array([zp, data.draw(st.integers(qmin, qmax))], np.int32)
    y, _ = torch_fq_channel(xc, scales, zps, 0, qmin, qmax)
    qpc = QuantParams(scales, zps, qmin, qmax, axis=0)
    for backend in ("numpy", "cpu"):
        assert_bits_equal(fake_quant_int_per_channel(xc, qpc, backend=backend), y.detach().numpy(), backend)


def to_device(backend, host):
    return to_backend_array(backend, host)


def to_host(a):
    return from_backend_array(a)


@pytest.mark.parametrize("qbackend", [p for p in BACKENDS if p.values[0] in ("cuda", "opencl")])
def test_device_arrays_stay_on_device(qbackend, rng):
    x = np.concatenate([SPECIALS, (rng.standard_normal(34) * 4).astype(np.float32)]).reshape(6, 8)
    g = rng.standard_normal(x.shape).astype(np.float32)
    qp = QuantParams(0.05, 7, -128, 127)
    qpc = QuantParams(np.linspace(0.01, 0.2, 8).astype(np.float32), np.arange(8) - 4, -128, 127, axis=1)
    dx, dg = to_device(qbackend, x), to_device(qbackend, g)
    out, mask = fake_quant_int(dx, qp, backend=qbackend, return_mask=True)
    assert not isinstance(out, np.ndarray) and tuple(out.shape) == x.shape
    assert_bits_equal(to_host(out), torch_fq_tensor(x, 0.05, 7, -128, 127)[0])
    np.testing.assert_array_equal(to_host(mask).astype(bool), fake_quant_int(x, qp, return_mask=True)[1])
    y, t = torch_fq_channel(x, qpc.scale, qpc.zero_point, 1, -128, 127)
    assert_bits_equal(to_host(fake_quant_int_per_channel(dx, qpc, backend=qbackend)), y.detach().numpy())
    y.backward(torch.from_numpy(g))
    assert_bits_equal(to_host(fake_quant_backward(dg, dx, qpc, backend=qbackend)), t.grad.numpy())
    np.testing.assert_array_equal(to_host(dx), x)  # the input is not modified
    with pytest.raises(UnsupportedOperationError, match="device array but backend='cpu'"):
        fake_quant_int(dx, qp, backend="cpu")
    with pytest.raises(InvalidParameterError, match="expected the same kind"):
        fake_quant_backward(g, dx, qp, backend=qbackend)


# ------------------------------------------------------------------ straight-through gradient vs torch autograd


@pytest.mark.parametrize("qbackend", BACKENDS)
@pytest.mark.parametrize("scale,zp,qmin,qmax", PER_TENSOR_CASES[:5])
def test_backward_per_tensor_matches_autograd(qbackend, scale, zp, qmin, qmax, rng):
    x = np.concatenate([SPECIALS, edge_inputs(rng, scale, zp, qmin, qmax, 200)])[: small(qbackend, 10**6)]
    g = rng.standard_normal(x.shape).astype(np.float32)
    g[:3] = [np.inf, np.nan, -0.0]
    t = torch.from_numpy(x.copy()).requires_grad_()
    torch.fake_quantize_per_tensor_affine(t, scale, zp, qmin, qmax).backward(torch.from_numpy(g))
    out = fake_quant_backward(g, x, QuantParams(scale, zp, qmin, qmax), backend=qbackend)
    assert_bits_equal(out, t.grad.numpy(), "per-tensor gradient")


@pytest.mark.parametrize("qbackend", BACKENDS)
def test_backward_per_channel_matches_autograd(qbackend, rng):
    x = (rng.standard_normal((4, 3, 5)) * 3).astype(np.float32)
    x.reshape(-1)[:6] = SPECIALS[:6]
    g = -rng.standard_normal(x.shape).astype(np.float32)
    scale = np.array([0.02, 0.05, 0.01], np.float32)
    zp = np.array([0, 10, -20], np.int32)
    y, t = torch_fq_channel(x, scale, zp, 1, -128, 127)
    y.backward(torch.from_numpy(g))
    out = fake_quant_backward(g, x, QuantParams(scale, zp, -128, 127, axis=1), backend=qbackend)
    assert_bits_equal(out, t.grad.numpy(), "per-channel gradient")


# ------------------------------------------------------------------ observers vs torch


TORCH_DTYPE = {IntDtype.INT8: torch.qint8, IntDtype.UINT8: torch.quint8, IntDtype.INT4: torch.qint8,
               IntDtype.UINT4: torch.quint8}
RANGE_4BIT = {IntDtype.INT4: dict(quant_min=-8, quant_max=7), IntDtype.UINT4: dict(quant_min=0, quant_max=15)}


def observer_cases():
    for dtype in IntDtype:
        for scheme in QuantScheme:
            for reduce_range in (False, True):
                if reduce_range and scheme is QuantScheme.SYMMETRIC and not dtype.signed:
                    continue  # torch refuses it (tested below)
                yield dtype, scheme, reduce_range


def torch_observer(cls, dtype, scheme, reduce_range, per_channel, **kw):
    qscheme = {(False, QuantScheme.SYMMETRIC): torch.per_tensor_symmetric, (False, QuantScheme.AFFINE): torch.per_tensor_affine,
               (True, QuantScheme.SYMMETRIC): torch.per_channel_symmetric, (True, QuantScheme.AFFINE): torch.per_channel_affine}
    return cls(dtype=TORCH_DTYPE[dtype], qscheme=qscheme[per_channel, scheme], reduce_range=reduce_range,
               **RANGE_4BIT.get(dtype, {}), **kw)


def observed_inputs(rng):
    yield rng.standard_normal((5, 7)).astype(np.float32) * 3
    yield rng.uniform(0.5, 4.0, (5, 7)).astype(np.float32)  # all positive
    yield -rng.uniform(0.5, 4.0, (5, 7)).astype(np.float32)  # all negative
    yield np.zeros((5, 7), np.float32)  # scale falls to eps
    yield np.full((5, 7), 1e-9, np.float32)
    yield (rng.standard_normal((5, 7)) * 1e4).astype(np.float32)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    x[2] = 0.0
    yield x


@pytest.mark.parametrize("dtype,scheme,reduce_range", list(observer_cases()))
def test_per_tensor_observer_matches_minmaxobserver(dtype, scheme, reduce_range, rng):
    for x in observed_inputs(rng):
        obs = torch_observer(MinMaxObserver, dtype, scheme, reduce_range, False)
        obs(torch.from_numpy(x))
        scale, zp = obs.calculate_qparams()
        qp = per_tensor_params(x, dtype, scheme, reduce_range=reduce_range)
        assert_bits_equal(qp.scale, scale.numpy()[0], f"scale for {x.ravel()[:3]}")
        assert int(qp.zero_point) == int(zp[0])
        assert (qp.quant_min, qp.quant_max) == (obs.quant_min, obs.quant_max)
        # and the whole pipeline: observer then fake-quant
        expected = torch.fake_quantize_per_tensor_affine(torch.from_numpy(x), scale, zp.int(), obs.quant_min,
                                                         obs.quant_max).numpy()
        assert_bits_equal(fake_quant_int(x, qp), expected, "observer + fake quant")


@pytest.mark.parametrize("dtype,scheme,reduce_range", list(observer_cases()))
@pytest.mark.parametrize("axis", [0, 1])
def test_per_channel_observer_matches_torch(dtype, scheme, reduce_range, axis, rng):
    for x in observed_inputs(rng):
        obs = torch_observer(PerChannelMinMaxObserver, dtype, scheme, reduce_range, True, ch_axis=axis)
        obs(torch.from_numpy(x))
        scale, zp = obs.calculate_qparams()
        qp = per_channel_params(x, axis, dtype, scheme, reduce_range=reduce_range)
        assert qp.axis == axis
        assert_bits_equal(qp.scale, scale.numpy(), "per-channel scale")
        np.testing.assert_array_equal(qp.zero_point, zp.numpy().astype(np.int32))
        expected = torch.fake_quantize_per_channel_affine(torch.from_numpy(x), scale, zp.int(), axis, obs.quant_min,
                                                          obs.quant_max).numpy()
        assert_bits_equal(fake_quant_int_per_channel(x, qp), expected)


def test_custom_eps_and_range_match_torch(rng):
    x = (rng.standard_normal(50) * 1e-6).astype(np.float32)
    for eps, qrange in ((1e-3, dict(quant_min=-32, quant_max=31)), (1e-12, {}), (0.5, dict(quant_min=0, quant_max=100))):
        dtype = IntDtype.UINT8 if qrange.get("quant_min", -1) == 0 else IntDtype.INT8
        for scheme, qscheme in ((QuantScheme.AFFINE, torch.per_tensor_affine), (QuantScheme.SYMMETRIC, torch.per_tensor_symmetric)):
            obs = MinMaxObserver(dtype=TORCH_DTYPE[dtype], qscheme=qscheme, eps=eps, **qrange)
            obs(torch.from_numpy(x))
            scale, zp = obs.calculate_qparams()
            qp = per_tensor_params(x, dtype, scheme, eps=eps, **qrange)
            assert_bits_equal(qp.scale, scale.numpy()[0])
            assert int(qp.zero_point) == int(zp[0]) and qp.quant_max == obs.quant_max


# ------------------------------------------------------------------ stochastic rounding


@pytest.mark.parametrize("qbackend", BACKENDS)
def test_stochastic_rounding_same_bits_on_every_backend(qbackend, rng):
    x = np.concatenate([SPECIALS, (rng.standard_normal(300) * 2).astype(np.float32)])[: small(qbackend, 10**6)]
    for qp, fn in ((QuantParams(0.05, 3, -128, 127), fake_quant_int),
                   (QuantParams(np.array([0.05, 0.1], np.float32), np.array([0, -4]), -128, 127, axis=1),
                    fake_quant_int_per_channel)):
        xx = x[: x.size // 2 * 2].reshape(-1, 2) if qp.per_channel else x
        ref = fn(xx, qp, rounding="stochastic", seed=1234, backend="numpy")
        out = fn(xx, qp, rounding=RoundingMode.STOCHASTIC, seed=1234, backend=qbackend)
        assert_bits_equal(out, ref, f"stochastic {qbackend}")


def test_stochastic_rounding_properties(rng):
    scale = 0.125
    qp = QuantParams(scale, 0, -128, 127)
    x = (rng.uniform(-10, 10, 2000)).astype(np.float32)
    x[:50] = (np.arange(50) - 25) * np.float32(scale)  # on the grid: never moved
    a = fake_quant_int(x, qp, rounding="stochastic", seed=5)
    np.testing.assert_array_equal(a, fake_quant_int(x, qp, rounding="stochastic", seed=5))  # reproducible
    assert not np.array_equal(a, fake_quant_int(x, qp, rounding="stochastic", seed=6))
    lo, hi = np.floor(x / scale) * scale, np.ceil(x / scale) * scale
    assert np.all((a == lo) | (a == hi))  # always a neighbouring grid point
    np.testing.assert_array_equal(a[:50], x[:50])
    # unbiased: the mean over seeds approaches x (nearest rounding is off by up to scale/2 per element)
    runs = np.stack([fake_quant_int(x, qp, rounding="stochastic", seed=s) for s in range(300)])
    err = runs.mean(axis=0) - x
    assert abs(err.mean()) < 0.01 * scale
    assert np.abs(err).max() < 5 * 0.5 * scale / np.sqrt(300)
    nearest_err = fake_quant_int(x, qp) - x
    assert np.abs(nearest_err).max() > 0.4 * scale


# ------------------------------------------------------------------ FP8 vs ml_dtypes


def fp8_inputs(rng, fmt):
    m = np.float32(fmt.max)
    dt = fmt.ml_dtype
    all_codes = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)  # every representable value
    finite = all_codes[np.isfinite(all_codes)]
    sorted_finite = np.sort(finite)
    mids = ((sorted_finite[:-1].astype(np.float64) + sorted_finite[1:]) / 2).astype(np.float32)  # ties
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    beyond = np.array([m * 1.03, m * 1.04, m * 1.1, m * 2, -m * 1.2, 1e30, 3e38], np.float32)
    rand = (rng.standard_normal(500) * float(m) / 8).astype(np.float32)
    return np.concatenate([SPECIALS, all_codes, mids, near, beyond, rand, np.float32([2.0**-20, -(2.0**-17)])])


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_fp8_cast_matches_ml_dtypes(fmt, rng):
    x = fp8_inputs(rng, fmt)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(fmt.ml_dtype).astype(np.float32)
    out = fake_quant_fp8(x, fmt, scale=1.0)
    assert_bits_equal(out, expected, f"fp8 {fmt.value}")
    if fmt is Fp8Format.E4M3:
        assert np.isnan(out[np.isinf(x)]).all()  # e4m3fn has no infinity
    else:
        assert np.isinf(out[np.isinf(x)]).all()


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_fp8_saturating_clamps_to_finite_max(fmt, rng):
    x = fp8_inputs(rng, fmt)
    out = fake_quant_fp8(x, fmt, scale=1.0, saturate=True)
    m = np.float32(fmt.max)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(x))
    assert np.all(np.abs(out[~np.isnan(x)]) <= m)
    assert np.all(out[x >= m] == m) and np.all(out[x <= -m] == -m)
    inside = np.abs(x) < m
    with np.errstate(over="ignore", invalid="ignore"):
        assert_bits_equal(out[inside], x[inside].astype(fmt.ml_dtype).astype(np.float32))


def test_fp8_matches_torch_cast_in_range(rng):
    for fmt, tdtype in ((Fp8Format.E4M3, torch.float8_e4m3fn), (Fp8Format.E5M2, torch.float8_e5m2)):
        x = (rng.standard_normal(1000) * fmt.max / 16).astype(np.float32)
        expected = torch.from_numpy(x).to(tdtype).float().numpy()
        assert_bits_equal(fake_quant_fp8(x, fmt, scale=1.0), expected)


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("margin", [0, 2])
def test_fp8_amax_scaling(fmt, margin, rng):
    x = (rng.standard_normal((8, 16)) * 3e-3).astype(np.float32)
    x[0, 0] = np.nan  # ignored by amax
    amax = np.float32(np.nanmax(np.abs(x)))
    s = np.float32(np.float32(fmt.max) / amax) / np.float32(2.0**margin)
    with np.errstate(invalid="ignore"):
        expected = (x * s).astype(fmt.ml_dtype).astype(np.float32) / s
    out = fake_quant_fp8(x, fmt, margin=margin)
    assert_bits_equal(out, expected)
    assert s == fmt.scale_for(amax, margin)
    finite = ~np.isnan(x)
    assert np.max(np.abs(out[finite] - x[finite]) / np.abs(x[finite])) < 2.0 ** -(3 if fmt is Fp8Format.E4M3 else 2)
    assert fmt.scale_for(0.0) == 1.0 and fmt.scale_for(np.inf) == 1.0


# ------------------------------------------------------------------ bad input


def test_bad_input_raises_project_errors():
    x = np.ones(4, np.float32)
    qp = QuantParams(0.1, 0)
    for kwargs in (dict(scale=0.0, zero_point=0), dict(scale=-1.0, zero_point=0), dict(scale=np.nan, zero_point=0),
                   dict(scale=1e39, zero_point=0), dict(scale=0.1, zero_point=200),
                   dict(scale=0.1, zero_point=0, quant_min=5, quant_max=3), dict(scale=0.1, zero_point=0.5)):
        with pytest.raises(InvalidParameterError):
            QuantParams(**kwargs)
    with pytest.raises(ShapeMismatchError, match="per channel"):
        QuantParams(0.1, 0, axis=0)
    with pytest.raises(InvalidParameterError, match="float64, expected float32"):
        fake_quant_int(x.astype(np.float64), qp)
    with pytest.raises(InvalidParameterError, match="per-channel"):
        fake_quant_int(x, QuantParams(np.ones(4, np.float32), np.zeros(4), axis=0))
    with pytest.raises(InvalidParameterError, match="per-tensor"):
        fake_quant_int_per_channel(x, qp)
    with pytest.raises(ShapeMismatchError, match="3 channels"):
        fake_quant_int_per_channel(np.ones((2, 3), np.float32), QuantParams(np.ones(2, np.float32), np.zeros(2), axis=1))
    with pytest.raises(InvalidParameterError, match="axis=2"):
        fake_quant_int_per_channel(np.ones((2, 3), np.float32), QuantParams(np.ones(2, np.float32), np.zeros(2), axis=2))
    with pytest.raises(UnsupportedOperationError, match="'metal'"):
        fake_quant_int(x, qp, backend="metal")
    with pytest.raises(UnsupportedOperationError, match="ml_dtypes"):
        fake_quant_fp8(x, backend="cpu")
    with pytest.raises(InvalidParameterError, match="seed"):
        fake_quant_int(x, qp, rounding="stochastic")
    with pytest.raises(InvalidParameterError, match="rounding"):
        fake_quant_int(x, qp, rounding="up")
    with pytest.raises(InvalidParameterError, match="reduce_range"):
        per_tensor_params(x, IntDtype.UINT8, QuantScheme.SYMMETRIC, reduce_range=True)
    with pytest.raises(NotImplementedError):  # and torch refuses it the same way
        MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric, reduce_range=True)
    with pytest.raises(InvalidParameterError, match="quant_min <= 0"):
        per_tensor_params(x, IntDtype.INT8, quant_min=1, quant_max=100)
    with pytest.raises(InvalidParameterError, match="do not fit int4"):
        per_tensor_params(x, IntDtype.INT4, quant_min=-9, quant_max=7)
    with pytest.raises(InvalidParameterError, match="finite"):
        per_tensor_params(np.array([1.0, np.nan], np.float32))
    with pytest.raises(ShapeMismatchError, match="grad has shape"):
        fake_quant_backward(np.ones(3, np.float32), x, qp)
    with pytest.raises(InvalidParameterError, match="margin"):
        fake_quant_fp8(x, margin=-1)
    with pytest.raises(InvalidParameterError, match="dtype"):
        QatConfig(dtype="int7")
    with pytest.raises(UnsupportedOperationError, match="FP8"):
        QatConfig(dtype=Fp8Format.E4M3, backend="cpu")
    with pytest.raises(InvalidParameterError, match="averaging_constant"):
        QatConfig(averaging_constant=0.0)


def test_quant_range_matches_torch():
    from torch.ao.quantization.utils import calculate_qmin_qmax

    for dtype in IntDtype:
        for reduce_range in (False, True):
            qmin, qmax, custom = qz.quant_range(dtype, reduce_range)
            kw = RANGE_4BIT.get(dtype, dict(quant_min=None, quant_max=None))
            assert (qmin, qmax) == calculate_qmin_qmax(kw["quant_min"], kw["quant_max"], custom, TORCH_DTYPE[dtype],
                                                       reduce_range)


# ------------------------------------------------------------------ QatOptimizer


def _model(rng):
    return [(rng.standard_normal((6, 5)) * 0.5).astype(np.float32), (rng.standard_normal(6) * 0.1).astype(np.float32),
            (rng.standard_normal((3, 2, 4))).astype(np.float32)]


def _torch_reference_views(params, observers, per_channel, qmin, qmax):
    out = []
    for p, obs in zip(params, observers):
        if per_channel and p.ndim == 1:
            p = p.reshape(-1, 1)  # torch's per-channel observer needs a second dimension
        obs(torch.from_numpy(p))
        scale, zp = obs.calculate_qparams()
        if per_channel:
            y = torch.fake_quantize_per_channel_affine(torch.from_numpy(p), scale, zp.int(), 0, qmin, qmax).numpy()
            out.append(y.reshape(-1) if y.shape[1:] == (1,) else y)
        else:
            out.append(torch.fake_quantize_per_tensor_affine(torch.from_numpy(p), scale, zp.int(), qmin, qmax).numpy())
    return out


@pytest.mark.parametrize("case", ["adam-per-channel-symmetric-int8", "sgd-per-tensor-affine-uint8-moving",
                                  "adam-per-tensor-int4-cpu", "sgd-per-channel-affine-moving-cpu"])
def test_qat_steps_equal_composition_of_optimizer_observer_and_torch_fake_quant(case, rng):
    params = _model(rng)
    ref_params = [p.copy() for p in params]
    hp_adam = AdamParams(lr=0.05)
    if case.startswith("adam"):
        inner, ref = GpuAdam(hp_adam, GpuOptimizerConfig("cpu")), GpuAdam(hp_adam, GpuOptimizerConfig("cpu"))
    else:
        hp = SgdParams(lr=0.1, momentum=0.9)
        inner, ref = GpuSgd(hp, GpuOptimizerConfig("cpu")), GpuSgd(hp, GpuOptimizerConfig("cpu"))
    if case == "adam-per-channel-symmetric-int8":
        cfg = QatConfig(IntDtype.INT8, QuantScheme.SYMMETRIC, axis=0)
        obs = [PerChannelMinMaxObserver(0, torch.qint8, torch.per_channel_symmetric) for _ in params]
        per_channel, qrange = True, (-128, 127)
    elif case == "sgd-per-tensor-affine-uint8-moving":
        cfg = QatConfig(IntDtype.UINT8, QuantScheme.AFFINE, observer="moving_average", averaging_constant=0.3)
        obs = [MovingAverageMinMaxObserver(0.3, torch.quint8, torch.per_tensor_affine) for _ in params]
        per_channel, qrange = False, (0, 255)
    elif case == "sgd-per-channel-affine-moving-cpu":
        cfg = QatConfig(IntDtype.INT8, QuantScheme.AFFINE, axis=0, observer="moving_average", averaging_constant=0.1,
                        backend="cpu")
        obs = [MovingAveragePerChannelMinMaxObserver(0.1, 0, torch.qint8, torch.per_channel_affine) for _ in params]
        per_channel, qrange = True, (-128, 127)
    else:
        cfg = QatConfig("int4", "affine", backend="cpu")
        obs = [MinMaxObserver(torch.qint8, torch.per_tensor_affine, quant_min=-8, quant_max=7) for _ in params]
        per_channel, qrange = False, (-8, 7)
    qat = QatOptimizer(inner, cfg)
    ref64 = [p.astype(np.float64) for p in params]
    state64 = [{} for _ in params]
    for step in range(1, 5):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        qat.step_gpu(params, grads)
        ref.step_gpu(ref_params, grads)
        for p, r in zip(params, ref_params):
            assert_bits_equal(p, r, "master weights = the inner optimizer's")
        expected = _torch_reference_views(ref_params, obs, per_channel, *qrange)
        for q, e in zip(qat.quantized_params(), expected):
            assert_bits_equal(q, e, f"quantized view at step {step}")
        if case.startswith("adam"):
            ref64, state64 = reference.adam(ref64, grads, state64, hp_adam, step)
            for p, r in zip(params, ref64):
                np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-6)
    assert qat.step_count == 4
    qps = qat.quant_params()
    assert all(isinstance(q, QuantParams) and q.per_channel == per_channel for q in qps)


def test_qat_gradient_target_fake_quantizes_grads_per_step(rng):
    params = _model(rng)
    ref_params = [p.copy() for p in params]
    hp = SgdParams(lr=0.1)
    qat = QatOptimizer(GpuSgd(hp, GpuOptimizerConfig("cpu")),
                       QatConfig(targets=(QuantTarget.WEIGHTS, QuantTarget.GRADIENTS), scheme="affine"))
    ref = GpuSgd(hp, GpuOptimizerConfig("cpu"))
    for _ in range(3):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        keep = [g.copy() for g in grads]
        qgrads = []
        for g in grads:
            obs = MinMaxObserver(torch.qint8, torch.per_tensor_affine)  # a fresh observer: each step's own range
            obs(torch.from_numpy(g))
            s, z = obs.calculate_qparams()
            qgrads.append(torch.fake_quantize_per_tensor_affine(torch.from_numpy(g), s, z.int(), -128, 127).numpy())
        qat.step_gpu(params, grads)
        ref.step_gpu(ref_params, qgrads)
        for g, k in zip(grads, keep):
            np.testing.assert_array_equal(g, k)  # the caller's gradients are not modified
        for p, r in zip(params, ref_params):
            assert_bits_equal(p, r)


def test_qat_fp8_weights(rng):
    params = _model(rng)
    ref_params = [p.copy() for p in params]
    hp = AdamParams(lr=0.01)
    qat = QatOptimizer(GpuAdam(hp, GpuOptimizerConfig("cpu")), QatConfig(Fp8Format.E4M3, fp8_margin=1))
    ref = GpuAdam(hp, GpuOptimizerConfig("cpu"))
    amax = [0.0] * len(params)
    for _ in range(3):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        qat.step_gpu(params, grads)
        ref.step_gpu(ref_params, grads)
        for i, (q, r) in enumerate(zip(qat.quantized_params(), ref_params)):
            amax[i] = max(amax[i], float(np.abs(r).max()))  # running min/max observer -> amax
            s = np.float32(np.float32(448.0) / np.float32(amax[i])) / np.float32(2.0)
            assert_bits_equal(q, (r * s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / s)


def test_qat_state_dict_round_trip_continues_identically(rng):
    params = _model(rng)
    cfg = QatConfig(IntDtype.INT8, QuantScheme.AFFINE, axis=0, observer="moving_average")
    a = QatOptimizer(GpuAdam(AdamParams(lr=0.02), GpuOptimizerConfig("cpu")), cfg)
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(5)]
    for g in grads[:2]:
        a.step_gpu(params, g)
    sd = a.state_dict()
    assert sd["step"] == 2 and len(sd["observers"]) == 3 and sd["observers"][0]["min_val"].shape == (6,)
    b_params = [p.copy() for p in params]
    b = QatOptimizer(GpuAdam(AdamParams(lr=0.02), GpuOptimizerConfig("cpu")), cfg)
    b.load_state_dict(sd)
    for g in grads[2:]:
        a.step_gpu(params, g)
        b.step_gpu(b_params, g)
    for x, y in zip(a.quantized_params() + params, b.quantized_params() + b_params):
        assert_bits_equal(x, y)
    with pytest.raises(InvalidParameterError, match="differs"):
        QatOptimizer(GpuAdam(AdamParams(lr=0.02), GpuOptimizerConfig("cpu")), QatConfig()).load_state_dict(sd)


def test_qat_failed_step_changes_nothing(rng):
    params = _model(rng)
    qat = QatOptimizer(GpuAdam(AdamParams(lr=0.02), GpuOptimizerConfig("cpu")), QatConfig())
    good = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    qat.step_gpu(params, good)
    before = [p.copy() for p in params]
    views, sd = qat.quantized_params(), qat.state_dict()
    bad = [g.copy() for g in good]
    bad[1][2] = np.nan
    with pytest.raises(InvalidParameterError, match=r"grads\[1\] holds non-finite"):
        qat.step_gpu(params, bad)
    with pytest.raises(ShapeMismatchError):
        qat.step_gpu(params[:2], good[:2])
    with pytest.raises(UnsupportedOperationError, match="numpy float32"):
        qat.step_gpu([p.tolist() for p in params], good)
    for p, b in zip(params, before):
        assert_bits_equal(p, b)
    for v, w in zip(qat.quantized_params(), views):
        assert_bits_equal(v, w)
    assert qat.step_count == 1 and qat.inner.step_count == 1
    np.testing.assert_array_equal(qat.state_dict()["observers"][0]["min_val"], sd["observers"][0]["min_val"])


def test_qat_freeze_observers(rng):
    params = _model(rng)
    qat = QatOptimizer(GpuSgd(SgdParams(lr=1.0), GpuOptimizerConfig("cpu")), QatConfig(freeze_observers_after=1))
    qat.step_gpu(params, [np.ones_like(p) for p in params])
    frozen = qat.state_dict()["observers"]
    qat.step_gpu(params, [np.full_like(p, -5.0) for p in params])  # weights grow by 5: outside the old range
    now = qat.state_dict()["observers"]
    for a, b in zip(frozen, now):
        assert a["min_val"] == b["min_val"] and a["max_val"] == b["max_val"]
    qp = qat.quant_params()[0]
    expected = fake_quant_int(params[0], qp)
    assert_bits_equal(qat.quantized_params()[0], expected)
    assert qat.quantized_params()[0].max() < params[0].max()  # clamped by the frozen range


# ------------------------------------------------------------------ CUDA code generation, plugin


def test_cuda_element_compiles_for_sm90_without_fma():
    """The per-element device code compiles for sm_90, and no multiply is fused into an FMA
    (which would skip the float32 rounding of x * inv_scale torch performs)."""
    if cuda_simulator_enabled():
        pytest.skip("numba's simulator is on: no PTX to inspect")
    from numba import cuda
    from numba.cuda import libdevice

    from optirs.backends.common.fake_quant import fq_element

    sig = "Tuple((float32, boolean))(float32, float32, float32, float32, float32, boolean, boolean, uint64, uint64, int64)"
    ptx, _ = cuda.compile_ptx(fq_element, sig, device=True, cc=(9, 0))
    assert ".target sm_90" in ptx
    assert "\tfma." not in ptx

    def probe(a, b, s, c):  # the kernels' multiply: libdevice.fmul_rn is never contracted
        i = cuda.grid(1)
        if i < a.size:
            b[i] = libdevice.fmul_rn(a[i], s) + c

    ptx, _ = cuda.compile_ptx(probe, "(float32[:], float32[:], float32, float32)", cc=(9, 0))
    assert "mul.rn.f32" in ptx and "\tfma." not in ptx

    def plain(a, b, s, c):  # control: a plain multiply-add is contracted by default
        i = cuda.grid(1)
        if i < a.size:
            b[i] = a[i] * s + c

    ptx, _ = cuda.compile_ptx(plain, "(float32[:], float32[:], float32, float32)", cc=(9, 0))
    assert "\tfma.rn.f32" in ptx


# ------------------------------------------------------------------ the fake_quant capability


def test_backend_without_the_hooks_raises_naming_it_and_the_capability(fresh_registry, rng):
    """A backend that does not implement fake_quant is refused by name, and nothing is computed."""
    optirs.register_plugin(FakeHostBackend(), "nofq")
    x = rng.standard_normal(10).astype(np.float32)
    qp, qpc = QuantParams(0.1, 0), QuantParams(np.full(2, 0.1, np.float32), np.zeros(2), axis=0)
    bound = optirs.get_backend("nofq")
    assert not bound.supports(qz.CAPABILITY)
    calls = (lambda b: fake_quant_int(x, qp, backend=b),
             lambda b: fake_quant_int_per_channel(x.reshape(2, 5), qpc, backend=b),
             lambda b: fake_quant_backward(x, x, qp, backend=b))
    for call in calls:
        for backend in ("nofq", bound):
            with pytest.raises(UnsupportedOperationError, match=r"backend 'nofq' does not implement the 'fake_quant'"):
                call(backend)
    with pytest.raises(UnsupportedOperationError, match=r"'nofq'.*'fake_quant'"):
        QatOptimizer(GpuSgd(SgdParams(lr=0.1), GpuOptimizerConfig("cpu")), QatConfig(backend="nofq"))


def test_fake_quant_on_every_feature_backend(feature_backend, rng):
    """Through the bound backend object: the built-ins match the reference bit for bit; the
    third-party example (no fake_quant hooks) is refused naming it and the capability."""
    bound = optirs.get_backend(feature_backend)
    x = np.concatenate([SPECIALS, (rng.standard_normal(50) * 3).astype(np.float32)]).reshape(8, 8)
    g = rng.standard_normal(x.shape).astype(np.float32)
    qp = QuantParams(0.05, 3, -128, 127)
    qpc = QuantParams(np.linspace(0.01, 0.3, 8).astype(np.float32), np.arange(8) - 4, -128, 127, axis=1)
    if not bound.supports(qz.CAPABILITY):
        with pytest.raises(UnsupportedOperationError, match=rf"backend '{feature_backend}'.*'fake_quant'"):
            fake_quant_int(x, qp, backend=bound)
        return
    assert_bits_equal(fake_quant_int(x, qp, backend=bound), torch_fq_tensor(x, 0.05, 3, -128, 127)[0])
    y, t = torch_fq_channel(x, qpc.scale, qpc.zero_point, 1, -128, 127)
    assert_bits_equal(fake_quant_int_per_channel(x, qpc, backend=bound), y.detach().numpy())
    y.backward(torch.from_numpy(g))
    assert_bits_equal(fake_quant_backward(g, x, qpc, backend=bound), t.grad.numpy())


def test_qat_names_are_importable_from_optirs_and_the_optim_layer():
    """QAT lives in the optim layer (it steps an optimizer); the analysis layer's numerics module no
    longer re-exports it (that import went upwards, a circle between the layers)."""
    from optirs.optim import qat

    assert optirs.QatOptimizer is QatOptimizer is qat.QatOptimizer and optirs.QatConfig is QatConfig
    assert not hasattr(qz, "QatOptimizer")


def test_plugin_is_registered():
    import optirs

    assert hasattr(qz.plugin, "optirs_plugin_info")
    info = qz.plugin.optirs_plugin_info()
    assert "fake-quant" in info["summary"]
    status = {p.name: p for p in optirs.list_plugins()}
    assert status["quantization"].error == "" and status["quantization"].summary == info["summary"]


def test_docs_examples_run():
    """Every python block of docs/quantization.md runs."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "quantization.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, "docs/quantization.md", "exec"), {})
