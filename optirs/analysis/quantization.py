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

Backends: ``"numpy"`` (vectorized, the reference path, default), ``"cpu"`` (numba parallel
loops), ``"cuda"`` (numba.cuda, or its simulator) and ``"opencl"`` (pyopencl) for integer
fake-quant and its gradient; see :mod:`optirs.analysis.quantization_kernels`. FP8 runs on
numpy only (the conversion is ml_dtypes').

Nothing heavy is imported with this module: numba, pyopencl and ml_dtypes load on first use.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.plugin.hookspecs import hookimpl

__all__ = [
    "fake_quant_int", "fake_quant_int_per_channel", "fake_quant_fp8", "fake_quant_backward",
    "per_channel_params", "per_tensor_params", "QuantParams", "QuantScheme", "QuantTarget", "IntDtype",
    "Fp8Format", "RoundingMode", "QatConfig", "QatOptimizer", "BACKENDS", "plugin",
]

_F32 = np.float32
EPS = float(np.finfo(np.float32).eps)  # torch observers' default eps
BACKENDS = ("numpy", "cpu", "cuda", "opencl")
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


def _observe(x: np.ndarray, axis: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
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
    lo, hi = _observe(x, None)
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
    lo, hi = _observe(x, axis)
    return QuantParams.from_min_max(lo, hi, dtype, scheme, axis=axis, **kwargs)


# ------------------------------------------------------------------ input checks and backends


def _as_f32(x, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if isinstance(x, (list, tuple, float, int)):
            x = np.asarray(x, dtype=np.float32)
        else:
            raise InvalidParameterError(f"{name} of type {type(x).__name__}, expected a float32 numpy array")
    if x.dtype != np.float32:
        raise InvalidParameterError(f"{name} has dtype {x.dtype}, expected float32")
    return x


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UnsupportedOperationError(f"backend={backend!r}, expected one of {list(BACKENDS)}")
    return backend


def _seed_keys(seed: Any) -> Tuple[np.uint64, np.uint64]:
    """Two 32-bit hash keys from a seed (an integer in [0, 2**64))."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**64:
        raise InvalidParameterError(f"seed={seed!r}, expected an integer in [0, 2**64) for stochastic rounding")
    seed = int(seed)
    lo = _lowbias32(np.uint64(seed & 0xFFFFFFFF) ^ np.uint64(0x9E3779B9))
    hi = _lowbias32(np.uint64(seed >> 32) ^ np.uint64(0x85EBCA6B))
    return np.uint64(lo), np.uint64(hi)


def _lowbias32(h):
    m = np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & m
    return h ^ (h >> np.uint64(16))


def _uniform(n: int, key_lo: np.uint64, key_hi: np.uint64) -> np.ndarray:
    """u in [0, 1) per flat index, the same bits as the kernels' hash."""
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _lowbias32((i & np.uint64(0xFFFFFFFF)) ^ key_lo)
        h = _lowbias32(h ^ (i >> np.uint64(32)) ^ key_hi)
    return (h >> np.uint64(8)).astype(np.float32) * _F32(2.0**-24)


def _kind(x) -> Optional[str]:
    """"numpy", "cuda" (numba device array or __cuda_array_interface__), "opencl" (pyopencl Array) or None."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__cuda_array_interface__") or (hasattr(x, "copy_to_host") and hasattr(x, "is_c_contiguous")):
        return "cuda"
    if type(x).__module__.startswith("pyopencl"):
        return "opencl"
    return None


def _check_input(x, name: str, backend: str):
    """x as a float32 numpy array, or the backend's own device array (checked, used in place)."""
    kind = _kind(x)
    if kind is None or kind == "numpy":
        return _as_f32(x, name)
    if kind != backend:
        raise UnsupportedOperationError(
            f"{name} is a {kind} device array but backend={backend!r}, expected backend={kind!r} or a numpy array")
    if np.dtype(x.dtype) != np.float32:
        raise InvalidParameterError(f"{name} has dtype {np.dtype(x.dtype)}, expected float32")
    contiguous = x.flags.c_contiguous if kind == "opencl" else (
        x.is_c_contiguous() if hasattr(x, "is_c_contiguous") else True)
    if not contiguous:
        raise ShapeMismatchError(f"{name} is not C-contiguous, expected a contiguous device array")
    return x


class _Job:
    """One fake-quant launch's arguments in the flat (outer, channel, inner) layout the kernels use."""

    def __init__(self, x, params: QuantParams, per_channel: bool):
        self.x = x
        self.shape = tuple(x.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        scale = np.atleast_1d(params.scale).astype(np.float32)
        self.scale = scale
        with np.errstate(over="ignore", divide="ignore"):
            self.inv = (_F32(1.0) / scale).astype(np.float32)  # inf for a subnormal scale, as in torch
        self.zp = np.atleast_1d(params.zero_point).astype(np.float32)
        self.qmin, self.qmax = _F32(params.quant_min), _F32(params.quant_max)
        if per_channel:
            ndim = len(self.shape)
            axis = _normalize_axis(params.axis, ndim)
            if self.shape[axis] != scale.size:
                raise ShapeMismatchError(
                    f"x has {self.shape[axis]} channels along axis {axis} (shape {self.shape}), but the parameters "
                    f"have {scale.size}, expected one scale per channel")
            self.inner = int(np.prod(self.shape[axis + 1:], dtype=np.int64))
            self.nch = scale.size
        else:
            self.inner, self.nch = max(1, self.size), 1
        self.int64_cast = per_channel

    def channel_view(self, a: np.ndarray) -> np.ndarray:
        """Broadcast per-channel vector ``a`` against the flat array's (outer, nch, inner) view."""
        return a.reshape(1, self.nch, 1)

    def flat3(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(-1, self.nch, self.inner)

    def scalars(self):
        return self.inner, self.nch, self.qmin, self.qmax, self.int64_cast


def _numpy_forward(job: _Job, stochastic: bool, keys) -> Tuple[np.ndarray, np.ndarray]:
    x = job.flat3(np.ascontiguousarray(job.x))
    inv, scale, zp = job.channel_view(job.inv), job.channel_view(job.scale), job.channel_view(job.zp)
    with np.errstate(over="ignore", invalid="ignore"):
        v = x * inv
        if stochastic:
            r = np.floor(v)
            frac = v - r
            u = _uniform(job.size, *keys).reshape(v.shape)
            r = r + (u < frac).astype(np.float32)
        else:
            r = np.rint(v)
        q = zp + r
        mask = (q >= job.qmin) & (q <= job.qmax)
        if job.int64_cast:
            q = np.where(q < _TWO63, q, job.qmin)  # torch's int64 cast: NaN/inf/huge -> quant_min
        q = np.fmin(np.fmax(q, job.qmin), job.qmax)
        out = (q - zp) * scale
    return out.astype(np.float32, copy=False).reshape(job.shape), mask.reshape(job.shape)


def _numpy_backward(job: _Job, g: np.ndarray) -> np.ndarray:
    _, mask = _numpy_forward(job, False, None)
    return g * mask.astype(np.float32)


_OPENCL: Dict[int, Any] = {}


def _opencl_queue():
    """A queue on the optirs OpenCL backend's device when it opens, else on the first OpenCL device."""
    try:
        import pyopencl as cl
    except ImportError as exc:
        raise UnsupportedOperationError(f"backend='opencl' needs pyopencl, which is not importable: {exc}") from None
    if "queue" not in _OPENCL:
        queue = None
        try:
            from optirs.plugin.registry import REGISTRY

            queue = REGISTRY.get_backend("opencl").ctx.queue
        except Exception:
            queue = None
        if queue is None:
            devices = [d for p in cl.get_platforms() for d in p.get_devices()]
            if not devices:
                raise UnsupportedOperationError("backend='opencl': no OpenCL device found")
            queue = cl.CommandQueue(cl.Context([devices[0]]))
        _OPENCL["queue"] = queue
    return _OPENCL["queue"]


def _opencl_kernels(context):
    """(forward, backward) kernels built once per OpenCL context."""
    import pyopencl as cl

    key = context.int_ptr
    if key not in _OPENCL:
        from optirs.analysis.quantization_kernels import OPENCL_SOURCE

        prg = cl.Program(context, OPENCL_SOURCE).build()
        _OPENCL[key] = (prg.fake_quant, prg.fake_quant_backward)
    return _OPENCL[key]


def _cuda_module():
    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover
        raise UnsupportedOperationError(f"backend='cuda' needs numba.cuda: {exc}") from None
    if not cuda.is_available():
        raise UnsupportedOperationError(
            "backend='cuda' has no CUDA device here (set NUMBA_ENABLE_CUDASIM=1 for numba's simulator)")
    return cuda


def _cuda_flat(cuda, a, size):
    """A flat numba device view of a device array (numba's own, or anything with the CUDA array interface)."""
    if not hasattr(a, "copy_to_host"):
        a = cuda.as_cuda_array(a)
    return a.reshape(size)


def _opencl_flat(a):
    """(queue, buffer) of a contiguous pyopencl Array; a view at an offset is copied first."""
    if a.offset:
        a = a.copy()
    return a.queue, a.base_data


def _run_forward(job: _Job, backend: str, stochastic: bool, keys):
    kind = _kind(job.x)
    if job.size == 0:
        if kind == "numpy":
            return job.x.copy(), np.zeros(job.shape, bool)
        if kind == "opencl":
            import pyopencl.array as cla

            return job.x.copy(), cla.zeros(job.x.queue, job.shape, np.uint8)
        return job.x, job.x  # an empty device array: nothing to compute, nothing to share
    if backend == "numpy":
        return _numpy_forward(job, stochastic, keys)
    key_lo, key_hi = keys if stochastic else (np.uint64(0), np.uint64(0))
    n = job.size
    args = (job.inv, job.scale, job.zp)
    if backend == "cpu":
        from optirs.analysis import quantization_kernels as qk

        out, mask = np.empty(n, np.float32), np.empty(n, bool)
        qk.fake_quant_cpu(np.ascontiguousarray(job.x).reshape(-1), out, mask, *args, *job.scalars(),
                          stochastic, key_lo, key_hi)
        return out.reshape(job.shape), mask.reshape(job.shape)
    if backend == "cuda":
        cuda = _cuda_module()
        from optirs.analysis import quantization_kernels as qk

        forward, _ = qk.cuda_kernels()
        on_device = kind == "cuda"
        dx = _cuda_flat(cuda, job.x, n) if on_device else cuda.to_device(np.ascontiguousarray(job.x).reshape(-1))
        d_out, d_mask = cuda.device_array(n, np.float32), cuda.device_array(n, np.bool_)
        d_args = [cuda.to_device(a) for a in args]
        blocks = (n + qk.BLOCK - 1) // qk.BLOCK
        forward[blocks, qk.BLOCK](dx, d_out, d_mask, *d_args, *job.scalars(), stochastic, key_lo, key_hi)
        if on_device:
            return d_out.reshape(job.shape), d_mask.reshape(job.shape)
        return d_out.copy_to_host().reshape(job.shape), d_mask.copy_to_host().reshape(job.shape)
    import pyopencl as cl
    import pyopencl.array as cla

    on_device = kind == "opencl"
    if on_device:
        queue, bx = _opencl_flat(job.x)
    else:
        queue = _opencl_queue()
        bx = cla.to_device(queue, np.ascontiguousarray(job.x).reshape(-1)).base_data
    forward, _ = _opencl_kernels(queue.context)
    out, mask = cla.empty(queue, job.shape, np.float32), cla.empty(queue, job.shape, np.uint8)
    mf = cl.mem_flags
    bufs = [cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a) for a in args]
    forward(queue, (n,), None, bx, out.base_data, mask.base_data, *bufs, np.int64(job.inner), np.int64(job.nch),
            job.qmin, job.qmax, np.int32(job.int64_cast), np.int32(stochastic), np.uint64(key_lo),
            np.uint64(key_hi), np.int64(n))
    if on_device:
        return out, mask
    return out.get(), mask.get().astype(bool)


def _run_backward(job: _Job, g, backend: str):
    kind = _kind(job.x)
    if job.size == 0:
        return g.copy() if kind != "cuda" else g
    if backend == "numpy":
        return _numpy_backward(job, g)
    n = job.size
    args = (job.inv, job.scale, job.zp)
    if backend == "cpu":
        from optirs.analysis import quantization_kernels as qk

        gin = np.empty(n, np.float32)
        qk.fake_quant_backward_cpu(np.ascontiguousarray(job.x).reshape(-1), np.ascontiguousarray(g).reshape(-1),
                                   gin, *args, *job.scalars())
        return gin.reshape(job.shape)
    if backend == "cuda":
        cuda = _cuda_module()
        from optirs.analysis import quantization_kernels as qk

        _, backward = qk.cuda_kernels()
        on_device = kind == "cuda"
        if on_device:
            dx, dg = _cuda_flat(cuda, job.x, n), _cuda_flat(cuda, g, n)
        else:
            dx, dg = (cuda.to_device(np.ascontiguousarray(a).reshape(-1)) for a in (job.x, g))
        d_gin = cuda.device_array(n, np.float32)
        d_args = [cuda.to_device(a) for a in args]
        blocks = (n + qk.BLOCK - 1) // qk.BLOCK
        backward[blocks, qk.BLOCK](dx, dg, d_gin, *d_args, *job.scalars())
        return d_gin.reshape(job.shape) if on_device else d_gin.copy_to_host().reshape(job.shape)
    import pyopencl as cl
    import pyopencl.array as cla

    on_device = kind == "opencl"
    if on_device:
        queue, bx = _opencl_flat(job.x)
        _, bg = _opencl_flat(g)
    else:
        queue = _opencl_queue()
        bx, bg = (cla.to_device(queue, np.ascontiguousarray(a).reshape(-1)).base_data for a in (job.x, g))
    _, backward = _opencl_kernels(queue.context)
    gin = cla.empty(queue, job.shape, np.float32)
    mf = cl.mem_flags
    bufs = [cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a) for a in args]
    backward(queue, (n,), None, bx, bg, gin.base_data, *bufs, np.int64(job.inner), np.int64(job.nch), job.qmin,
             job.qmax, np.int32(job.int64_cast), np.int64(n))
    return gin if on_device else gin.get()


# ------------------------------------------------------------------ public fake-quant functions


def _rounding_args(rounding, seed):
    rounding = _enum(RoundingMode, rounding, "rounding")
    stochastic = rounding is RoundingMode.STOCHASTIC
    if stochastic:
        if seed is None:
            raise InvalidParameterError("seed=None with stochastic rounding, expected an integer seed (results are reproducible per seed)")
        return True, _seed_keys(seed)
    return False, None


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
                   seed: Optional[int] = None, backend: str = "numpy", return_mask: bool = False):
    """Per-tensor integer fake-quant, as ``torch.fake_quantize_per_tensor_affine`` (bit for bit).

    :param x: float32 numpy array (any shape), or the backend's own device array (a numba /
        ``__cuda_array_interface__`` array for ``"cuda"``, a ``pyopencl.array.Array`` for
        ``"opencl"``): then the result (and mask) are new device arrays on the same device, and
        nothing crosses to the host.
    :param params: per-tensor :class:`QuantParams`.
    :param rounding: half-to-even (torch's), or stochastic (needs ``seed``; same bits on every backend).
    :param backend: ``"numpy"``, ``"cpu"``, ``"cuda"`` or ``"opencl"``.
    :param return_mask: also return the boolean straight-through mask.
    :return: a new float32 array of x's shape (and the mask: bool, uint8 for an OpenCL array).
    """
    backend = _check_backend(backend)
    x = _check_input(x, "x", backend)
    params = _check_params(params, False, "fake_quant_int")
    stochastic, keys = _rounding_args(rounding, seed)
    out, mask = _run_forward(_Job(x, params, False), backend, stochastic, keys)
    return (out, mask) if return_mask else out


def fake_quant_int_per_channel(x, params: QuantParams, *, rounding: RoundingMode = RoundingMode.NEAREST_EVEN,
                               seed: Optional[int] = None, backend: str = "numpy", return_mask: bool = False):
    """Per-channel integer fake-quant along ``params.axis``, as ``torch.fake_quantize_per_channel_affine``.

    Arguments as :func:`fake_quant_int`; ``params`` is per-channel with one scale per slice of
    ``x`` along ``params.axis``.
    """
    backend = _check_backend(backend)
    x = _check_input(x, "x", backend)
    params = _check_params(params, True, "fake_quant_int_per_channel")
    stochastic, keys = _rounding_args(rounding, seed)
    out, mask = _run_forward(_Job(x, params, True), backend, stochastic, keys)
    return (out, mask) if return_mask else out


def fake_quant_backward(grad, x, params: QuantParams, *, backend: str = "numpy"):
    """The straight-through estimator: ``grad`` where ``x`` quantizes inside [quant_min, quant_max], 0 elsewhere.

    Equal to the gradient torch's autograd gives for ``fake_quantize_per_tensor_affine`` /
    ``_per_channel_affine`` (``grad * mask`` as a float multiply, so -0 and NaN propagate as in torch).
    Per-tensor or per-channel follows ``params.axis``.
    """
    backend = _check_backend(backend)
    x = _check_input(x, "x", backend)
    grad = _check_input(grad, "grad", backend)
    if _kind(grad) != _kind(x):
        raise InvalidParameterError(f"grad is a {_kind(grad)} array but x a {_kind(x)} array, expected the same kind")
    if tuple(grad.shape) != tuple(x.shape):
        raise ShapeMismatchError(f"grad has shape {grad.shape}, expected {x.shape} like x")
    if not isinstance(params, QuantParams):
        raise InvalidParameterError(f"params of type {type(params).__name__}, expected QuantParams")
    return _run_backward(_Job(x, params, params.per_channel), grad, backend)


def fake_quant_fp8(x, fmt: Fp8Format = Fp8Format.E4M3, *, scale: Optional[float] = None, saturate: bool = False,
                   margin: int = 0, backend: str = "numpy") -> np.ndarray:
    """FP8 fake-quant: ``cast_fp8(x * scale) / scale`` in float32, rounding to nearest even.

    :param fmt: E4M3 (``float8_e4m3fn``) or E5M2.
    :param scale: the per-tensor scale; None computes it from the tensor's absolute maximum over
        its finite elements, ``fmt.max / amax / 2**margin`` (:meth:`Fp8Format.scale_for`); pass 1.0
        for the plain cast.
    :param saturate: False casts as ml_dtypes does (E4M3 overflows to NaN, E5M2 to inf); True
        clamps to the largest finite value first (infinities included; NaN stays NaN).
    """
    fmt = _enum(Fp8Format, fmt, "fmt")
    _check_backend(backend)
    if backend != "numpy":
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


# ------------------------------------------------------------------ QAT


@dataclass(frozen=True)
class QatConfig:
    """How :class:`QatOptimizer` quantizes.

    :param dtype: an :class:`IntDtype` (integer fake-quant) or an :class:`Fp8Format`.
    :param scheme: symmetric or affine (integer only).
    :param axis: per-channel axis for weights of ndim > axis (None: per tensor). Tensors with
        fewer dimensions are quantized per tensor.
    :param reduce_range, quant_min, quant_max, eps: as torch's observers.
    :param observer: ``"minmax"`` (running min/max, ``MinMaxObserver``) or ``"moving_average"``
        (``MovingAverageMinMaxObserver`` with ``averaging_constant``).
    :param freeze_observers_after: stop updating observers after this many steps (None: never;
        an observer that has seen nothing still records its first step).
    :param rounding, seed: rounding of the weights (and gradients); stochastic needs a seed;
        each step and tensor draws from its own stream derived from it.
    :param targets: :class:`QuantTarget` members: WEIGHTS (after each step) and/or GRADIENTS.
    :param fp8_saturate, fp8_margin: FP8 only.
    :param backend: where integer fake-quant runs (``"numpy"``, ``"cpu"``, ``"cuda"``, ``"opencl"``).
    """

    dtype: Union[IntDtype, Fp8Format] = IntDtype.INT8
    scheme: QuantScheme = QuantScheme.SYMMETRIC
    axis: Optional[int] = None
    reduce_range: bool = False
    quant_min: Optional[int] = None
    quant_max: Optional[int] = None
    eps: float = EPS
    observer: str = "minmax"
    averaging_constant: float = 0.01
    freeze_observers_after: Optional[int] = None
    rounding: RoundingMode = RoundingMode.NEAREST_EVEN
    seed: Optional[int] = None
    targets: Tuple[QuantTarget, ...] = (QuantTarget.WEIGHTS,)
    fp8_saturate: bool = True
    fp8_margin: int = 0
    backend: str = "numpy"

    def __post_init__(self) -> None:
        dtype = self.dtype
        if isinstance(dtype, str):
            try:
                dtype = IntDtype(dtype)
            except ValueError:
                dtype = _enum(Fp8Format, dtype, "dtype")
        if not isinstance(dtype, (IntDtype, Fp8Format)):
            raise InvalidParameterError(f"dtype={self.dtype!r}, expected an IntDtype or Fp8Format")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "scheme", _enum(QuantScheme, self.scheme, "scheme"))
        object.__setattr__(self, "rounding", _enum(RoundingMode, self.rounding, "rounding"))
        targets = self.targets if isinstance(self.targets, (tuple, list, set, frozenset)) else (self.targets,)
        targets = tuple(dict.fromkeys(_enum(QuantTarget, t, "targets") for t in targets))
        if not targets:
            raise InvalidParameterError("targets=(), expected at least one QuantTarget")
        object.__setattr__(self, "targets", targets)
        if self.axis is not None and (_int("axis", self.axis) < 0):
            raise InvalidParameterError(f"axis={self.axis}, expected an integer >= 0 or None")
        if self.observer not in ("minmax", "moving_average"):
            raise InvalidParameterError(f"observer={self.observer!r}, expected 'minmax' or 'moving_average'")
        c = self.averaging_constant
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0 < c <= 1:
            raise InvalidParameterError(f"averaging_constant={c!r}, expected 0 < averaging_constant <= 1")
        if self.freeze_observers_after is not None and _int("freeze_observers_after", self.freeze_observers_after) < 0:
            raise InvalidParameterError(f"freeze_observers_after={self.freeze_observers_after}, expected >= 0 or None")
        if self.rounding is RoundingMode.STOCHASTIC:
            _seed_keys(self.seed)
        _check_backend(self.backend)
        if isinstance(dtype, IntDtype):
            # Check the range and scheme combination now, not at the first step.
            QuantParams.from_min_max(_F32(-1), _F32(1), dtype, self.scheme, reduce_range=self.reduce_range,
                                     quant_min=self.quant_min, quant_max=self.quant_max, eps=self.eps)
        else:
            if self.backend != "numpy":
                raise UnsupportedOperationError(
                    f"dtype={dtype.value} with backend={self.backend!r}: FP8 runs through ml_dtypes, expected backend='numpy'")
            if self.rounding is not RoundingMode.NEAREST_EVEN:
                raise UnsupportedOperationError(f"rounding={self.rounding.value} with FP8: ml_dtypes rounds to nearest even only")
            if not isinstance(self.fp8_saturate, bool):
                raise InvalidParameterError(f"fp8_saturate={self.fp8_saturate!r}, expected True or False")
            dtype.scale_for(1.0, self.fp8_margin)

    def to_dict(self) -> Dict[str, Any]:
        out = {}
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif name == "targets":
                v = [t.value for t in v]
            out[name] = v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QatConfig":
        if not isinstance(data, Mapping):
            raise InvalidParameterError(f"config of type {type(data).__name__}, expected a mapping")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidParameterError(f"unknown QatConfig fields {sorted(unknown)}, expected a subset of {sorted(cls.__dataclass_fields__)}")
        data = dict(data)
        if "targets" in data:
            data["targets"] = tuple(data["targets"])
        return cls(**data)


class _Observer:
    """Running or moving-average min/max of one tensor, per tensor or per channel (float32, as torch)."""

    def __init__(self, axis: Optional[int], moving: bool, c: float):
        self.axis, self.moving, self.c = axis, moving, _F32(c)
        self.min_val: Optional[np.ndarray] = None
        self.max_val: Optional[np.ndarray] = None

    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        lo, hi = _observe(x, self.axis)
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


class QatOptimizer:
    """Quantization-aware training around any optirs optimizer.

    The caller's float32 arrays are the master weights: :meth:`step_gpu` steps them with the
    inner optimizer (gradients first fake-quantized when ``QuantTarget.GRADIENTS`` is set), then
    updates each weight's observer and computes the fake-quantized view of the new weights,
    returned by :meth:`quantized_params` (use it for the next forward pass). The master
    weights themselves are never rounded.

    Parameters must be host (numpy) arrays; the inner optimizer may run on any backend.
    """

    def __init__(self, inner: Any, config: Optional[QatConfig] = None):
        from optirs.optim.optimizers import GpuOptimizer

        if not isinstance(inner, GpuOptimizer):
            raise InvalidParameterError(f"inner of type {type(inner).__name__}, expected an optirs optimizer (GpuAdam, GpuSgd, ...)")
        if config is not None and not isinstance(config, QatConfig):
            raise InvalidParameterError(f"config of type {type(config).__name__}, expected a QatConfig")
        self.inner = inner
        self.config = config or QatConfig()
        if isinstance(self.config.dtype, IntDtype) and self.config.backend != "numpy":
            # Open the fake-quant backend now (compiles its kernels), so a missing one fails here.
            fake_quant_int(np.zeros(1, np.float32), QuantParams(1.0, 0, -128, 127), backend=self.config.backend)
        self._observers: List[_Observer] = []
        self._shapes: Optional[List[Tuple[int, ...]]] = None
        self._quantized: List[np.ndarray] = []
        self._qparams: List[Any] = []
        self._step = 0

    # ------------------------------------------------------------ helpers

    def _axis_for(self, shape: Tuple[int, ...]) -> Optional[int]:
        axis = self.config.axis
        if axis is None or isinstance(self.config.dtype, Fp8Format) or len(shape) <= axis:
            return None
        return axis

    def _params_for(self, lo, hi, axis) -> Any:
        cfg = self.config
        if isinstance(cfg.dtype, Fp8Format):
            amax = float(max(-float(np.min(lo)), float(np.max(hi)), 0.0))
            return cfg.dtype.scale_for(amax, cfg.fp8_margin)
        return QuantParams.from_min_max(lo, hi, cfg.dtype, cfg.scheme, reduce_range=cfg.reduce_range,
                                        quant_min=cfg.quant_min, quant_max=cfg.quant_max, eps=cfg.eps, axis=axis)

    def _fake_quant(self, x: np.ndarray, qp: Any, stream: int) -> np.ndarray:
        cfg = self.config
        if isinstance(cfg.dtype, Fp8Format):
            return fake_quant_fp8(x, cfg.dtype, scale=float(qp), saturate=cfg.fp8_saturate)
        seed = None
        if cfg.rounding is RoundingMode.STOCHASTIC:
            # One stream per (seed, step, tensor, target): reproducible, never reused.
            seed = (int(cfg.seed) + stream * 0x9E3779B97F4A7C15) % 2**64
        fn = fake_quant_int_per_channel if qp.per_channel else fake_quant_int
        return fn(x, qp, rounding=cfg.rounding, seed=seed, backend=cfg.backend)

    def _stream(self, step: int, tensor: int, target: int) -> int:
        return (step * 1000003 + tensor) * 2 + target

    @staticmethod
    def _check_host(arrays: Sequence[Any], what: str) -> None:
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise UnsupportedOperationError(
                    f"{what}[{i}] of type {type(a).__module__}.{type(a).__qualname__}: QatOptimizer observes and "
                    "fake-quantizes host arrays, expected numpy float32 master weights")

    # ------------------------------------------------------------ the step

    @property
    def step_count(self) -> int:
        return self._step

    def step_gpu(self, params, grads) -> None:
        """One step: (fake-quantize gradients,) inner step on the master weights, observe, fake-quantize.

        Everything is validated before anything changes (shapes, dtypes, finite values); on
        such an error parameters, state and observers are as they were. The one exception is
        an inner step that overflows to non-finite weights: that step stays applied, the
        observers and the quantized view stay those of the previous step, and
        InvalidParameterError says so.
        """
        cfg = self.config
        plist = list(params) if isinstance(params, (list, tuple)) else [params]
        glist = list(grads) if isinstance(grads, (list, tuple)) else [grads]
        self._check_host(plist, "params")
        self._check_host(glist, "grads")
        if len(plist) != len(glist):
            raise ShapeMismatchError(f"{len(plist)} params and {len(glist)} grads, expected one gradient per parameter")
        for i, (p, g) in enumerate(zip(plist, glist)):
            if g.shape != p.shape:
                raise ShapeMismatchError(f"grads[{i}] has shape {g.shape}, expected {p.shape} like params[{i}]")
            if p.dtype != np.float32 or g.dtype != np.float32:
                raise ShapeMismatchError(f"params[{i}]/grads[{i}] have dtypes {p.dtype}/{g.dtype}, expected float32")
        for what, arrays in (("params", plist), ("grads", glist)):
            for i, a in enumerate(arrays):
                if not np.isfinite(a).all():
                    raise InvalidParameterError(f"{what}[{i}] holds non-finite values, expected finite {what}")
        shapes = [p.shape for p in plist]
        if self._shapes is not None and shapes != self._shapes:
            raise ShapeMismatchError(f"the parameter list changed: got shapes {shapes}, expected {self._shapes} as in earlier steps")
        step = self._step + 1
        if QuantTarget.GRADIENTS in cfg.targets:
            qgrads = []
            for i, g in enumerate(glist):
                if g.size == 0:
                    qgrads.append(g.copy())
                    continue
                axis = self._axis_for(g.shape)
                lo, hi = _observe(g, axis)
                qp = self._params_for(lo, hi, axis)
                qgrads.append(self._fake_quant(g, qp, self._stream(step, i, 1)))
            glist = qgrads
        self.inner.step_gpu(plist if isinstance(params, (list, tuple)) else plist[0],
                            glist if isinstance(grads, (list, tuple)) else glist[0])
        observers = self._observers or [_Observer(self._axis_for(s), cfg.observer == "moving_average",
                                                  cfg.averaging_constant) for s in shapes]
        frozen = cfg.freeze_observers_after is not None and self._step >= cfg.freeze_observers_after
        new_obs = []
        for i, (p, ob) in enumerate(zip(plist, observers)):
            nob = _Observer(ob.axis, ob.moving, float(ob.c))
            nob.min_val, nob.max_val = ob.min_val, ob.max_val
            if not frozen or nob.min_val is None:
                try:
                    nob.update(p)
                except InvalidParameterError as exc:
                    # Inputs were finite (checked above): the step itself overflowed.
                    raise InvalidParameterError(
                        f"params[{i}] became non-finite in step {step} of the inner optimizer (applied; observers "
                        f"and the quantized view are kept from step {self._step}): {exc}") from None
            new_obs.append(nob)
        qparams, quantized = [], []
        for i, (p, ob) in enumerate(zip(plist, new_obs)):
            if ob.min_val is None:  # empty tensor
                qparams.append(None)
                quantized.append(p.copy())
                continue
            qp = self._params_for(ob.min_val, ob.max_val, ob.axis)
            qparams.append(qp)
            quantized.append(self._fake_quant(p, qp, self._stream(step, i, 0)))
        self._observers, self._qparams, self._quantized = new_obs, qparams, quantized
        self._shapes = shapes
        self._step = step

    def quantized_params(self) -> List[np.ndarray]:
        """The fake-quantized view of the master weights after the last step (float32 copies)."""
        return [q.copy() for q in self._quantized]

    def quant_params(self) -> List[Any]:
        """Per tensor: its :class:`QuantParams` (integer), or its float32 scale (FP8), after the last step."""
        return list(self._qparams)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's checkpoint plus the QAT config, step and observer state (numpy copies)."""
        return {
            "inner": self.inner.state_dict(),
            "config": self.config.to_dict(),
            "step": self._step,
            "shapes": [list(s) for s in self._shapes] if self._shapes is not None else None,
            "observers": [
                {"axis": ob.axis,
                 "min_val": None if ob.min_val is None else ob.min_val.copy(),
                 "max_val": None if ob.max_val is None else ob.max_val.copy()}
                for ob in self._observers],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`. The config must equal this optimizer's; everything is
        checked before anything changes. The quantized view is recomputed at the next step."""
        if not isinstance(state_dict, Mapping):
            raise InvalidParameterError(f"state_dict of type {type(state_dict).__name__}, expected a mapping")
        keys = {"inner", "config", "step", "shapes", "observers"}
        if set(state_dict) != keys:
            raise InvalidParameterError(f"state_dict keys {sorted(state_dict)}, expected {sorted(keys)}")
        config = QatConfig.from_dict(state_dict["config"])
        if config != self.config:
            raise InvalidParameterError(f"state_dict config {config!r} differs from this optimizer's {self.config!r}")
        step = _int("step", state_dict["step"])
        if step < 0:
            raise InvalidParameterError(f"step={step}, expected an integer >= 0")
        shapes = state_dict["shapes"]
        shapes = None if shapes is None else [tuple(int(d) for d in s) for s in shapes]
        entries = list(state_dict["observers"])
        if (shapes is None) != (not entries) or (shapes is not None and len(entries) != len(shapes)):
            raise InvalidParameterError(f"state_dict has {len(entries)} observers for shapes {shapes}, expected one per tensor")
        observers = []
        for i, e in enumerate(entries):
            if set(e) != {"axis", "min_val", "max_val"}:
                raise InvalidParameterError(f"observers[{i}] keys {sorted(e)}, expected ['axis', 'max_val', 'min_val']")
            axis = self._axis_for(shapes[i])
            if e["axis"] != axis:
                raise InvalidParameterError(f"observers[{i}] axis={e['axis']!r}, expected {axis!r} for shape {shapes[i]}")
            ob = _Observer(axis, config.observer == "moving_average", config.averaging_constant)
            if (e["min_val"] is None) != (e["max_val"] is None):
                raise InvalidParameterError(f"observers[{i}] has only one of min_val/max_val, expected both or neither")
            if e["min_val"] is not None:
                want = () if axis is None else (shapes[i][axis],)
                lo, hi = np.asarray(e["min_val"], np.float32), np.asarray(e["max_val"], np.float32)
                if lo.shape != want or hi.shape != want:
                    raise ShapeMismatchError(f"observers[{i}] min/max of shapes {lo.shape}/{hi.shape}, expected {want}")
                ob.min_val, ob.max_val = lo.copy(), hi.copy()
            observers.append(ob)
        self.inner.load_state_dict(state_dict["inner"])  # validates itself; raises before changing
        self._observers, self._shapes, self._step = observers, shapes, step
        self._quantized, self._qparams = [], []

    def __repr__(self) -> str:
        return f"QatOptimizer({self.inner!r}, {self.config!r}, step={self._step})"


# ------------------------------------------------------------------ plugin


class QuantizationPlugin:
    """The analysis plugin that ``optirs info`` lists."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        return {"summary": "QAT: int8/uint8/int4/uint4 and FP8 fake-quant (bit-exact with torch / ml_dtypes), "
                           "observers and QatOptimizer; numpy, cpu, cuda and opencl kernels"}


plugin = QuantizationPlugin()
