"""Mixed precision (AMP): half conversions, dynamic loss scaling and half/bfloat16 optimizer steps.

- :func:`f32_to_f16_bits` / :func:`f16_bits_to_f32`: IEEE-754 binary16 conversions, bit for bit
  numpy's float16 (round to nearest even, subnormals, infinities, NaN), vectorized.
- :class:`DynamicLossScaler`: ``torch.amp.GradScaler``'s update rule and defaults (scale 2**16,
  x2.0 after 2000 clean steps, x0.5 on inf/NaN, the step skipped and the growth tracker reset),
  plus optional hysteresis, minimum and maximum scale. :class:`OverflowStats` counts what happened.
- :class:`MixedPrecisionOptimizer`: wraps any optirs optimizer so that it steps float16 or
  bfloat16 (``ml_dtypes.bfloat16``) parameters. float32 master weights live on the inner
  optimizer's device; each step one kernel pass unscales the half gradients into a float32
  buffer while flagging non-finite values, the inner optimizer steps the master weights, and a
  second pass writes the rounded master weights back into the caller's parameters. When any
  gradient is non-finite nothing is touched (parameters, master weights, state, step count) and
  the scaler backs off.

The per-element conversions below are integer and exact-float32 arithmetic only, written once as
plain functions and compiled both by ``numba.njit`` (cpu) and ``numba.cuda.jit(device=True)``:
numba has no float16 on the CPU and no bfloat16 anywhere, so half arrays are handled as their
uint16 bit patterns. They are tested bit for bit against numpy's float16 and ml_dtypes' bfloat16.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError

__all__ = [
    "f32_to_f16_bits", "f16_bits_to_f32", "DynamicLossScaler", "OverflowStats", "MixedPrecisionConfig",
    "MixedPrecisionOptimizer", "HALF_DTYPES",
]


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


HALF_DTYPES = ("float16", "bfloat16")

# ----------------------------------------------------------------------------- host conversions


def f32_to_f16_bits(values: Any):
    """The binary16 bit patterns (uint16) of ``values`` rounded to float32 first, as numpy rounds.

    Accepts a scalar or any array-like; returns a ``numpy.uint16`` scalar or an array of the same shape.
    """
    try:
        a = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"values={values!r}, expected real numbers convertible to float32") from exc
    with np.errstate(over="ignore"):  # beyond 65504 the right answer is inf
        bits = a.astype(np.float16).view(np.uint16)
    return bits[()] if bits.ndim == 0 else bits


def f16_bits_to_f32(bits: Any):
    """The float32 values of binary16 bit patterns (integers in 0..65535); exact, NaN payloads kept."""
    a = np.asarray(bits)
    if a.dtype.kind not in "ui":
        raise InvalidParameterError(f"bits of dtype {a.dtype}, expected integer bit patterns in 0..65535")
    if a.size and (a.min() < 0 or a.max() > 0xFFFF):
        raise InvalidParameterError(
            f"bits range {int(a.min())}..{int(a.max())}, expected integer bit patterns in 0..65535"
        )
    out = a.astype(np.uint16).view(np.float16).astype(np.float32)
    return out[()] if out.ndim == 0 else out


# ----------------------------------------------------------------------------- loss scaling


@dataclass
class OverflowStats:
    """What the loss scaler saw: steps, skipped (overflowed) steps, scale changes."""

    steps: int = 0
    skipped_steps: int = 0
    backoffs: int = 0
    growths: int = 0
    consecutive_skipped: int = 0
    max_consecutive_skipped: int = 0
    last_overflow_step: Optional[int] = None  # 1-based index among ``steps``

    @property
    def applied_steps(self) -> int:
        return self.steps - self.skipped_steps

    @property
    def skip_rate(self) -> float:
        return self.skipped_steps / self.steps if self.steps else 0.0


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidParameterError(f"{name}={value!r}, expected a real number")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidParameterError(f"{name}={value!r}, expected a finite number")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidParameterError(f"{name}={value!r}, expected an integer >= 1")
    return int(value)


def _check_scaling(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale):
    init_scale = _real("init_scale", init_scale)
    if not 0.0 < init_scale < float(np.finfo(np.float32).max):
        raise InvalidParameterError(f"init_scale={init_scale!r}, expected 0 < init_scale < float32 max")
    growth_factor = _real("growth_factor", growth_factor)
    if growth_factor <= 1.0:
        raise InvalidParameterError(f"growth_factor={growth_factor!r}, expected growth_factor > 1")
    backoff_factor = _real("backoff_factor", backoff_factor)
    if not 0.0 < backoff_factor < 1.0:
        raise InvalidParameterError(f"backoff_factor={backoff_factor!r}, expected 0 < backoff_factor < 1")
    growth_interval = _count("growth_interval", growth_interval)
    hysteresis = _count("hysteresis", hysteresis)
    if min_scale is not None:
        min_scale = _real("min_scale", min_scale)
        if not 0.0 < min_scale <= init_scale:
            raise InvalidParameterError(f"min_scale={min_scale!r}, expected 0 < min_scale <= init_scale={init_scale!r}")
    if max_scale is not None:
        max_scale = _real("max_scale", max_scale)
        if max_scale < init_scale:
            raise InvalidParameterError(f"max_scale={max_scale!r}, expected max_scale >= init_scale={init_scale!r}")
    return init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale


class DynamicLossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s update rule and defaults.

    .. code-block:: text

        overflow (any gradient inf/NaN): the step is skipped; growth tracker = 0;
            hysteresis tracker -= 1; when it reaches 0: scale = max(scale * backoff_factor, min_scale)
        clean step: growth tracker += 1; when it reaches growth_interval: growth tracker = 0,
            hysteresis tracker = hysteresis, scale = min(scale * growth_factor, max_scale)
            (kept unchanged if the grown scale is not finite in float32)

    With ``hysteresis=1`` (the default) and no min/max this is exactly GradScaler's
    ``_amp_update_scale_``; hysteresis > 1 tolerates that many overflows before backing off
    (Megatron-LM's DynamicGradScaler; the allowance is refilled when the scale grows). The scale is
    a float32 value, products are rounded to float32 as torch does. ``dynamic=False`` keeps the
    scale fixed (static loss scaling) but still reports overflows so steps are skipped.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: Optional[float] = None,
                 max_scale: Optional[float] = None, dynamic: bool = True):
        (init_scale, self.growth_factor, self.backoff_factor, self.growth_interval, self.hysteresis,
         self.min_scale, self.max_scale) = _check_scaling(init_scale, growth_factor, backoff_factor,
                                                          growth_interval, hysteresis, min_scale, max_scale)
        if not isinstance(dynamic, bool):
            raise InvalidParameterError(f"dynamic={dynamic!r}, expected True or False")
        self.dynamic = dynamic
        self._scale = np.float32(init_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        self.stats = OverflowStats()

    @classmethod
    def from_config(cls, config: "MixedPrecisionConfig") -> "DynamicLossScaler":
        return cls(config.init_scale, config.growth_factor, config.backoff_factor, config.growth_interval,
                   config.hysteresis, config.min_scale, config.max_scale, config.dynamic)

    @property
    def scale(self) -> float:
        """The current loss scale (a float32 value)."""
        return float(self._scale)

    @property
    def inv_scale(self) -> np.float32:
        """1 / scale rounded to float32, as GradScaler computes it (in double, then float)."""
        return np.float32(1.0 / float(self._scale))

    def scale_loss(self, loss: Any):
        """``loss * scale`` (float32 for numpy input; any object supporting ``*`` otherwise)."""
        if isinstance(loss, (np.ndarray, np.generic, float, int)):
            return np.asarray(loss, dtype=np.float32) * self._scale
        return loss * self.scale

    def unscale(self, grads: Sequence[Any]) -> Tuple[List[np.ndarray], bool]:
        """Host helper: float32 ``grad * inv_scale`` of numpy gradients and whether any is inf/NaN."""
        inv = self.inv_scale
        out = [np.asarray(g).astype(np.float32) * inv for g in grads]
        return out, not all(bool(np.isfinite(g).all()) for g in out)

    def update(self, found_inf: bool) -> bool:
        """Record one step's outcome and adjust the scale; returns True when the step may be applied."""
        found_inf = bool(found_inf)
        st = self.stats
        st.steps += 1
        if found_inf:
            st.skipped_steps += 1
            st.consecutive_skipped += 1
            st.max_consecutive_skipped = max(st.max_consecutive_skipped, st.consecutive_skipped)
            st.last_overflow_step = st.steps
            if self.dynamic:
                self.growth_tracker = 0
                self.hysteresis_tracker -= 1
                if self.hysteresis_tracker <= 0:
                    new = np.float32(float(self._scale) * self.backoff_factor)
                    if self.min_scale is not None:
                        new = max(new, np.float32(self.min_scale))
                    if new != self._scale:
                        st.backoffs += 1
                    self._scale = np.float32(new)
            return False
        st.consecutive_skipped = 0
        if self.dynamic:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                with np.errstate(over="ignore"):
                    new = np.float32(float(self._scale) * self.growth_factor)
                if self.max_scale is not None:
                    new = min(new, np.float32(self.max_scale))
                if np.isfinite(new):
                    if new != self._scale:
                        st.growths += 1
                    self._scale = np.float32(new)
        return True

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": float(self._scale), "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker, "stats": asdict(self.stats)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != {"scale", "growth_tracker", "hysteresis_tracker", "stats"}:
            raise InvalidParameterError(
                f"scaler state {state!r}, expected a mapping with scale, growth_tracker, hysteresis_tracker, stats"
            )
        scale = _real("scale", state["scale"])
        if scale <= 0.0:
            raise InvalidParameterError(f"scale={scale!r}, expected a positive scale")
        tracker = state["growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, (int, np.integer)) or not 0 <= tracker < self.growth_interval:
            raise InvalidParameterError(f"growth_tracker={tracker!r}, expected 0 <= growth_tracker < {self.growth_interval}")
        hyst = state["hysteresis_tracker"]
        if isinstance(hyst, bool) or not isinstance(hyst, (int, np.integer)) or hyst > self.hysteresis:
            raise InvalidParameterError(f"hysteresis_tracker={hyst!r}, expected an integer <= {self.hysteresis}")
        try:
            stats = OverflowStats(**dict(state["stats"]))
        except TypeError as exc:
            raise InvalidParameterError(f"stats={state['stats']!r}, expected OverflowStats fields") from exc
        self._scale, self.growth_tracker, self.hysteresis_tracker = np.float32(scale), int(tracker), int(hyst)
        self.stats = stats

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale!r}, growth_tracker={self.growth_tracker}, "
                f"skipped={self.stats.skipped_steps}/{self.stats.steps})")


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """How a :class:`MixedPrecisionOptimizer` stores parameters and scales the loss.

    :param param_dtype: ``"float16"`` or ``"bfloat16"`` (ml_dtypes), or those dtypes.
    :param dynamic: dynamic loss scaling; False keeps ``init_scale`` fixed (1.0 for none, the usual
        choice with bfloat16). Overflowing steps are skipped either way.
    The remaining fields are :class:`DynamicLossScaler`'s.
    """

    param_dtype: Any = "float16"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None
    dynamic: bool = True

    def __post_init__(self) -> None:
        try:
            dtype = np.dtype(self.param_dtype if self.param_dtype != "bfloat16" else _bfloat16())
        except TypeError:
            dtype = None
        if dtype is None or dtype.name not in HALF_DTYPES:
            raise InvalidParameterError(f"param_dtype={self.param_dtype!r}, expected one of {list(HALF_DTYPES)}")
        object.__setattr__(self, "param_dtype", dtype)
        _check_scaling(self.init_scale, self.growth_factor, self.backoff_factor, self.growth_interval,
                       self.hysteresis, self.min_scale, self.max_scale)
        if not isinstance(self.dynamic, bool):
            raise InvalidParameterError(f"dynamic={self.dynamic!r}, expected True or False")

    @property
    def is_bfloat16(self) -> bool:
        return self.param_dtype.name == "bfloat16"

    def make_scaler(self) -> DynamicLossScaler:
        return DynamicLossScaler.from_config(self)


# ----------------------------------------------------------------------------- per-element math
# Plain functions, compiled for the CPU (njit) and for CUDA (device functions) below. Integer
# constants only; the one float multiply per decode is exact (an integer < 2048 times a power of 2).

# _POW2[k] = 2**(k - 134): every scale a binary16 or bfloat16 exponent field needs, exact in float32.
_POW2 = np.array([2.0 ** (k - 134) for k in range(256)], dtype=np.float32)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)


def _py_f16_decode(h):
    """binary16 bits -> float32 value (NaN payloads not kept: only gradients are decoded)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        v = _INF if m == 0 else _NAN
    elif e == 0:
        v = np.float32(m) * _POW2[110]  # m * 2**-24
    else:
        v = np.float32(m | 0x400) * _POW2[e + 109]  # 1.m * 2**(e-15)
    return -v if (h >> 15) & 1 else v


def _py_bf16_decode(h):
    """bfloat16 bits -> float32 value (NaN payloads not kept)."""
    e = (h >> 7) & 0xFF
    m = h & 0x7F
    if e == 0xFF:
        v = _INF if m == 0 else _NAN
    elif e == 0:
        v = np.float32(m) * _POW2[1]  # m * 2**-133
    else:
        v = np.float32(m | 0x80) * _POW2[e]  # 1.m * 2**(e-127)
    return -v if (h >> 15) & 1 else v


def _py_f16_encode(u):
    """float32 bits -> binary16 bits, round to nearest even, as numpy's float32 -> float16 cast."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return sign | 0x7C00
        h = 0x7C00 | ((a >> 13) & 0x3FF)  # NaN: keep the top payload bits, never turn into inf
        if h == 0x7C00:
            h = 0x7C01
        return sign | h
    if a >= 0x477FF000:  # >= 65520 rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:  # normal half (>= 2**-14)
        h = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF)
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1
        return sign | h
    if a <= 0x33000000:  # <= 2**-25 rounds to zero (the tie goes to the even zero)
        return sign
    shift = 126 - (a >> 23)  # 14..24: the value in units of 2**-24 is mant >> shift
    mant = (a & 0x7FFFFF) | 0x800000
    h = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return sign | h


def _py_bf16_encode(u):
    """float32 bits -> bfloat16 bits, round to nearest even, NaN -> quiet NaN (as ml_dtypes)."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0xFFC0 if (u >> 31) & 1 else 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


_cpu = None
_cuda = None
cuda = None  # numba.cuda, imported by _cuda_kernels


def _cpu_kernels():
    """The njit conversions and the two parallel passes (compiled on first use)."""
    global _cpu
    if _cpu is not None:
        return _cpu
    from numba import njit, prange
    from numba.typed import List

    f16_decode = njit(cache=True)(_py_f16_decode)
    bf16_decode = njit(cache=True)(_py_bf16_decode)
    f16_encode = njit(cache=True)(_py_f16_encode)
    bf16_encode = njit(cache=True)(_py_bf16_encode)

    @njit(parallel=True, cache=True)
    def unscale(gs, out, offsets, chunk_tensor, chunk_start, chunk_stop, inv_scale, bf16, flags):
        # One pass: decode, multiply by 1/scale, store float32, flag non-finite results per chunk.
        for c in prange(chunk_tensor.shape[0]):
            t = chunk_tensor[c]
            g, off = gs[t], offsets[t]
            bad = 0
            for i in range(chunk_start[c], chunk_stop[c]):
                x = (bf16_decode(g[i]) if bf16 else f16_decode(g[i])) * inv_scale
                out[off + i] = x
                if not math.isfinite(x):
                    bad = 1
            flags[c] = bad

    @njit(parallel=True, cache=True)
    def narrow(master_bits, ps, offsets, chunk_tensor, chunk_start, chunk_stop, bf16):
        for c in prange(chunk_tensor.shape[0]):
            t = chunk_tensor[c]
            p, off = ps[t], offsets[t]
            for i in range(chunk_start[c], chunk_stop[c]):
                u = master_bits[off + i]
                p[i] = bf16_encode(u) if bf16 else f16_encode(u)

    @njit(parallel=True, cache=True)
    def encode_all(bits, out, bf16):
        for i in prange(bits.shape[0]):
            out[i] = bf16_encode(bits[i]) if bf16 else f16_encode(bits[i])

    @njit(parallel=True, cache=True)
    def decode_all(bits, out, bf16):
        for i in prange(bits.shape[0]):
            out[i] = bf16_decode(bits[i]) if bf16 else f16_decode(bits[i])

    def typed_list(arrays):
        out = List()
        for a in arrays:
            out.append(a)
        return out

    class K:
        pass

    K.unscale, K.narrow, K.encode_all, K.decode_all, K.typed_list = unscale, narrow, encode_all, decode_all, typed_list
    _cpu = K
    return K


def _cuda_kernels():
    """numba.cuda versions: one launch per tensor (half arrays are separate allocations)."""
    # ``cuda`` must be a module global for the kernels: the simulator swaps the kernels' globals.
    global _cuda, cuda
    if _cuda is not None:
        return _cuda
    from numba import cuda

    f16_decode = cuda.jit(device=True)(_py_f16_decode)
    bf16_decode = cuda.jit(device=True)(_py_bf16_decode)
    f16_encode = cuda.jit(device=True)(_py_f16_encode)
    bf16_encode = cuda.jit(device=True)(_py_bf16_encode)

    @cuda.jit
    def unscale(g, out, offset, inv_scale, bf16, found_inf):
        i = cuda.grid(1)
        if i < g.shape[0]:
            x = (bf16_decode(g[i]) if bf16 else f16_decode(g[i])) * inv_scale
            out[offset + i] = x
            if not math.isfinite(x):
                found_inf[0] = 1  # every writer stores the same value: no atomic needed

    @cuda.jit
    def narrow(master_bits, p, offset, bf16):
        i = cuda.grid(1)
        if i < p.shape[0]:
            u = master_bits[offset + i]
            p[i] = bf16_encode(u) if bf16 else f16_encode(u)

    class K:
        pass

    K.unscale, K.narrow, K.cuda = unscale, narrow, cuda
    _cuda = K
    return K


# The same conversions in OpenCL C: float16 loads through vload_half (core OpenCL, exact; no
# cl_khr_fp16 needed), every rounding in integer arithmetic as above so results match numpy and
# ml_dtypes bit for bit on any device.
OPENCL_SOURCE = r"""
inline ushort optirs_f16_encode(uint u) {
    uint sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu, h;
    if (a >= 0x7F800000u) {
        if (a == 0x7F800000u) return (ushort)(sign | 0x7C00u);
        h = 0x7C00u | ((a >> 13) & 0x3FFu);
        return (ushort)(sign | (h == 0x7C00u ? 0x7C01u : h));
    }
    if (a >= 0x477FF000u) return (ushort)(sign | 0x7C00u);
    if (a >= 0x38800000u) {
        uint rem = a & 0x1FFFu;
        h = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3FFu);
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1u;
        return (ushort)(sign | h);
    }
    if (a <= 0x33000000u) return (ushort)sign;
    uint shift = 126u - (a >> 23), mant = (a & 0x7FFFFFu) | 0x800000u;
    uint rem = mant & ((1u << shift) - 1u), half_ = 1u << (shift - 1u);
    h = mant >> shift;
    if (rem > half_ || (rem == half_ && (h & 1u))) h += 1u;
    return (ushort)(sign | h);
}

inline ushort optirs_bf16_encode(uint u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 31) ? (ushort)0xFFC0u : (ushort)0x7FC0u;
    return (ushort)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__kernel void optirs_mp_unscale(__global const ushort *g, ulong g_off, __global float *out, ulong out_off,
                                uint n, float inv_scale, int bf16, __global int *found_inf) {
    size_t i = get_global_id(0);
    if (i >= n) return;
    float x = bf16 ? as_float(((uint)g[g_off + i]) << 16) : vload_half(g_off + i, (__global const half *)g);
    x *= inv_scale;
    out[out_off + i] = x;
    if (!isfinite(x)) *found_inf = 1;  /* every writer stores the same value */
}

__kernel void optirs_mp_narrow(__global const uint *master, ulong m_off, __global ushort *p, ulong p_off,
                               uint n, int bf16) {
    size_t i = get_global_id(0);
    if (i >= n) return;
    uint u = master[m_off + i];
    p[p_off + i] = bf16 ? optirs_bf16_encode(u) : optirs_f16_encode(u);
}
"""

_ocl_programs: Any = None  # weakref.WeakKeyDictionary: OpenCL context -> built kernels


def _opencl_kernels(ctx: Any):
    """The two kernels built for an optirs OpenCL context (once per context)."""
    global _ocl_programs
    import weakref

    import pyopencl as cl

    if _ocl_programs is None:
        _ocl_programs = weakref.WeakKeyDictionary()
    hit = _ocl_programs.get(ctx)
    if hit is None:
        prg = cl.Program(ctx.context, OPENCL_SOURCE).build()
        hit = {"unscale": prg.optirs_mp_unscale, "narrow": prg.optirs_mp_narrow,
               "found": cl.Buffer(ctx.context, cl.mem_flags.READ_WRITE, 4)}
        _ocl_programs[ctx] = hit
    return hit


def _cl_parts(a: Any, itemsize: int):
    """(buffer, element offset, element count) of a pyopencl array."""
    return a.base_data, np.uint64(a.offset // itemsize), int(a.size)


def encode_bits(values32: np.ndarray, dtype: Any) -> np.ndarray:
    """The kernel's float32 -> float16/bfloat16 rounding on the CPU, as uint16 bit patterns (for tests)."""
    bf16 = _half_dtype(dtype).name == "bfloat16"
    bits = np.ascontiguousarray(values32, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.shape, np.uint16)
    _cpu_kernels().encode_all(bits, out, bf16)
    return out


def decode_bits(bits: np.ndarray, dtype: Any) -> np.ndarray:
    """The kernel's float16/bfloat16 -> float32 decoding on the CPU (for tests)."""
    bf16 = _half_dtype(dtype).name == "bfloat16"
    b = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    out = np.empty(b.shape, np.float32)
    _cpu_kernels().decode_all(b, out, bf16)
    return out


def _half_dtype(dtype: Any) -> np.dtype:
    return MixedPrecisionConfig(param_dtype=dtype).param_dtype


# Threads per block for the CUDA passes: simple elementwise, any multiple of the warp works.
_CUDA_BLOCK = 256


# ----------------------------------------------------------------------------- the optimizer wrapper


def _is_numba_device_array(a: Any) -> bool:
    return hasattr(a, "copy_to_host") and hasattr(a, "view")


class MixedPrecisionOptimizer:
    """Steps float16/bfloat16 parameters with any optirs optimizer over float32 master weights.

    .. code-block:: python

        opt = MixedPrecisionOptimizer(GpuAdam(AdamParams(lr=1e-3), config=GpuOptimizerConfig("cpu")),
                                      MixedPrecisionConfig("float16"))
        loss = model_loss(params) * opt.scaler.scale      # gradients come scaled by the loss scale
        applied = opt.step_gpu(params, grads)             # False: an overflow, nothing changed

    Per step: (1) one pass unscales every half gradient into a float32 buffer and flags inf/NaN;
    (2) if none, the inner optimizer steps the master weights with it; (3) one pass writes the
    master weights, rounded to nearest even, into the caller's parameters. Gradients of an
    overflowing step leave everything untouched; the scaler backs off either way. The master
    weights are authoritative: edits to the half parameters between steps are overwritten by the
    next applied step (load a checkpoint to change them).
    Backends: ``cpu`` (numba parallel loops over the chunk table, one call per pass), ``cuda``
    (numba.cuda) and ``opencl`` (OpenCL C), one launch per tensor per pass on the devices.
    """

    SUPPORTED_BACKENDS = ("cpu", "cuda", "opencl")

    def __init__(self, inner: Any, config: Optional[MixedPrecisionConfig] = None):
        from optirs.optim.optimizers import STATE_DTYPE, GpuOptimizer

        if not isinstance(inner, GpuOptimizer):
            raise InvalidParameterError(f"inner={inner!r}, expected an optirs optimizer (GpuOptimizer)")
        if STATE_DTYPE not in inner.param_dtypes:
            raise InvalidParameterError(f"inner optimizer steps {inner.param_dtypes}, expected float32 master weights")
        if inner.step_count != 0:
            raise InvalidParameterError(
                f"inner optimizer has taken {inner.step_count} steps, expected a fresh optimizer "
                "(restore checkpoints with MixedPrecisionOptimizer.load_state_dict)"
            )
        if config is not None and not isinstance(config, MixedPrecisionConfig):
            raise InvalidParameterError(f"config={config!r}, expected a MixedPrecisionConfig")
        self.inner = inner
        self.config = config or MixedPrecisionConfig()
        self.scaler = self.config.make_scaler()
        self._shapes: Optional[List[Tuple[int, ...]]] = None
        self._master = None  # flat float32 device array
        self._grads32 = None
        self._master_views: List[Any] = []
        self._grad_views: List[Any] = []
        self._lists: Dict[tuple, tuple] = {}
        self._layout_cache = None
        self._found_flag = None  # cuda: the device word the unscale pass raises

    # ------------------------------------------------------------ properties

    @property
    def backend(self):
        backend = self.inner.backend
        if backend.name not in self.SUPPORTED_BACKENDS:
            raise UnsupportedOperationError(
                f"mixed-precision steps are implemented for backends {list(self.SUPPORTED_BACKENDS)}, "
                f"not {backend.name!r}"
            )
        return backend

    @property
    def step_count(self) -> int:
        """Applied steps (the inner optimizer's count); skipped steps are in ``scaler.stats``."""
        return self.inner.step_count

    def master_weights(self) -> List[np.ndarray]:
        """Host float32 copies of the master weights, shaped like the parameters (empty before step 1)."""
        if self._master is None:
            return []
        backend = self.backend
        flat = np.asarray(backend.to_host(backend.ctx, self._master), dtype=np.float32).reshape(-1)
        return [v.copy() for v in self._split(flat)]

    def _split(self, flat):
        out, off = [], 0
        for s in self._shapes or []:
            n = int(np.prod(s, dtype=np.int64))
            out.append(flat[off : off + n].reshape(s))
            off += n
        return out

    # ------------------------------------------------------------ validation

    def _validate(self, params: List[Any], grads: List[Any], kind: str) -> List[Tuple[int, ...]]:
        if len(params) != len(grads):
            raise ShapeMismatchError(f"{len(params)} params and {len(grads)} grads, expected one gradient per parameter")
        want = self.config.param_dtype
        shapes = []
        seen: Dict[int, int] = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            for a, label in ((p, "params"), (g, "grads")):
                if kind == "cpu" and not isinstance(a, np.ndarray):
                    raise InvalidParameterError(f"{label}[{i}] is a {type(a).__name__}, expected a numpy array on the cpu backend")
                if kind == "cuda" and isinstance(a, np.ndarray):
                    raise InvalidParameterError(f"{label}[{i}] is a numpy array, expected a CUDA device array on the cuda backend")
                if kind == "opencl" and not type(a).__module__.startswith("pyopencl"):
                    raise InvalidParameterError(f"{label}[{i}] is a {type(a).__name__}, expected a pyopencl.array.Array on the opencl backend")
                dt = _dtype_of(a)
                # numba, CuPy and torch's __cuda_array_interface__ have no bfloat16: on the cuda
                # backend bfloat16 tensors arrive as their 16-bit patterns.
                bf16_bits = kind == "cuda" and want.name == "bfloat16" and dt in (np.dtype(np.uint16), np.dtype(np.int16))
                if dt != want and not bf16_bits:
                    raise ShapeMismatchError(f"{label}[{i}] has dtype {dt}, expected {want} (MixedPrecisionConfig.param_dtype)")
                flags = getattr(a, "flags", None)
                contiguous = flags.get("C_CONTIGUOUS", True) if isinstance(flags, dict) else getattr(flags, "c_contiguous", True)
                if not contiguous:
                    raise ShapeMismatchError(f"{label}[{i}] is not C-contiguous, expected a contiguous array")
            if tuple(g.shape) != tuple(p.shape):
                raise ShapeMismatchError(f"grads[{i}] has shape {tuple(g.shape)}, expected {tuple(p.shape)} like params[{i}]")
            if isinstance(p, np.ndarray):
                if not p.flags.writeable:
                    raise ShapeMismatchError(f"params[{i}] is read-only, expected a writeable array (updated in place)")
                addr = p.__array_interface__["data"][0]
                if p.size and addr in seen:
                    raise InvalidParameterError(f"params[{i}] is the same memory as params[{seen[addr]}], expected distinct tensors")
                seen[addr] = i
            shapes.append(tuple(int(d) for d in p.shape))
        if self._shapes is not None and shapes != self._shapes:
            raise ShapeMismatchError(
                f"the parameter list changed: got {len(shapes)} tensors with shapes {shapes}, "
                f"expected {len(self._shapes)} tensors with shapes {self._shapes} as in earlier steps"
            )
        return shapes

    # ------------------------------------------------------------ buffers

    def _init_buffers(self, params: List[Any], shapes) -> None:
        backend = self.backend
        # One-time widening on the host: exact, NaN payloads kept, any device array kind.
        host = [np.asarray(backend.to_host(backend.ctx, p)).view(self.config.param_dtype).astype(np.float32).reshape(-1)
                for p in params]
        flat = np.concatenate(host) if host else np.zeros(0, np.float32)
        self._install_master(flat, shapes)

    def _install_master(self, flat: np.ndarray, shapes) -> None:
        backend = self.backend
        master = backend.to_device(backend.ctx, np.ascontiguousarray(flat, dtype=np.float32))
        grads32 = backend.alloc(backend.ctx, int(flat.size), np.float32, 0.0)
        # The inner optimizer is always handed these same view objects, so its per-list caches hit.
        mviews, gviews, off = [], [], 0
        for s in shapes:
            n = int(np.prod(s, dtype=np.int64))
            mviews.append(master[off : off + n].reshape(s))
            gviews.append(grads32[off : off + n].reshape(s))
            off += n
        self._master, self._grads32, self._master_views, self._grad_views = master, grads32, mviews, gviews
        self._shapes = list(shapes)
        self._layout_cache = None

    def _chunks(self):
        from optirs.backends.cpu import CHUNK
        from optirs.core.layout import TensorLayout

        if self._layout_cache is None:
            self._layout_cache = TensorLayout(self._shapes)
        layout = self._layout_cache
        return layout.offsets, layout.chunks(CHUNK)

    def _typed_bits(self, arrays):
        """A numba typed list of the arrays' flat uint16 views, cached by the arrays' identities
        (the entry keeps them alive, so the ids stay theirs)."""
        key = tuple(id(a) for a in arrays)
        hit = self._lists.get(key)
        if hit is None:
            hit = (arrays, _cpu_kernels().typed_list([a.view(np.uint16).reshape(-1) for a in arrays]))
            if len(self._lists) >= 8:
                self._lists.pop(next(iter(self._lists)))
            self._lists[key] = hit
        return hit[1]

    # ------------------------------------------------------------ the step

    def step_gpu(self, params: Any, grads: Any) -> bool:
        """One mixed-precision step; returns False (nothing changed) when a gradient was inf/NaN.

        ``grads`` are the gradients of the loss multiplied by ``scaler.scale``; they are divided by
        it here. Parameters are updated in place with the rounded master weights.
        """
        plist = list(params) if isinstance(params, (list, tuple)) else [params]
        glist = list(grads) if isinstance(grads, (list, tuple)) else [grads]
        if not plist:
            raise InvalidParameterError("params=[], expected at least one array")
        backend = self.backend
        shapes = self._validate(plist, glist, backend.name)
        fresh = self._master is None
        if fresh:
            self._init_buffers(plist, shapes)
        try:
            found_inf = self._unscale(backend.name, glist)
            if not found_inf:
                self.inner.step_gpu(self._master_views, self._grad_views)
        except BaseException:
            if fresh:  # a failed first step leaves the wrapper as it was
                self._master = self._grads32 = None
                self._shapes, self._master_views, self._grad_views = None, [], []
            raise
        if not found_inf:
            self._narrow(backend.name, plist)
        return self.scaler.update(found_inf)

    def _unscale(self, kind: str, grads: List[Any]) -> bool:
        inv = self.scaler.inv_scale
        bf16 = self.config.is_bfloat16
        if kind == "cpu":
            k = _cpu_kernels()
            offsets, (ct, cs, ce) = self._chunks()
            glist = self._typed_bits(grads)
            flags = np.zeros(ct.shape[0], np.uint8)
            k.unscale(glist, self._grads32, offsets, ct, cs, ce, inv, bf16, flags)
            return bool(flags.any())
        if kind == "opencl":
            return self._unscale_opencl(grads, inv, bf16)
        k = _cuda_kernels()
        found = self._found_flag
        if found is None:
            found = self._found_flag = k.cuda.to_device(np.zeros(1, np.int32))
        else:
            found.copy_to_device(np.zeros(1, np.int32))
        offsets, _ = self._chunks()
        out = _as_numba(k.cuda, self._grads32)
        for g, off in zip(grads, offsets):
            g16 = _as_numba(k.cuda, g).reshape(-1).view(np.uint16)
            n = g16.shape[0]
            if n:
                k.unscale[(n + _CUDA_BLOCK - 1) // _CUDA_BLOCK, _CUDA_BLOCK](g16, out, int(off), inv, bf16, found)
        return bool(found.copy_to_host()[0])

    def _narrow(self, kind: str, params: List[Any]) -> None:
        bf16 = self.config.is_bfloat16
        if kind == "cpu":
            k = _cpu_kernels()
            offsets, (ct, cs, ce) = self._chunks()
            plist = self._typed_bits(params)
            k.narrow(self._master.view(np.uint32), plist, offsets, ct, cs, ce, bf16)
            return
        if kind == "opencl":
            self._narrow_opencl(params, bf16)
            return
        k = _cuda_kernels()
        offsets, _ = self._chunks()
        bits = _as_numba(k.cuda, self._master).view(np.uint32)
        for p, off in zip(params, offsets):
            p16 = _as_numba(k.cuda, p).reshape(-1).view(np.uint16)
            n = p16.shape[0]
            if n:
                k.narrow[(n + _CUDA_BLOCK - 1) // _CUDA_BLOCK, _CUDA_BLOCK](bits, p16, int(off), bf16)

    def _unscale_opencl(self, grads: List[Any], inv: np.float32, bf16: bool) -> bool:
        import pyopencl as cl

        ctx = self.backend.ctx
        k = _opencl_kernels(ctx)
        cl.enqueue_fill_buffer(ctx.queue, k["found"], np.zeros(1, np.int32), 0, 4)
        out, out_off, _ = _cl_parts(self._grads32, 4)
        offsets, _ = self._chunks()
        for g, off in zip(grads, offsets):
            buf, g_off, n = _cl_parts(g, 2)
            if n:
                k["unscale"](ctx.queue, (_round_up(n, _CUDA_BLOCK),), None, buf, g_off, out,
                             np.uint64(int(out_off) + int(off)), np.uint32(n), inv, np.int32(bf16), k["found"])
        found = np.zeros(1, np.int32)
        cl.enqueue_copy(ctx.queue, found, k["found"])  # blocking: the flag decides the step
        return bool(found[0])

    def _narrow_opencl(self, params: List[Any], bf16: bool) -> None:
        ctx = self.backend.ctx
        k = _opencl_kernels(ctx)
        master, m_off, _ = _cl_parts(self._master, 4)
        offsets, _ = self._chunks()
        for p, off in zip(params, offsets):
            buf, p_off, n = _cl_parts(p, 2)
            if n:
                k["narrow"](ctx.queue, (_round_up(n, _CUDA_BLOCK),), None, master, np.uint64(int(m_off) + int(off)),
                            buf, p_off, np.uint32(n), np.int32(bf16))

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        return {"param_dtype": self.config.param_dtype.name, "master": self.master_weights(),
                "inner": self.inner.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s checkpoint; everything is checked before anything changes."""
        keys = {"param_dtype", "master", "inner", "scaler"}
        if not isinstance(state_dict, Mapping) or set(state_dict) != keys:
            raise InvalidParameterError(f"state_dict keys {sorted(state_dict) if isinstance(state_dict, Mapping) else state_dict!r}, expected {sorted(keys)}")
        if state_dict["param_dtype"] != self.config.param_dtype.name:
            raise InvalidParameterError(f"state_dict is for {state_dict['param_dtype']!r} parameters, expected {self.config.param_dtype.name!r}")
        if not isinstance(state_dict["inner"], Mapping):
            raise InvalidParameterError(f"state_dict['inner'] of type {type(state_dict['inner']).__name__}, expected the inner optimizer's state_dict")
        master = [np.asarray(m, dtype=np.float32) for m in state_dict["master"]]
        shapes = [tuple(m.shape) for m in master]
        inner_shapes = [tuple(s) for s in state_dict["inner"].get("shapes", [])]
        if inner_shapes and inner_shapes != shapes:
            raise ShapeMismatchError(f"master weight shapes {shapes} differ from the optimizer state's {inner_shapes}")
        probe = self.config.make_scaler()
        probe.load_state_dict(state_dict["scaler"])  # validates
        self.inner.load_state_dict(state_dict["inner"])
        self.scaler = probe
        if master:
            self._install_master(np.concatenate([m.reshape(-1) for m in master]), shapes)
        else:
            self._master = self._grads32 = None
            self._shapes, self._master_views, self._grad_views = None, [], []

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.inner!r}, {self.config.param_dtype.name}, {self.scaler!r})"


def _dtype_of(a: Any) -> Optional[np.dtype]:
    """numpy/numba/pyopencl arrays carry a numpy dtype; other CUDA arrays (torch, CuPy) say it in
    ``__cuda_array_interface__``."""
    dt = getattr(a, "dtype", None)
    if isinstance(dt, np.dtype):
        return dt
    try:
        return np.dtype(a.__cuda_array_interface__["typestr"])
    except (AttributeError, KeyError, TypeError):
        pass
    try:
        return np.dtype(dt)
    except TypeError:
        return None


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def _as_numba(cuda: Any, a: Any):
    return a if _is_numba_device_array(a) else cuda.as_cuda_array(a)
