"""The optimizers: a common base that validates, owns the state and calls the chosen backend.

State (moments, accumulators) is one flat buffer per slot on the backend's device, laid out by
:class:`optirs.core.layout.TensorLayout`; the step count is kept on the host. The per-step scalars are
computed on the host in float64 (:mod:`optirs.core.scalars`). Every check runs before anything is
modified, so a failed call leaves parameters and state as they were.

A step is a transaction: stage -> step -> finish -> count, under the backend's lock (other
optimizers on the same context share its staging buffers) and with SIGINT deferred
(:mod:`optirs.core.interrupts`), so a KeyboardInterrupt lands before or after it. One optimizer
runs one step, checkpoint or move at a time (its own lock), whatever the threads.

Formats (docs/formats.md): ``precision=Precision(...)`` says how 16-bit parameters are backed
and how the state is stored. float32 parameters with float32 state run the ordinary step hook;
every other format runs the backend's ``formats`` capability (:mod:`optirs.optim.formats`) in
the same transaction.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, ClassVar, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from optirs.core import checkpoint as ck
from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.arrays import as_16bit, check_no_overlap, describe
from optirs.core.errors import BackendUnavailableError, InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.formats import PARAM_DTYPES, Precision, StepFormat, dtype_name, resolve_format
from optirs.optim import formats as fm
from optirs.optim.engine import StepEngine, run_steps
from optirs.plugin.registry import REGISTRY, Backend

STATE_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True)
class GpuOptimizerConfig:
    """Where an optimizer runs.

    :param backend: a backend name (``"cuda"``, ``"opencl"``, ``"cpu"``, a plugin's name) or
        ``"auto"``: the fastest kind of device found (a GPU or accelerator, else the host's own
        ``cpu`` backend; ``optirs.plugin.registry.choose_auto()`` says which and why). An unknown name raises
        BackendUnavailableError when the optimizer is made (``check_backend``), not at its first step.
    :param device: device index or name substring (backends that have several devices).
    :param platform: OpenCL platform index or name substring.
    :param options: further backend-specific options.
    """

    backend: str = "auto"
    device: Optional[Union[int, str]] = None
    platform: Optional[Union[int, str]] = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise InvalidParameterError(f"backend={self.backend!r}, expected a backend name or 'auto'")

    def check_backend(self) -> None:
        """Raise BackendUnavailableError unless the backend name is known to the registry (no probing)."""
        REGISTRY.check_backend_name(self.backend)

    def backend_options(self) -> Dict[str, Any]:
        opts = dict(self.options)
        if self.device is not None:
            opts["device"] = self.device
        if self.platform is not None:
            opts["platform"] = self.platform
        return opts


ArrayOrList = Union[Any, Sequence[Any]]


_WRITEABLE = attrgetter("flags.writeable")


def _is_torch(array: Any) -> bool:
    """A torch tensor: CPU ones are stepped through numpy views, CUDA ones detached (a tensor that
    requires grad refuses to export ``__cuda_array_interface__``); torch is imported by then."""
    return type(array).__module__.startswith("torch")


def _mutable_in_place(params: List[Any], grads: List[Any]) -> tuple:
    """What a validated array can change under the same object, to re-check on every repeat call:
    a torch tensor's storage (``tensor.data = ...``: its data pointer) and a numpy parameter's
    writeable flag. Device arrays of numba, CuPy and pyopencl keep their memory and flags for life,
    so a step over them re-checks nothing per tensor."""
    return ([(a, a.data_ptr()) for a in params + grads if hasattr(a, "data_ptr")] or None,
            [p for p in params if isinstance(p, np.ndarray)] or None)


def _unchanged(mutable: tuple) -> bool:
    pointers, host = mutable
    if host is not None and not all(map(_WRITEABLE, host)):
        return False
    return pointers is None or all(a.data_ptr() == ptr for a, ptr in pointers)


def _serialized(method):
    """The method under the optimizer's own lock: one step, checkpoint or move at a time."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


def _numpy_checkpoint(value: Any) -> Any:
    """``value`` with torch tensors (a portable checkpoint's) as numpy copies, exactly (bfloat16
    as ml_dtypes.bfloat16); anything else unchanged. torch is only looked at where it is imported."""
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        from optirs.torch.interop import host_array

        return np.array(host_array(value.detach().cpu()), copy=True)
    if isinstance(value, Mapping):
        return {k: _numpy_checkpoint(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numpy_checkpoint(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_numpy_checkpoint(v) for v in value)
    return value


class GpuOptimizer:
    """Base of every optimizer; each subclass is made from one :class:`OptimizerDefinition`.

    The seed API's front door over a :class:`~optirs.optim.engine.StepEngine` (:attr:`engine`): it
    checks the caller's arrays (cached per list of arrays, re-checking what can change under the
    same objects), resolves the step format from their dtypes and ``precision``, and steps
    through the engine's transaction.
    """

    name: ClassVar[str]
    params_type: ClassVar[type]
    definition: ClassVar[OptimizerDefinition]
    # Parameter dtypes this optimizer steps: float32 directly, 16-bit ones through the formats
    # capability as ``precision`` says (bfloat16 as ml_dtypes.bfloat16).
    param_dtypes: ClassVar[tuple] = PARAM_DTYPES

    def __init__(self, params: Any = None, config: Optional[GpuOptimizerConfig] = None, *,
                 precision: Optional[Precision] = None):
        self._params = self._check_params(self.default_params() if params is None else params)
        if config is not None and not isinstance(config, GpuOptimizerConfig):
            raise InvalidParameterError(f"config={config!r}, expected a GpuOptimizerConfig")
        if precision is not None and not isinstance(precision, Precision):
            raise InvalidParameterError(f"precision={precision!r}, expected an optirs.Precision")
        self.precision = precision or Precision()
        self.config = config or GpuOptimizerConfig()
        self.config.check_backend()
        self._engine: Optional[StepEngine] = None
        # A checkpoint loaded before the backend was opened waits here for the engine.
        self._pending: Optional[tuple] = None
        self._lock = threading.RLock()
        # The last (params, grads) lists that passed validation, kept alive so their ids stay
        # theirs: a training loop passes the same arrays every step, and re-describing hundreds
        # of device arrays would cost more host time than the step itself. What can change under
        # the same objects is re-checked on every call (_mutable_in_place).
        self._validated: Optional[tuple] = None

    # ------------------------------------------------------------ hyperparameters

    def default_params(self):
        return self.definition.default_params()

    def _check_params(self, params: Any):
        if not isinstance(params, self.params_type):
            raise InvalidParameterError(
                f"params={params!r}, expected {self.params_type.__name__} for {type(self).__name__}"
            )
        return params

    @property
    def params(self):
        """The hyperparameters; assign a new record to change them between steps (lr schedules)."""
        return self._params

    @params.setter
    def params(self, params: Any) -> None:
        params = self._check_params(params)
        held = self._held_slots()
        if held is not None and self.state_slots(params) != held:
            raise InvalidParameterError(
                f"params={params!r} need state slots {sorted(self.state_slots(params))}, but the optimizer holds "
                f"{sorted(held)}; expected hyperparameters that keep the same state"
            )
        self._params = params

    def _held_slots(self) -> Optional[Dict[str, float]]:
        if self._engine is not None and self._engine.state is not None:
            return self._engine.slots
        if self._pending is not None and self._pending[1]:
            return self.state_slots(self._params)
        return None

    def state_slots(self, params) -> Dict[str, float]:
        """Slot name -> initial value of every per-element state buffer these hyperparameters need."""
        return self.definition.state_slots(params)

    def step_scalars(self, step: int) -> NamedTuple:
        """The per-step scalars for 1-based step ``step``."""
        return self.definition.scalars(self._params, step)

    # ------------------------------------------------------------ backend, engine and state placement

    @property
    def backend(self) -> Backend:
        """The opened backend (opened on first use)."""
        return self.engine.backend

    @property
    def engine(self) -> StepEngine:
        """The :class:`~optirs.optim.engine.StepEngine` that holds the state and steps (the backend opens on first use)."""
        engine = self._engine
        if engine is None:
            with self._lock:
                if self._engine is None:
                    backend = REGISTRY.get_backend(self.config.backend, self.config.backend_options())
                    engine = StepEngine(self.definition, backend)
                    if self._pending is not None:
                        engine.restore(*self._pending)
                        self._pending = None
                    self._engine = engine
                engine = self._engine
        return engine

    @property
    def step_count(self) -> int:
        if self._engine is None:
            return self._pending[0] if self._pending is not None else 0
        return self._engine.step_count

    @property
    def state_on_device(self) -> bool:
        return self._engine is not None and self._engine.state_on_device

    def move_to_gpu(self) -> None:
        """Open the backend and make the state device-resident (no-op where it already is)."""
        self.engine.to_device()

    def move_to_cpu(self) -> None:
        """Bring the state back to host memory (numpy); the next step sends it back."""
        if self._engine is not None:
            self._engine.to_host()

    # ------------------------------------------------------------ the step

    @staticmethod
    def _as_list(arrays: ArrayOrList, what: str) -> List[Any]:
        if isinstance(arrays, (list, tuple)):
            if not arrays:
                raise InvalidParameterError(f"{what}=[], expected at least one array")
            return list(arrays)
        return [arrays]

    def check_arrays(self, params: List[Any], grads: List[Any], originals: Optional[tuple] = None,
                     bits_as: Any = None) -> tuple:
        """(metas of the parameters, the step's StepFormat) of one step's arrays, checked once per
        list of arrays (what can change under the same objects is re-checked every call).

        ``originals``: the (params, grads) the caller passed when ``params``/``grads`` are views
        made for this call (torch tensors as numpy views or detached tensors, new objects every
        step): the cache is keyed by the caller's objects and re-checks their storage.
        ``bits_as``: the 16-bit dtype that device arrays of uint16/int16 patterns hold (numba and
        CuPy have no bfloat16, so bfloat16 device arrays travel as their bits)."""
        op, og = originals if originals is not None else (params, grads)
        key = (tuple(map(id, op)), tuple(map(id, og)), bits_as)
        hit = self._validated
        if hit is not None and hit[0] == key and _unchanged(hit[3]):
            return hit[2]
        # A changed array is described again: a repeat call refuses exactly what a first call would.
        self._validated = None
        checked = self._describe_all(params, grads, bits_as)
        self._validated = (key, (op, og), checked, _mutable_in_place(op, og))
        return checked

    def _describe_all(self, params: List[Any], grads: List[Any], bits_as: Any = None) -> tuple:
        if len(params) != len(grads):
            raise ShapeMismatchError(f"{len(params)} params and {len(grads)} grads, expected one gradient per parameter")
        metas, grad_metas = [], []
        for i, (p, g) in enumerate(zip(params, grads)):
            pm, gm = describe(p, f"params[{i}]"), describe(g, f"grads[{i}]")
            if bits_as is not None:
                pm, gm = as_16bit(pm, bits_as), as_16bit(gm, bits_as)
            for m, label in ((pm, "params"), (gm, "grads")):
                if not m.dtype.isnative:  # a byte-swapped float32 still names itself float32
                    raise ShapeMismatchError(f"{label}[{i}] has dtype {m.dtype.str} (non-native byte order), expected "
                                             "native byte order")
            if dtype_name(pm.dtype) not in self.param_dtypes:
                raise ShapeMismatchError(
                    f"params[{i}] has dtype {pm.dtype}, expected one of {list(self.param_dtypes)}"
                )
            if i and pm.dtype != metas[0].dtype:
                raise ShapeMismatchError(f"params[{i}] has dtype {pm.dtype}, expected {metas[0].dtype} like params[0] "
                                         "(one step runs one parameter dtype)")
            if gm.dtype != pm.dtype and not (pm.dtype != STATE_DTYPE and gm.dtype == STATE_DTYPE):
                also = " or float32" if pm.dtype != STATE_DTYPE else ""
                raise ShapeMismatchError(f"grads[{i}] has dtype {gm.dtype}, expected {pm.dtype}{also} like params[{i}]")
            if i and gm.dtype != grad_metas[0].dtype:
                raise ShapeMismatchError(f"grads[{i}] has dtype {gm.dtype}, expected {grad_metas[0].dtype} like grads[0]")
            if gm.shape != pm.shape:
                raise ShapeMismatchError(f"grads[{i}] has shape {gm.shape}, expected {pm.shape} like params[{i}]")
            if pm.kind != gm.kind:
                raise ShapeMismatchError(f"params[{i}] is a {pm.kind} array but grads[{i}] a {gm.kind} array, expected the same kind")
            for m, label in ((pm, "params"), (gm, "grads")):
                if not m.contiguous:
                    raise ShapeMismatchError(f"{label}[{i}] is not C-contiguous, expected a contiguous array")
            if not pm.writeable:
                raise ShapeMismatchError(f"params[{i}] is read-only, expected a writeable array (updated in place)")
            metas.append(pm)
            grad_metas.append(gm)
        # Real memory identities (pointer or cl_mem handle, byte offset, byte size): no parameter may
        # share a byte with another parameter or with any gradient; gradients may share (read-only).
        check_no_overlap(metas, grad_metas)
        fmt = resolve_format(self.precision, metas[0].dtype, grad_metas[0].dtype, self.definition.kernel)
        return metas, [m.shape for m in metas], fmt

    def step_gpu(self, params: ArrayOrList, grads: ArrayOrList, *, found_inf: Any = None,
                 grad_factor: float = 1.0) -> bool:
        """One optimizer step over one array or a list of arrays, updating ``params`` in place;
        returns whether it was applied.

        numpy inputs are uploaded, stepped and written back; the backend's own device arrays are
        stepped in place; torch CPU tensors are stepped through numpy views of their memory.
        Everything is checked first: on error nothing has changed. A plugin's own exception
        surfaces as a PluginError and the step is not counted.

        ``found_inf`` (torch's fused optimizers' flag, computed by a pass that reads every gradient
        anyway, such as a loss scaler's unscale): None steps as usual; a bool, ``numpy.bool_`` or a
        1-element array (numpy, or this backend's 1-element int32 device array, read on the device)
        that is nonzero skips the whole step: parameters, state and ``step_count`` stay as they were.
        ``grad_factor`` multiplies every gradient first (a loss scaler's ``1 / scale``; -1 maximizes).
        """
        plist, glist = self._as_list(params, "params"), self._as_list(grads, "grads")
        originals = None
        if _is_torch(plist[0]) or _is_torch(glist[0]):  # zero-copy numpy views, detached CUDA tensors
            from optirs.torch.interop import host_arrays

            originals = (plist, glist)
            plist, glist = host_arrays(plist), host_arrays(glist)
        engine = self.engine
        with self._lock:  # inline rather than _serialized: this is the hot path
            found_inf = self._check_found_inf(found_inf, engine)
            _, shapes, fmt = self.check_arrays(plist, glist, originals)
            prepared = engine.prepare(plist, glist, shapes=shapes, hp=self._params, fmt=fmt, grad_factor=grad_factor,
                                      found_inf=found_inf, seed=self.precision.seed)
            run_steps([prepared])
            return prepared.applied

    def _check_found_inf(self, found_inf: Any, engine: StepEngine) -> Any:
        """``step_gpu``'s ``found_inf``, checked: None, a host bool / numpy array, or a device flag of this backend."""
        if found_inf is None or isinstance(found_inf, (bool, np.bool_, np.ndarray)):
            if isinstance(found_inf, np.ndarray) and found_inf.size != 1:
                raise InvalidParameterError(f"found_inf has {found_inf.size} elements, expected a bool or a 1-element array")
            return found_inf
        meta = describe(found_inf, "found_inf")  # an array kind optirs does not know is refused here
        if meta.size != 1:
            raise InvalidParameterError(f"found_inf has {meta.size} elements, expected a bool or a 1-element array")
        if meta.dtype != np.int32:
            # the device reads an int32 flag: anything else is read back here
            backend = engine.backend
            try:
                return np.asarray(backend.to_host(backend.ctx, found_inf)).reshape(-1)
            except Exception as exc:
                raise InvalidParameterError(f"found_inf could not be read back by the {backend.name} backend "
                                            f"({exc}), expected a bool, a numpy array or this backend's array") from exc
        return found_inf

    # ------------------------------------------------------------ checkpoints

    def state_dict(self, portable: bool = False) -> Dict[str, Any]:
        """A self-contained checkpoint (numpy copies), from the device or the host side.

        ``portable=True``: the same checkpoint with every array as a torch CPU tensor (bfloat16
        state as torch.bfloat16), the form ``torch.save`` / ``torch.load(weights_only=True)``
        round-trip (weights_only refuses numpy arrays; allow-listing numpy's reconstructors is
        the loader's decision, not ours). Needs torch. :meth:`load_state_dict` takes both forms.
        """
        if portable:
            try:
                from optirs.torch.interop import portable_state_dict
            except (ImportError, BackendUnavailableError) as exc:  # torch is optional
                raise UnsupportedOperationError(
                    f"state_dict(portable=True) needs PyTorch ({exc}), expected torch installed (or portable=False: "
                    "numpy arrays)") from exc
            return portable_state_dict(self.state_dict())
        if self._engine is not None:
            held = self._engine.checkpoint()
        elif self._pending is not None:
            held = _pending_checkpoint(self.definition, *self._pending)
        else:
            held = {"step": 0, "shapes": [], "state": []}
        return {"optimizer": self.name, "hyperparameters": self._params.to_dict(), **held}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint from :meth:`state_dict`; everything is checked before anything changes.

        Every hyperparameter must be present (a missing one would silently take its default);
        the step count is an integer in [0, int64 max) whose next step's scalars are finite in
        float32; state arrays must hold float32 values exactly (:mod:`optirs.core.checkpoint`).
        A checkpoint of a compact format (its ``format`` entry) must match this optimizer's
        ``precision`` and holds every buffer in its own dtype (uint8 codes, float32 scales,
        bfloat16 moments, int16/int8 remainders), restored as it is.
        """
        state_dict = _numpy_checkpoint(state_dict)  # state_dict(portable=True)'s torch tensors, as numpy
        expected_keys = {"optimizer", "hyperparameters", "step", "shapes", "state"}
        if isinstance(state_dict, Mapping) and "format" in state_dict:
            expected_keys.add("format")
        ck.mapping(state_dict, "state_dict", expected_keys)
        fmt = None
        if "format" in expected_keys:
            fmt = fm.load_format(state_dict["format"], self.precision, self.definition.kernel)
        if state_dict["optimizer"] != self.name:
            raise InvalidParameterError(f"state_dict is for optimizer {state_dict['optimizer']!r}, expected {self.name!r}")
        hp = ck.mapping(state_dict["hyperparameters"], "hyperparameters")
        names = [f.name for f in fields(self.params_type)]
        missing = [n for n in names if n not in hp]
        if missing:
            raise InvalidParameterError(
                f"hyperparameters lack {missing}, expected every {self.params_type.__name__} field {names}"
            )
        params = self._check_params(self.params_type.from_dict(dict(hp)))
        step = ck.integer(state_dict["step"], "step", 0, ck.INT64_MAX - 1)
        if step:
            self.definition.scalars(params, step + 1)  # the next step's scalars must exist (finite in float32)
        shapes = ck.shapes(state_dict["shapes"], "shapes")
        entries = ck.sequence(state_dict["state"], "state")
        restored = (step, shapes, entries, self.state_slots(params), fmt)
        if self._engine is not None:
            self._engine.restore(*restored)
        else:
            StepEngine(self.definition, None).restore(*restored)  # checked now; installed when the engine opens
            self._pending = restored
        self._params, self._validated = params, None

    # ------------------------------------------------------------ copies

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled (and deep-copied) as its configuration and checkpoint: the copy opens its own backend."""
        with self._lock:
            return {"params": self._params, "config": self.config, "precision": self.precision,
                    "checkpoint": self.state_dict()}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        type(self).__init__(self, state["params"], state["config"], precision=state["precision"])
        self.load_state_dict(state["checkpoint"])

    def __repr__(self) -> str:
        where = self._engine.backend.name if self._engine else self.config.backend
        return f"{type(self).__name__}({self._params!r}, backend={where!r}, step={self.step_count})"


def _pending_checkpoint(definition: OptimizerDefinition, step: int, shapes: list, entries: list, slots: dict,
                        fmt: Optional[StepFormat]) -> Dict[str, Any]:
    """The checkpoint of a state restored before the backend was opened (held on the host)."""
    engine = StepEngine(definition, None)
    engine.restore(step, shapes, entries, slots, fmt)
    return engine.checkpoint()


# One step, checkpoint, restore, move or hyperparameter change at a time per optimizer (threads).
for _method in ("state_dict", "load_state_dict", "move_to_gpu", "move_to_cpu"):
    setattr(GpuOptimizer, _method, _serialized(getattr(GpuOptimizer, _method)))
GpuOptimizer.params = GpuOptimizer.params.setter(_serialized(GpuOptimizer.params.fset))  # type: ignore[attr-defined]
del _method


def optimizer_class(definition: OptimizerDefinition) -> type:
    """The seed API's class for one optimizer definition (``GpuAdam`` for ``adam``)."""
    doc = f"{definition.summary}\n\n.. code-block:: text\n{definition.algorithm}\n"
    return type(definition.class_name, (GpuOptimizer,), {
        "__doc__": doc, "__module__": __name__, "name": definition.name,
        "params_type": definition.params_type, "definition": definition,
    })


# name -> class, one per definition; each class is also a module attribute (GpuAdam, GpuSgd, ...).
OPTIMIZERS: Dict[str, type] = {name: optimizer_class(d) for name, d in DEFINITIONS.items()}
globals().update({cls.__name__: cls for cls in OPTIMIZERS.values()})
