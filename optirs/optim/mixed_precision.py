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

On a backend with the ``formats`` capability (docs/formats.md) the step is the fused format
step: the inner optimizer runs ``Precision(master_weights="float32")`` over the half
parameters, one launch decodes the masters, steps them and writes the rounded parameters, and
the gradients' non-finite check (the step's ``check_finite`` control) sets the step's device
``found_inf`` flag, so an overflow skips the launch's writes without a host round trip before it. The loss scale is
divided out inside the step through the scalars' ``grad_factor``; only a loss scale below 1
(whose unscaling can overflow a finite half gradient, which the check cannot see) runs the
unscale pass below into float32 gradients first.

On other backends the two passes of the ``"mixed_precision"`` capability (hooks in
:mod:`optirs.plugin.hookspecs`) run around the inner optimizer: the built-in backends implement them in
``optirs/backends/<backend>/mixed_precision.py`` (the per-element conversions, integer and
exact-float32 arithmetic shared by numba on cpu and cuda, are in
:mod:`optirs.backends.common.half`); this module only drives them through ``backend.hook``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from optirs.core import checkpoint as ck
from optirs.core.arrays import check_no_overlap
from optirs.core.errors import InvalidParameterError, ShapeMismatchError
from optirs.core.params import fits_float32
from optirs.core.layout import TensorLayout

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
        ck.mapping(state, "scaler state", {"scale", "growth_tracker", "hysteresis_tracker", "stats"})
        scale = state["scale"]
        if (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating))
                or not fits_float32(scale) or scale <= 0.0 or np.float32(scale) == 0.0):
            raise InvalidParameterError(f"scale={scale!r}, expected a positive scale finite in float32")
        tracker = state["growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, (int, np.integer)) or not 0 <= tracker < self.growth_interval:
            raise InvalidParameterError(f"growth_tracker={tracker!r}, expected 0 <= growth_tracker < {self.growth_interval}")
        hyst = state["hysteresis_tracker"]
        if isinstance(hyst, bool) or not isinstance(hyst, (int, np.integer)) or hyst > self.hysteresis:
            raise InvalidParameterError(f"hysteresis_tracker={hyst!r}, expected an integer <= {self.hysteresis}")
        ck.integer(hyst, "hysteresis_tracker", -ck.INT64_MAX, self.hysteresis)
        raw = ck.mapping(state["stats"], "stats", [f.name for f in dataclass_fields(OverflowStats)])
        counts = {k: ck.integer(v, f"stats[{k!r}]") for k, v in raw.items() if k != "last_overflow_step"}
        last = raw["last_overflow_step"]
        counts["last_overflow_step"] = None if last is None else ck.integer(last, "stats['last_overflow_step']")
        stats = OverflowStats(**counts)
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


# ----------------------------------------------------------------------------- the optimizer wrapper


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
    The passes are the inner optimizer's backend's ``mixed_precision`` capability (the hooks
    ``optirs_mixed_precision_describe``, ``_unscale`` and ``_narrow``); a backend without it
    raises :class:`~optirs.core.errors.UnsupportedOperationError` on the first step.
    """

    CAPABILITY = "mixed_precision"

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
        self._layout: Optional[TensorLayout] = None  # the backends keep per-model data in its cache
        self._fused: Optional[bool] = None  # the formats capability runs the step (decided at first use)

    # ------------------------------------------------------------ properties

    @property
    def backend(self):
        """The inner optimizer's bound backend (an :class:`optirs.plugin.registry.Backend`)."""
        return self.inner.backend

    def _hook(self, name: str) -> Callable:
        """The backend's implementation of a mixed-precision hook; raises UnsupportedOperationError
        naming the backend and the capability when it has none."""
        return self.backend.hook(self.CAPABILITY, name)

    def _uses_formats(self) -> bool:
        """Whether the backend's ``formats`` capability runs the step (then the inner optimizer
        keeps float32 masters of the half parameters itself)."""
        if self._fused is None:
            from optirs.core.formats import Precision

            self._fused = self.inner.name in self.backend.support.formats
            if self._fused:
                inner = self.inner.precision
                self.inner.precision = Precision(master_weights="float32", state_dtype=inner.state_dtype, seed=inner.seed)
        return self._fused

    @property
    def step_count(self) -> int:
        """Applied steps (the inner optimizer's count); skipped steps are in ``scaler.stats``."""
        return self.inner.step_count

    def master_weights(self) -> List[np.ndarray]:
        """Host float32 copies of the master weights, shaped like the parameters (empty before step 1)."""
        if self._fused:
            return self.inner.engine.master_weights() or []
        if self._master is None:
            return []
        backend = self.backend
        flat = np.asarray(backend.to_host(backend.ctx, self._master), dtype=np.float32).reshape(-1)
        return [v.copy() for v in self._layout.views(flat)]

    # ------------------------------------------------------------ validation

    def _validate(self, params: List[Any], grads: List[Any]) -> List[Tuple[int, ...]]:
        if len(params) != len(grads):
            raise ShapeMismatchError(f"{len(params)} params and {len(grads)} grads, expected one gradient per parameter")
        backend = self.backend
        describe = self._hook("optirs_mixed_precision_describe")
        want = self.config.param_dtype
        shapes, param_metas, grad_metas = [], [], []
        for i, (p, g) in enumerate(zip(params, grads)):
            metas = []
            for a, label in ((p, "params"), (g, "grads")):
                meta = describe(backend.ctx, a, f"{label}[{i}]", want)
                if meta.dtype != want:
                    raise ShapeMismatchError(f"{label}[{i}] has dtype {meta.dtype}, expected {want} (MixedPrecisionConfig.param_dtype)")
                if not meta.contiguous:
                    raise ShapeMismatchError(f"{label}[{i}] is not C-contiguous, expected a contiguous array")
                metas.append(meta)
            pm, gm = metas
            if tuple(gm.shape) != tuple(pm.shape):
                raise ShapeMismatchError(f"grads[{i}] has shape {tuple(gm.shape)}, expected {tuple(pm.shape)} like params[{i}]")
            if not pm.writeable:
                raise ShapeMismatchError(f"params[{i}] is read-only, expected a writeable array (updated in place)")
            param_metas.append(pm)
            grad_metas.append(gm)
            shapes.append(tuple(int(d) for d in pm.shape))
        check_no_overlap(param_metas, grad_metas)  # the same rule as GpuOptimizer's (optirs.core.arrays)
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
        host = [np.asarray(backend.to_host(backend.ctx, p)).view(self.config.param_dtype).astype(np.float32)
                for p in params]
        self._install_master(host, shapes)

    def _install_master(self, host: List[np.ndarray], shapes) -> None:
        """Flat device masters (``host``, one float32 array a tensor) and float32 gradients, packed at
        the layout's offsets: the inner step addresses every view on the kernels' vector grid."""
        backend = self.backend
        layout = TensorLayout(list(shapes))
        master = backend.to_device(backend.ctx, layout.pack(host))
        grads32 = backend.alloc(backend.ctx, layout.total, np.float32, 0.0)
        # The inner optimizer is always handed these same view objects, so its per-list caches hit.
        mviews, gviews = layout.views(master), layout.views(grads32)
        self._master, self._grads32, self._master_views, self._grad_views = master, grads32, mviews, gviews
        self._shapes, self._layout = list(shapes), layout

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
        if self._uses_formats():
            return self._fused_step(plist, glist)
        backend = self.backend
        # Every hook is looked up before anything changes: a backend without the capability refuses here.
        unscale = self._hook("optirs_mixed_precision_unscale")
        narrow = self._hook("optirs_mixed_precision_narrow")
        shapes = self._validate(plist, glist)
        bf16 = self.config.is_bfloat16
        fresh = self._master is None
        if fresh:
            self._init_buffers(plist, shapes)
        try:
            found_inf = bool(unscale(backend.ctx, glist, self._grads32, self._layout, self.scaler.inv_scale, bf16))
            if not found_inf:
                self.inner.step_gpu(self._master_views, self._grad_views)
        except BaseException:
            if fresh:  # a failed first step leaves the wrapper as it was
                self._clear_master()
            raise
        if not found_inf:
            narrow(backend.ctx, self._master, plist, self._layout, bf16)
        return self.scaler.update(found_inf)

    def _check_dtypes(self, plist: List[Any], glist: List[Any]) -> None:
        """The wrapper's own rule: parameters and gradients all of ``config.param_dtype`` (device
        arrays of bfloat16 may hold it as their uint16/int16 patterns)."""
        from optirs.core.arrays import as_16bit, describe

        want = self.config.param_dtype
        for label, arrays in (("params", plist), ("grads", glist)):
            for i, a in enumerate(arrays):
                dtype = as_16bit(describe(a, f"{label}[{i}]"), want).dtype
                if dtype != want:
                    raise ShapeMismatchError(f"{label}[{i}] has dtype {dtype}, expected {want} (MixedPrecisionConfig.param_dtype)")

    def _bits_as(self) -> Any:
        """bfloat16 device arrays come as their 16-bit patterns (numba has no bfloat16)."""
        return self.config.param_dtype if self.config.is_bfloat16 else None

    def _fused_step(self, plist: List[Any], glist: List[Any]) -> bool:
        """The step as one format launch over float32 masters (module docstring)."""
        inner, backend = self.inner, self.backend
        engine = inner.engine
        with engine.lock:
            self._check_dtypes(plist, glist)
            _, shapes, fmt = inner.check_arrays(plist, glist, bits_as=self._bits_as())
            inv = self.scaler.inv_scale
            if inv > np.float32(1.0):
                # A loss scale below 1 can overflow a finite half gradient when unscaled, which the
                # gradients' check cannot see: the unscale pass writes float32 gradients and flags it.
                unscale = self._hook("optirs_mixed_precision_unscale")
                if self._grads32 is None or self._shapes != list(shapes):
                    self._install_grads32(list(shapes))
                if bool(unscale(backend.ctx, glist, self._grads32, self._layout, inv, self.config.is_bfloat16)):
                    return self.scaler.update(True)
                _, shapes, fmt = inner.check_arrays(plist, self._grad_views, bits_as=self._bits_as())
                applied = engine.step(plist, self._grad_views, shapes=shapes, hp=inner.params, fmt=fmt,
                                      seed=inner.precision.seed)
                return self.scaler.update(not applied)
            # the loss scale divided out inside the step: no pass of its own
            applied = engine.step(plist, glist, shapes=shapes, hp=inner.params, fmt=fmt, grad_factor=float(inv),
                                  check_finite=True, seed=inner.precision.seed)
        return self.scaler.update(not applied)

    def _install_grads32(self, shapes) -> None:
        backend = self.backend
        layout = TensorLayout(list(shapes))
        self._grads32 = backend.alloc(backend.ctx, layout.total, np.float32, 0.0)
        self._grad_views = layout.views(self._grads32)
        self._shapes, self._layout = list(shapes), layout

    def _clear_master(self) -> None:
        self._master = self._grads32 = None
        self._shapes, self._master_views, self._grad_views, self._layout = None, [], [], None

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
        master = [ck.float32_array(m, f"state_dict['master'][{i}]")
                  for i, m in enumerate(ck.sequence(state_dict["master"], "state_dict['master']"))]
        shapes = [tuple(m.shape) for m in master]
        inner_shapes = ck.shapes(state_dict["inner"].get("shapes", []), "state_dict['inner']['shapes']")
        if inner_shapes and inner_shapes != shapes:
            raise ShapeMismatchError(f"master weight shapes {shapes} differ from the optimizer state's {inner_shapes}")
        probe = self.config.make_scaler()
        probe.load_state_dict(state_dict["scaler"])  # validates
        fused = self._uses_formats()
        if fused != ("format" in state_dict["inner"]) and state_dict["inner"].get("state"):
            raise InvalidParameterError(
                "state_dict['inner'] holds " + ("float32 state of master weights" if fused else "a format step's state")
                + f", expected the state of this backend's {'fused format' if fused else 'three-pass'} step "
                "(checkpoints move between backends with and without the formats capability only at step 0)")
        self.inner.load_state_dict(state_dict["inner"])
        self.scaler = probe
        if fused:
            return  # the masters are the inner optimizer's format state
        if master:
            self._install_master(master, shapes)
        else:
            self._clear_master()

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.inner!r}, {self.config.param_dtype.name}, {self.scaler!r})"

