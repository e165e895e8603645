"""Quantization-aware training: fake-quant primitives and :class:`QatOptimizer`.

Integer fake-quant reproduces PyTorch bit for bit: the values of
``torch.fake_quantize_per_tensor_affine`` / ``torch.fake_quantize_per_channel_affine`` (and their
straight-through gradients), and the scale and zero point of
``torch.ao.quantization.MinMaxObserver`` / ``PerChannelMinMaxObserver`` (and their moving-average
variants). Every float32 operation is the one torch's CPU kernel performs, in the same order:

.. code-block:: text

    inv_scale = 1.0f / scale
    q   = zero_point + nearbyint(x * inv_scale)        (float32; ties to even)
    out = (clamp(q, quant_min, quant_max) - zero_point) * scale
    mask = quant_min <= q <= quant_max                  (the straight-through gradient)

FP8 (E4M3 "fn" and E5M2) rounds to nearest even through ml_dtypes' casts, optionally scaled per
tensor from the absolute maximum, saturating or not.

Where it runs: ``backend="numpy"`` is the vectorized host reference (the default, no backend);
any other name (or a bound :class:`optirs.plugin.registry.Backend`) runs integer fake-quant and
its gradient through that backend's ``fake_quant`` capability, the hooks
``optirs_fake_quant_forward`` / ``optirs_fake_quant_backward`` taking a
:class:`~optirs.plugin.hookspecs.FakeQuantGrid`. The built-in backends implement them in
``optirs/backends/<name>/fake_quant.py`` (shared per-element math:
:mod:`optirs.backends.common.fake_quant`). FP8 runs on the host reference only (the conversion
is ml_dtypes').

:class:`QatConfig` and :class:`QatOptimizer` live in :mod:`optirs.optim.qat`; they are
re-exported here.

Nothing heavy is imported with this module: numba, pyopencl and ml_dtypes load on first use.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.plugin.hookspecs import FakeQuantGrid, StochasticKeys, hookimpl

__all__ = [
    "fake_quant_int", "fake_quant_int_per_channel", "fake_quant_fp8", "fake_quant_backward",
    "per_channel_params", "per_tensor_params", "QuantParams", "QuantScheme", "QuantTarget", "IntDtype",
    "Fp8Format", "RoundingMode", "QatConfig", "QatOptimizer", "BACKENDS", "HOST_REFERENCE", "CAPABILITY",
    "Observer", "fake_quant_backend", "make_grid", "observe_min_max", "seed_keys", "plugin",
]

_F32 = np.float32
EPS = float(np.finfo(np.float32).eps)  # torch observers' default eps
HOST_REFERENCE = "numpy"  # the backend argument that means: no backend, the vectorized host reference
CAPABILITY = "fake_quant"  # the capability (hooks in optirs.plugin.hookspecs) the other backends need
# The reference and the built-in backends that implement the capability; any registered backend
# that implements it works as well.
BACKENDS = (HOST_REFERENCE, "cpu", "cuda", "opencl")
_TWO63 = _F32(2.0**63)


# ------------------------------------------------------------------ enums


class IntDtype(enum.Enum):
    """Integer formats. 8-bit ranges are torch's ``qint8``/``quint8`` defaults; 4-bit ones are
    torch's custom ranges ``quant_min``/``quant_max`` of -8..7 and 0..15 (on qint8/quint8)."""

    INT8 = "int8"
    UINT8 = "uint8"
    INT4 = "int4"
    UINT4 = "uint4"

    @property
    def bits(self) -> int:
        return 8 if self in (IntDtype.INT8, IntDtype.UINT8) else 4

    @property
    def signed(self) -> bool:
        return self in (IntDtype.INT8, IntDtype.INT4)

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1


class QuantScheme(enum.Enum):
    """Symmetric (zero point fixed: 0, or the range's midpoint for unsigned) or affine (min/max mapped)."""

    SYMMETRIC = "symmetric"
    AFFINE = "affine"


class RoundingMode(enum.Enum):
    """Round half to even (torch's ``nearbyint``), or stochastic: up with probability of the fraction."""

    NEAREST_EVEN = "nearest_even"
    STOCHASTIC = "stochastic"


class Fp8Format(enum.Enum):
    """OCP FP8 formats: E4M3 without infinities (``float8_e4m3fn``, max 448) and E5M2 (max 57344)."""

    E4M3 = "e4m3fn"
    E5M2 = "e5m2"

    @property
    def ml_dtype(self):
        import ml_dtypes

        return ml_dtypes.float8_e4m3fn if self is Fp8Format.E4M3 else ml_dtypes.float8_e5m2

    @property
    def max(self) -> float:
        """The largest finite value."""
        return 448.0 if self is Fp8Format.E4M3 else 57344.0

    def scale_for(self, amax: float, margin: int = 0) -> np.float32:
        """Per-tensor scale ``fp8_max / amax / 2**margin`` in float32 (1 where amax is 0 or not finite)."""
        if isinstance(margin, bool) or not isinstance(margin, numbers.Integral) or margin < 0:
            raise InvalidParameterError(f"margin={margin!r}, expected an integer >= 0")
        amax = _F32(amax)
        if not np.isfinite(amax) or amax <= 0:
            return _F32(1.0)
        return _F32(_F32(self.max) / amax) / _F32(2.0 ** int(margin))


class QuantTarget(enum.Enum):
    """What :class:`QatOptimizer` fake-quantizes: the weights after each step (observed), and/or
    the gradients before it (each step's own min/max, as dynamic quantization)."""

    WEIGHTS = "weights"
    GRADIENTS = "gradients"


def _enum(cls, value, name):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise InvalidParameterError(
            f"{name}={value!r}, expected one of {[m.value for m in cls]} or a {cls.__name__}"
        ) from None


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError(f"{name}={value!r}, expected an integer")
    return int(value)


# ------------------------------------------------------------------ quantization parameters


def quant_range(dtype: IntDtype = IntDtype.INT8, reduce_range: bool = False, quant_min: Optional[int] = None,
                quant_max: Optional[int] = None) -> Tuple[int, int, bool]:
    """``(quant_min, quant_max, customized)`` as torch's observers compute them.

    8-bit dtypes without an explicit range use torch's defaults (reduce_range: -64..63 and
    0..127). A custom range (4-bit dtypes always have one) must hold 0 and fit the dtype;
    ``reduce_range`` then halves both ends with floor division, as torch does.
    """
    dtype = _enum(IntDtype, dtype, "dtype")
    if not isinstance(reduce_range, bool):
        raise InvalidParameterError(f"reduce_range={reduce_range!r}, expected True or False")
    if (quant_min is None) != (quant_max is None):
        raise InvalidParameterError(
            f"quant_min={quant_min!r}, quant_max={quant_max!r}: expected both or neither")
    customized = quant_min is not None or dtype.bits == 4
    if quant_min is None:
        quant_min, quant_max = dtype.qmin, dtype.qmax
    qmin, qmax = _int("quant_min", quant_min), _int("quant_max", quant_max)
    if not qmin <= 0 <= qmax or qmin >= qmax:
        raise InvalidParameterError(
            f"quant_min={qmin}, quant_max={qmax}, expected quant_min <= 0 <= quant_max and quant_min < quant_max")
    if qmin < dtype.qmin or qmax > dtype.qmax:
        raise InvalidParameterError(
            f"quant_min={qmin}, quant_max={qmax} do not fit {dtype.value}, expected within "
            f"[{dtype.qmin}, {dtype.qmax}]")
    if not customized:
        if reduce_range:
            qmin, qmax = (-64, 63) if dtype.signed else (0, 127)
    elif reduce_range:
        qmin, qmax = qmin // 2, qmax // 2
    return qmin, qmax, customized


@dataclass(frozen=True, eq=False)
class QuantParams:
    """Scale and zero point of an integer grid, per tensor (``axis`` None: 0-d arrays) or per
    channel along ``axis`` (1-d arrays, one entry per channel).

    ``scale`` is stored as float32 (a Python float is rounded to float32, as torch does) and must
    be positive and finite; ``zero_point`` is int32 and must lie in [quant_min, quant_max].
    """

    scale: Any
    zero_point: Any
    quant_min: int = -128
    quant_max: int = 127
    axis: Optional[int] = None

    def __post_init__(self) -> None:
        qmin, qmax = _int("quant_min", self.quant_min), _int("quant_max", self.quant_max)
        if qmin > qmax:
            raise InvalidParameterError(f"quant_min={qmin} > quant_max={qmax}, expected quant_min <= quant_max")
        if not (-(2**31) <= qmin and qmax < 2**31):
            raise InvalidParameterError(f"quant_min={qmin}, quant_max={qmax}, expected int32 bounds")
        want_ndim = 0 if self.axis is None else 1
        if self.axis is not None:
            _int("axis", self.axis)
        try:
            with np.errstate(over="ignore"):
                scale = np.array(self.scale, dtype=np.float64).astype(np.float32)
            zp_raw = np.asarray(self.zero_point)
        except (TypeError, ValueError):
            raise InvalidParameterError(
                f"scale={self.scale!r}, zero_point={self.zero_point!r}, expected numbers or numeric arrays") from None
        if scale.ndim != want_ndim or zp_raw.ndim != want_ndim:
            what = "0-d (per tensor)" if want_ndim == 0 else "1-d (per channel)"
            raise ShapeMismatchError(
                f"scale of shape {scale.shape} and zero_point of shape {zp_raw.shape}, expected {what} arrays "
                f"for axis={self.axis!r}")
        if scale.shape != zp_raw.shape:
            raise ShapeMismatchError(f"scale of shape {scale.shape} but zero_point of shape {zp_raw.shape}, expected the same")
        if want_ndim and scale.size == 0:
            raise ShapeMismatchError("per-channel scale is empty, expected at least one channel")
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            raise InvalidParameterError(
                f"scale={scale[bad].ravel()[:4].tolist() if scale.ndim else float(scale)!r}, expected a positive finite float32")
        if zp_raw.dtype.kind not in "iu" and not (zp_raw.dtype.kind == "f" and np.all(zp_raw == np.round(zp_raw))):
            raise InvalidParameterError(f"zero_point of dtype {zp_raw.dtype}, expected integers")
        zp64 = zp_raw.astype(np.int64)
        out = (zp64 < qmin) | (zp64 > qmax)
        if out.any():
            raise InvalidParameterError(
                f"zero_point={zp64[out].ravel()[:4].tolist() if zp64.ndim else int(zp64)}, expected "
                f"quant_min={qmin} <= zero_point <= quant_max={qmax}")
        scale.setflags(write=False)
        zp = zp64.astype(np.int32)
        zp.setflags(write=False)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point", zp)
        object.__setattr__(self, "quant_min", qmin)
        object.__setattr__(self, "quant_max", qmax)

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    @classmethod
    def for_dtype(cls, scale, zero_point, dtype: IntDtype = IntDtype.INT8, *, reduce_range: bool = False,
                  axis: Optional[int] = None) -> "QuantParams":
        """Parameters on the grid of ``dtype`` (its range as :func:`quant_range` gives it)."""
        qmin, qmax, _ = quant_range(dtype, reduce_range)
        return cls(scale, zero_point, qmin, qmax, axis)

    @classmethod
    def from_min_max(cls, min_val, max_val, dtype: IntDtype = IntDtype.INT8,
                     scheme: QuantScheme = QuantScheme.AFFINE, *, reduce_range: bool = False,
                     quant_min: Optional[int] = None, quant_max: Optional[int] = None, eps: float = EPS,
                     axis: Optional[int] = None) -> "QuantParams":
        """Scale and zero point from observed minima and maxima, as torch's observers compute them.

        .. code-block:: text

            lo = min(min_val, 0);  hi = max(max_val, 0)                      (float32)
            symmetric: scale = max(-lo, hi) / ((quant_max - quant_min) / 2)
                       zero_point = 0 (signed), 128 (uint8), (quant_min + quant_max) // 2 (custom range)
            affine:    scale = (hi - lo) / (quant_max - quant_min)
                       zero_point = clamp(quant_min - round_half_even(lo / scale), quant_min, quant_max)
            scale = max(scale, eps)
        """
        dtype = _enum(IntDtype, dtype, "dtype")
        scheme = _enum(QuantScheme, scheme, "scheme")
        qmin, qmax, customized = quant_range(dtype, reduce_range, quant_min, quant_max)
        if scheme is QuantScheme.SYMMETRIC and reduce_range and not dtype.signed:
            # torch refuses it too; with uint8's fixed zero point 128 the grid would not hold it.
            raise InvalidParameterError(
                f"reduce_range=True with the symmetric scheme on {dtype.value}, expected a signed dtype or reduce_range=False")
        eps32 = _F32(eps)
        if not (np.isfinite(eps32) and eps32 > 0):
            raise InvalidParameterError(f"eps={eps!r}, expected a positive finite float32")
        want_ndim = 0 if axis is None else 1
        lo = np.asarray(min_val, dtype=np.float32)
        hi = np.asarray(max_val, dtype=np.float32)
        if lo.ndim != want_ndim or hi.shape != lo.shape:
            raise ShapeMismatchError(
                f"min_val of shape {lo.shape} and max_val of shape {hi.shape}, expected "
                f"{'0-d' if want_ndim == 0 else 'equal 1-d'} arrays for axis={axis!r}")
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise InvalidParameterError(
                f"min_val={lo.tolist()}, max_val={hi.tolist()}, expected finite values (an unobserved "
                "or diverged tensor has no quantization grid)")
        if np.any(lo > hi):
            raise InvalidParameterError(f"min_val={lo.tolist()} > max_val={hi.tolist()}, expected min_val <= max_val")
        lo = np.minimum(lo, _F32(0))
        hi = np.maximum(hi, _F32(0))
        if scheme is QuantScheme.SYMMETRIC:
            hi = np.maximum(-lo, hi)
            scale = np.maximum(hi / _F32((qmax - qmin) / 2), eps32)
            if dtype.signed:
                zp = np.zeros(lo.shape, np.int32)
            else:
                zp = np.full(lo.shape, (qmin + qmax) // 2 if customized else 128, np.int32)
        else:
            scale = np.maximum((hi - lo) / _F32(qmax - qmin), eps32)
            zp = (qmin - np.rint(lo / scale).astype(np.int32)).astype(np.int64)
            zp = np.clip(zp, qmin, qmax).astype(np.int32)
        return cls(scale, zp, qmin, qmax, axis)


def observe_min_max(x: np.ndarray, axis: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(min, max) of x overall (0-d) or per channel along ``axis``."""
    if axis is None:
        return np.asarray(x.min(), np.float32), np.asarray(x.max(), np.float32)
    others = tuple(d for d in range(x.ndim) if d != axis)
    return x.min(axis=others).astype(np.float32), x.max(axis=others).astype(np.float32)


def _normalize_axis(axis: int, ndim: int) -> int:
    axis = _int("axis", axis)
    if not -ndim <= axis < ndim:
        raise InvalidParameterError(f"axis={axis}, expected -{ndim} <= axis < {ndim} for a {ndim}-d array")
    return axis % ndim


def per_tensor_params(x, dtype: IntDtype = IntDtype.INT8, scheme: QuantScheme = QuantScheme.AFFINE, **kwargs) -> QuantParams:
    """Per-tensor parameters from one observation of ``x`` (``MinMaxObserver`` after one call).

    Keyword arguments are those of :meth:`QuantParams.from_min_max` (reduce_range, quant_min,
    quant_max, eps).
    """
    x = _as_f32(x, "x")
    if x.size == 0:
        raise ShapeMismatchError("x is empty, expected at least one element to observe")
    lo, hi = observe_min_max(x, None)
    return QuantParams.from_min_max(lo, hi, dtype, scheme, **kwargs)


def per_channel_params(x, axis: int = 0, dtype: IntDtype = IntDtype.INT8, scheme: QuantScheme = QuantScheme.AFFINE,
                       **kwargs) -> QuantParams:
    """Per-channel parameters along ``axis`` from one observation of ``x`` (``PerChannelMinMaxObserver``).

    Keyword arguments are those of :meth:`QuantParams.from_min_max`.
    """
    x = _as_f32(x, "x")
    axis = _normalize_axis(axis, x.ndim)
    if x.size == 0:
        raise ShapeMismatchError(f"x of shape {x.shape} is empty, expected at least one element per channel")
    lo, hi = observe_min_max(x, axis)
    return QuantParams.from_min_max(lo, hi, dtype, scheme, axis=axis, **kwargs)


# ------------------------------------------------------------------ input checks, the grid record, backends


def _as_f32(x, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if isinstance(x, (list, tuple, float, int)):
            x = np.asarray(x, dtype=np.float32)
        else:
            raise InvalidParameterError(f"{name} of type {type(x).__name__}, expected a float32 numpy array")
    if x.dtype != np.float32:
        raise InvalidParameterError(f"{name} has dtype {x.dtype}, expected float32")
    return x


def seed_keys(seed: Any) -> StochasticKeys:
    """The stochastic-rounding hash keys of a seed (an integer in [0, 2**64))."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**64:
        raise InvalidParameterError(f"seed={seed!r}, expected an integer in [0, 2**64) for stochastic rounding")
    seed = int(seed)
    lo = _lowbias32(np.uint64(seed & 0xFFFFFFFF) ^ np.uint64(0x9E3779B9))
    hi = _lowbias32(np.uint64(seed >> 32) ^ np.uint64(0x85EBCA6B))
    return StochasticKeys(np.uint64(lo), np.uint64(hi))


def _lowbias32(h):
    m = np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & m
    return h ^ (h >> np.uint64(16))


def _uniform(n: int, keys: StochasticKeys) -> np.ndarray:
    """u in [0, 1) per flat index, the same bits as the kernels' hash."""
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _lowbias32((i & np.uint64(0xFFFFFFFF)) ^ keys.key_lo)
        h = _lowbias32(h ^ (i >> np.uint64(32)) ^ keys.key_hi)
    return (h >> np.uint64(8)).astype(np.float32) * _F32(2.0**-24)


def _check_array(x, name: str) -> Any:
    """x as it goes to the backend: Python numbers and lists become numpy; anything else must be a
    float32 array (numpy, or a device array the backend checks itself)."""
    if isinstance(x, (list, tuple, float, int)):
        return np.asarray(x, dtype=np.float32)
    dtype = getattr(x, "dtype", None)
    try:
        dtype = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or not hasattr(x, "shape"):
        raise InvalidParameterError(
            f"{name} of type {type(x).__name__}, expected a float32 numpy array or the backend's device array")
    if dtype != np.float32:
        raise InvalidParameterError(f"{name} has dtype {dtype}, expected float32")
    return x


def make_grid(shape: Sequence[int], params: QuantParams, per_channel: bool) -> FakeQuantGrid:
    """The flat-layout record the fake-quant hooks take, for an input of ``shape``."""
    shape = tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64))
    scale = np.atleast_1d(params.scale).astype(np.float32)
    with np.errstate(over="ignore", divide="ignore"):
        inv = (_F32(1.0) / scale).astype(np.float32)  # inf for a subnormal scale, as in torch
    zp = np.atleast_1d(params.zero_point).astype(np.float32)
    if per_channel:
        axis = _normalize_axis(params.axis, len(shape))
        if shape[axis] != scale.size:
            raise ShapeMismatchError(
                f"x has {shape[axis]} channels along axis {axis} (shape {shape}), but the parameters "
                f"have {scale.size}, expected one scale per channel")
        inner, channels = int(np.prod(shape[axis + 1:], dtype=np.int64)), int(scale.size)
    else:
        inner, channels = max(1, size), 1
    return FakeQuantGrid(shape, size, inv, scale, zp, _F32(params.quant_min), _F32(params.quant_max), inner,
                         channels, bool(per_channel))


def _numpy_forward(x: np.ndarray, grid: FakeQuantGrid, rounding: Optional[StochasticKeys]):
    """The host reference: torch's float32 operations, vectorized."""
    if grid.size == 0:
        return x.copy(), np.zeros(grid.shape, bool)
    x3 = np.ascontiguousarray(x).reshape(-1, grid.channels, grid.inner)
    inv, scale, zp = (a.reshape(1, grid.channels, 1) for a in (grid.inv_scale, grid.scale, grid.zero_point))
    with np.errstate(over="ignore", invalid="ignore"):
        v = x3 * inv
        if rounding is not None:
            r = np.floor(v)
            frac = v - r
            r = r + (_uniform(grid.size, rounding).reshape(v.shape) < frac).astype(np.float32)
        else:
            r = np.rint(v)
        q = zp + r
        mask = (q >= grid.quant_min) & (q <= grid.quant_max)
        if grid.int64_cast:
            q = np.where(q < _TWO63, q, grid.quant_min)  # torch's int64 cast: NaN/inf/huge -> quant_min
        q = np.fmin(np.fmax(q, grid.quant_min), grid.quant_max)
        out = (q - zp) * scale
    return out.astype(np.float32, copy=False).reshape(grid.shape), mask.reshape(grid.shape)


def _numpy_backward(x: np.ndarray, grad: np.ndarray, grid: FakeQuantGrid) -> np.ndarray:
    if grid.size == 0:
        return grad.copy()
    _, mask = _numpy_forward(x, grid, None)
    return grad * mask.astype(np.float32)


def fake_quant_backend(backend: Any) -> Optional[Any]:
    """None for the host reference (``"numpy"``), else the bound :class:`optirs.plugin.registry.Backend`."""
    from optirs.core.errors import BackendUnavailableError
    from optirs.plugin.registry import Backend, get_backend

    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise InvalidParameterError(
            f"backend of type {type(backend).__name__}, expected a backend name or an optirs Backend")
    if backend == HOST_REFERENCE:
        return None
    try:
        return get_backend(backend)
    except BackendUnavailableError as exc:
        raise UnsupportedOperationError(f"backend={backend!r} cannot run fake-quant: {exc}") from exc


def _host_only(x, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise UnsupportedOperationError(
            f"{name} of type {type(x).__module__}.{type(x).__qualname__} is a device array but backend='numpy' "
            "(the host reference), expected a numpy array or the backend that holds it")
    return x


def _forward(x, params: QuantParams, per_channel: bool, rounding, seed, backend):
    bound = fake_quant_backend(backend)
    x = _check_array(x, "x")
    keys = _rounding_keys(rounding, seed)
    grid = make_grid(x.shape, params, per_channel)
    if bound is None:
        return _numpy_forward(_host_only(x, "x"), grid, keys)
    return bound.hook(CAPABILITY, "optirs_fake_quant_forward")(bound.ctx, x, grid, keys)


# ------------------------------------------------------------------ public fake-quant functions


def _rounding_keys(rounding, seed) -> Optional[StochasticKeys]:
    rounding = _enum(RoundingMode, rounding, "rounding")
    if rounding is RoundingMode.STOCHASTIC:
        if seed is None:
            raise InvalidParameterError("seed=None with stochastic rounding, expected an integer seed (results are reproducible per seed)")
        return seed_keys(seed)
    return None


def _check_params(params, per_channel: bool, fn: str) -> QuantParams:
    if not isinstance(params, QuantParams):
        raise InvalidParameterError(f"params of type {type(params).__name__}, expected QuantParams")
    if params.per_channel != per_channel:
        raise InvalidParameterError(
            f"{fn} got {'per-channel' if params.per_channel else 'per-tensor'} QuantParams (axis={params.axis}), "
            f"expected {'per-channel (axis set)' if per_channel else 'per-tensor (axis=None)'}; use "
            f"{'fake_quant_int_per_channel' if params.per_channel else 'fake_quant_int'}")
    return params


def fake_quant_int(x, params: QuantParams, *, rounding: RoundingMode = RoundingMode.NEAREST_EVEN,
                   seed: Optional[int] = None, backend: Any = HOST_REFERENCE, return_mask: bool = False):
    """Per-tensor integer fake-quant, as ``torch.fake_quantize_per_tensor_affine`` (bit for bit).

    :param x: float32 numpy array (any shape), or the backend's own device array (a numba /
        ``__cuda_array_interface__`` array for ``"cuda"``, a ``pyopencl.array.Array`` for
        ``"opencl"``): then the result (and mask) are new device arrays on the same device, and
        nothing crosses to the host.
    :param params: per-tensor :class:`QuantParams`.
    :param rounding: half-to-even (torch's), or stochastic (needs ``seed``; same bits on every backend).
    :param backend: ``"numpy"`` (the host reference, no backend), the name of a registered backend
        with the ``fake_quant`` capability (``"cpu"``, ``"cuda"``, ``"opencl"``, ...), or a bound
        :class:`optirs.plugin.registry.Backend` (``optirs.get_backend(name)``).
    :param return_mask: also return the boolean straight-through mask.
    :return: a new float32 array of x's shape (and the mask: bool, uint8 for an OpenCL array).
    :raises UnsupportedOperationError: for a backend that cannot open or lacks ``fake_quant``.
    """
    params = _check_params(params, False, "fake_quant_int")
    out, mask = _forward(x, params, False, rounding, seed, backend)
    return (out, mask) if return_mask else out


def fake_quant_int_per_channel(x, params: QuantParams, *, rounding: RoundingMode = RoundingMode.NEAREST_EVEN,
                               seed: Optional[int] = None, backend: Any = HOST_REFERENCE, return_mask: bool = False):
    """Per-channel integer fake-quant along ``params.axis``, as ``torch.fake_quantize_per_channel_affine``.

    Arguments as :func:`fake_quant_int`; ``params`` is per-channel with one scale per slice of
    ``x`` along ``params.axis``.
    """
    params = _check_params(params, True, "fake_quant_int_per_channel")
    out, mask = _forward(x, params, True, rounding, seed, backend)
    return (out, mask) if return_mask else out


def fake_quant_backward(grad, x, params: QuantParams, *, backend: Any = HOST_REFERENCE):
    """The straight-through estimator: ``grad`` where ``x`` quantizes inside [quant_min, quant_max], 0 elsewhere.

    Equal to the gradient torch's autograd gives for ``fake_quantize_per_tensor_affine`` /
    ``_per_channel_affine`` (``grad * mask`` as a float multiply, so -0 and NaN propagate as in torch).
    Per-tensor or per-channel follows ``params.axis``; ``backend`` as for :func:`fake_quant_int`.
    """
    bound = fake_quant_backend(backend)
    x = _check_array(x, "x")
    grad = _check_array(grad, "grad")
    if isinstance(grad, np.ndarray) != isinstance(x, np.ndarray):  # which device, the backend checks
        raise InvalidParameterError(
            f"grad is a {type(grad).__qualname__} but x a {type(x).__qualname__}, expected the same kind of array "
            "(both numpy, or both the backend's device arrays)")
    if tuple(grad.shape) != tuple(x.shape):
        raise ShapeMismatchError(f"grad has shape {tuple(grad.shape)}, expected {tuple(x.shape)} like x")
    if not isinstance(params, QuantParams):
        raise InvalidParameterError(f"params of type {type(params).__name__}, expected QuantParams")
    grid = make_grid(x.shape, params, params.per_channel)
    if bound is None:
        return _numpy_backward(_host_only(x, "x"), grad, grid)
    return bound.hook(CAPABILITY, "optirs_fake_quant_backward")(bound.ctx, x, grad, grid)


def fake_quant_fp8(x, fmt: Fp8Format = Fp8Format.E4M3, *, scale: Optional[float] = None, saturate: bool = False,
                   margin: int = 0, backend: Any = HOST_REFERENCE) -> np.ndarray:
    """FP8 fake-quant: ``cast_fp8(x * scale) / scale`` in float32, rounding to nearest even.

    :param fmt: E4M3 (``float8_e4m3fn``) or E5M2.
    :param scale: the per-tensor scale; None computes it from the tensor's absolute maximum over
        its finite elements, ``fmt.max / amax / 2**margin`` (:meth:`Fp8Format.scale_for`); pass 1.0
        for the plain cast.
    :param saturate: False casts as ml_dtypes does (E4M3 overflows to NaN, E5M2 to inf); True
        clamps to the largest finite value first (infinities included; NaN stays NaN).
    """
    fmt = _enum(Fp8Format, fmt, "fmt")
    if backend != HOST_REFERENCE:  # a name or a bound Backend: FP8 has no backend hook
        raise UnsupportedOperationError(
            f"fake_quant_fp8 on backend={backend!r}: FP8 conversion runs through ml_dtypes on the host, "
            "expected backend='numpy'")
    if not isinstance(saturate, bool):
        raise InvalidParameterError(f"saturate={saturate!r}, expected True or False")
    x = _as_f32(x, "x")
    if scale is None:
        finite = np.abs(x[np.isfinite(x)])
        s = fmt.scale_for(finite.max() if finite.size else 0.0, margin)
    else:
        s = _F32(scale)
        if isinstance(scale, bool) or not (np.isfinite(s) and s > 0):
            raise InvalidParameterError(f"scale={scale!r}, expected a positive finite float32")
        fmt.scale_for(1.0, margin)  # validates margin; an explicit scale ignores it
    with np.errstate(over="ignore", invalid="ignore"):
        v = x * s
        if saturate:
            v = np.clip(v, _F32(-fmt.max), _F32(fmt.max))
        return v.astype(fmt.ml_dtype).astype(np.float32) / s


# ------------------------------------------------------------------ observers


class Observer:
    """Running or moving-average min/max of one tensor, per tensor or per channel (float32, as torch's
    ``MinMaxObserver`` / ``MovingAverageMinMaxObserver`` and their per-channel forms)."""

    def __init__(self, axis: Optional[int], moving: bool, c: float):
        self.axis, self.moving, self.c = axis, moving, _F32(c)
        self.min_val: Optional[np.ndarray] = None
        self.max_val: Optional[np.ndarray] = None

    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        lo, hi = observe_min_max(x, self.axis)
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise InvalidParameterError(
                f"a tensor of shape {x.shape} holds non-finite values (min={lo.tolist()}, max={hi.tolist()}), "
                "expected finite weights to observe")
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        elif self.moving:
            self.min_val = (self.min_val + self.c * (lo - self.min_val)).astype(np.float32)
            self.max_val = (self.max_val + self.c * (hi - self.max_val)).astype(np.float32)
        else:
            self.min_val, self.max_val = np.minimum(self.min_val, lo), np.maximum(self.max_val, hi)


# ------------------------------------------------------------------ plugin


class QuantizationPlugin:
    """The analysis plugin that ``optirs info`` lists."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        return {"summary": "QAT: int8/uint8/int4/uint4 and FP8 fake-quant (bit-exact with torch / ml_dtypes), "
                           "observers and QatOptimizer; host reference or any backend with the fake_quant hooks"}


plugin = QuantizationPlugin()

