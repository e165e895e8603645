"""Quantization-aware training around any optirs optimizer: :class:`QatConfig`, :class:`QatOptimizer`.

The numerics (quantization parameters, observers, fake-quant, FP8) are those of
:mod:`optirs.analysis.quantization`; integer fake-quant runs on the host reference or through the
``fake_quant`` capability of the backend the config names (never by comparing backend names).
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from optirs.analysis.quantization import (CAPABILITY, EPS, HOST_REFERENCE, Fp8Format, IntDtype, Observer, QuantParams,
                                          QuantScheme, QuantTarget, RoundingMode, _enum, _int, fake_quant_backend,
                                          fake_quant_fp8, fake_quant_int, fake_quant_int_per_channel, observe_min_max,
                                          seed_keys)
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError

__all__ = ["QatConfig", "QatOptimizer"]

_F32 = np.float32


def _check_backend_name(backend: Any) -> None:
    """The host reference, or a backend the registry knows (opened by QatOptimizer, not here)."""
    if not isinstance(backend, str) or not backend:
        raise InvalidParameterError(f"backend={backend!r}, expected a backend name")
    if backend == HOST_REFERENCE:
        return
    from optirs.plugin.registry import REGISTRY

    known = REGISTRY.backend_names()
    if backend not in known:
        raise UnsupportedOperationError(
            f"backend={backend!r}, expected {HOST_REFERENCE!r} or one of the known backends {sorted(known)}")


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
    :param backend: where integer fake-quant runs: ``"numpy"`` (the host reference) or the name of a
        backend with the ``fake_quant`` capability (``"cpu"``, ``"cuda"``, ``"opencl"``, ...).
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
    backend: str = HOST_REFERENCE

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
            seed_keys(self.seed)
        _check_backend_name(self.backend)
        if isinstance(dtype, IntDtype):
            # Check the range and scheme combination now, not at the first step.
            QuantParams.from_min_max(_F32(-1), _F32(1), dtype, self.scheme, reduce_range=self.reduce_range,
                                     quant_min=self.quant_min, quant_max=self.quant_max, eps=self.eps)
        else:
            if self.backend != HOST_REFERENCE:
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
        # The bound backend for integer fake-quant (None: the host reference). Opened now, and its
        # kernels compiled, so a backend that cannot open or lacks the capability fails here.
        self._backend = None
        if isinstance(self.config.dtype, IntDtype):
            self._backend = fake_quant_backend(self.config.backend)
        if self._backend is not None:
            self._backend.hook(CAPABILITY, "optirs_fake_quant_backward")
            fake_quant_int(np.zeros(1, np.float32), QuantParams(1.0, 0, -128, 127), backend=self._backend)
        self._observers: List[Observer] = []
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
        return fn(x, qp, rounding=cfg.rounding, seed=seed,
                  backend=HOST_REFERENCE if self._backend is None else self._backend)

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
                lo, hi = observe_min_max(g, axis)
                qp = self._params_for(lo, hi, axis)
                qgrads.append(self._fake_quant(g, qp, self._stream(step, i, 1)))
            glist = qgrads
        self.inner.step_gpu(plist if isinstance(params, (list, tuple)) else plist[0],
                            glist if isinstance(grads, (list, tuple)) else glist[0])
        observers = self._observers or [Observer(self._axis_for(s), cfg.observer == "moving_average",
                                                  cfg.averaging_constant) for s in shapes]
        frozen = cfg.freeze_observers_after is not None and self._step >= cfg.freeze_observers_after
        new_obs = []
        for i, (p, ob) in enumerate(zip(plist, observers)):
            nob = Observer(ob.axis, ob.moving, float(ob.c))
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
            ob = Observer(axis, config.observer == "moving_average", config.averaging_constant)
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
