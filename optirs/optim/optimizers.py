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
from optirs.core.arrays import ArrayMeta, as_16bit, check_no_overlap, describe
from optirs.core.errors import BackendUnavailableError, InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.formats import PARAM_DTYPES, Precision, StepFormat, dtype_name, resolve_format
from optirs.core.interrupts import deferred_interrupts
from optirs.core.layout import TensorLayout
from optirs.optim import formats as fm
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
    """Base of every optimizer; each subclass is made from one :class:`OptimizerDefinition`."""

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
        # The format of the state held (None: float32 state of the ordinary step; set at the first step).
        self._format: Optional[StepFormat] = None
        self.config = config or GpuOptimizerConfig()
        self.config.check_backend()
        self._backend: Optional[Backend] = None
        self._layout: Optional[TensorLayout] = None
        self._state: Optional[Dict[str, Any]] = None
        self._state_on_device = False
        self._step = 0
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
        if self._state is not None and self.state_slots(params) != self.state_slots(self._params):
            raise InvalidParameterError(
                f"params={params!r} need state slots {sorted(self.state_slots(params))}, but the optimizer holds "
                f"{sorted(self.state_slots(self._params))}; expected hyperparameters that keep the same state"
            )
        self._params = params

    def state_slots(self, params) -> Dict[str, float]:
        """Slot name -> initial value of every per-element state buffer these hyperparameters need."""
        return self.definition.state_slots(params)

    def step_scalars(self, step: int) -> NamedTuple:
        """The per-step scalars for 1-based step ``step``."""
        return self.definition.scalars(self._params, step)

    # ------------------------------------------------------------ backend and state placement

    @property
    def backend(self) -> Backend:
        """The opened backend (opened on first use)."""
        if self._backend is None:
            self._backend = REGISTRY.get_backend(self.config.backend, self.config.backend_options())
        return self._backend

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def state_on_device(self) -> bool:
        return self._state_on_device

    def move_to_gpu(self) -> None:
        """Open the backend and make the state device-resident (no-op where it already is)."""
        backend = self.backend
        if self._state is not None and not self._state_on_device:
            moved = {k: backend.to_device(backend.ctx, v) for k, v in self._state.items()}
            self._state, self._state_on_device = moved, True

    def move_to_cpu(self) -> None:
        """Bring the state back to host memory (numpy); the next step sends it back."""
        if self._state is not None and self._state_on_device:
            self._state, self._state_on_device = self._host_state(), False

    def _host_state(self) -> Dict[str, np.ndarray]:
        assert self._state is not None
        if self._format is not None:
            return fm.host_buffers(self.backend if self._state_on_device else None, self._format_state(),
                                   self._state, self._state_on_device)
        if not self._state_on_device:
            return {k: v.copy() for k, v in self._state.items()}
        backend = self.backend
        return {k: np.asarray(backend.to_host(backend.ctx, v), dtype=STATE_DTYPE) for k, v in self._state.items()}

    # ------------------------------------------------------------ the step

    @staticmethod
    def _as_list(arrays: ArrayOrList, what: str) -> List[Any]:
        if isinstance(arrays, (list, tuple)):
            if not arrays:
                raise InvalidParameterError(f"{what}=[], expected at least one array")
            return list(arrays)
        return [arrays]

    def _validate(self, params: List[Any], grads: List[Any], originals: Optional[tuple] = None,
                  bits_as: Any = None) -> tuple:
        """(metas of the parameters, the step's StepFormat), checked once per list of arrays.

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
        shapes = [m.shape for m in metas]
        if self._layout is not None and not self._layout.matches(shapes):
            raise ShapeMismatchError(
                f"the parameter list changed: got {len(shapes)} tensors with shapes {shapes}, "
                f"expected {len(self._layout)} tensors with shapes {self._layout.shapes} as in earlier steps"
            )
        fmt = resolve_format(self.precision, metas[0].dtype, grad_metas[0].dtype, self.definition.kernel)
        if self._state is not None and not fm.same_storage(self._format, None if fmt.plain else fmt):
            held = fm.describe_format(self._format) if self._format else "float32 (the ordinary step)"
            raise ShapeMismatchError(
                f"the optimizer's state is in format {held}, but these arrays step as {fm.describe_format(fmt)}; "
                "expected parameters of the dtype of earlier steps")
        return metas, fmt

    def step_gpu(self, params: ArrayOrList, grads: ArrayOrList, *, found_inf: Any = None) -> None:
        """One optimizer step over one array or a list of arrays, updating ``params`` in place.

        numpy inputs are uploaded, stepped and written back; the backend's own device arrays are
        stepped in place; torch CPU tensors are stepped through numpy views of their memory.
        Everything is checked first: on error nothing has changed. A plugin's own exception
        surfaces as a PluginError and the step is not counted.

        ``found_inf`` (torch's fused optimizers' flag, computed by a pass that reads every gradient
        anyway, such as a loss scaler's unscale): None steps as usual; a bool, ``numpy.bool_`` or a
        1-element array (numpy, or this backend's device array, read back) that is nonzero skips
        the whole step: parameters, state and ``step_count`` stay as they were.
        """
        plist, glist = self._as_list(params, "params"), self._as_list(grads, "grads")
        originals = None
        if _is_torch(plist[0]) or _is_torch(glist[0]):  # zero-copy numpy views, detached CUDA tensors
            from optirs.torch.interop import host_arrays

            originals = (plist, glist)
            plist, glist = host_arrays(plist), host_arrays(glist)
        with self._lock:  # inline rather than _serialized: this is the hot path
            self._step_locked(plist, glist, found_inf, originals)

    def _step_locked(self, plist: List[Any], glist: List[Any], found_inf: Any = None,
                     originals: Optional[tuple] = None) -> None:
        skip = self._found_inf(found_inf)
        metas, fmt = self._validate(plist, glist, originals)
        if skip:
            return
        if not fmt.plain:
            self._format_step(plist, glist, metas, fmt)
            return
        backend = self.backend
        step = backend.step_fn(self.name)
        layout = self._layout or TensorLayout([m.shape for m in metas])
        scalars = self.step_scalars(self._step + 1)
        # The transaction: no other step on this context in between (shared staging buffers), and
        # a KeyboardInterrupt lands before it or after the count, never inside.
        # A plugin's own exception (not optirs' errors) becomes a PluginError naming it and the hook.
        with deferred_interrupts(), backend.lock:
            where = 0  # the hook running, named only if it raises
            try:
                if self._state is None:
                    slots = self.state_slots(self._params)
                    sizes = self.definition.state_layout(layout, tuple(slots)).buffer_sizes()
                    state = {k: backend.alloc(backend.ctx, sizes[k], STATE_DTYPE, float(fill)) for k, fill in slots.items()}
                else:
                    where = 1
                    self.move_to_gpu()
                    state = self._state
                where = 2
                staged = backend.stage(backend.ctx, plist, glist)
                where = 3
                step(backend.ctx, staged.params, staged.grads, state, layout, scalars)
                if staged.finish is not None:
                    where = 4
                    staged.finish()
            except Exception as exc:
                hook = ("optirs_alloc", "optirs_to_device", "optirs_stage", self.definition.hook, "optirs_stage's finish")[where]
                error = backend.plugin_error(exc, hook)
                if error is exc:
                    raise
                raise error from exc
            self._layout, self._state, self._state_on_device = layout, state, True
            self._step += 1

    def _format_state(self, layout: Optional[TensorLayout] = None, fmt: Optional[StepFormat] = None):
        """The :class:`~optirs.core.formats.FormatState` of the state held (or of ``layout``/``fmt``)."""
        layout, fmt = layout or self._layout, fmt or self._format
        cache = layout.cache.get("optirs.formats.state")
        if cache is None or cache[0] != (fmt, self.state_slots(self._params)):
            cache = (fmt, self.state_slots(self._params)), fm.format_state(self.definition, self._params, layout, fmt)
            layout.cache["optirs.formats.state"] = cache
        return cache[1]

    def _format_step(self, plist: List[Any], glist: List[Any], metas: List[ArrayMeta], fmt: StepFormat,
                     scalars: Optional[NamedTuple] = None, device_flag: Any = None, check: bool = False) -> bool:
        """One step in ``fmt`` through the backend's ``formats`` capability, as one transaction;
        returns whether it was applied.

        ``scalars`` replaces the definition's record (a loss scaler sets its ``grad_factor``);
        ``device_flag`` is a 1-element int32 array of the backend: non-zero (read on the device)
        skips the launch's writes; with ``check`` the gradients' non-finite check sets it first
        (``optirs_formats_check``, in the same transaction). The step is counted only if applied.
        """
        backend = self.backend
        fm.check_backend(backend, fmt)
        stage = backend.hook(fm.CAPABILITY, "optirs_formats_stage")
        step = backend.hook(fm.CAPABILITY, "optirs_formats_step")
        check_grads = backend.hook(fm.CAPABILITY, "optirs_formats_check") if check else None
        layout = self._layout or TensorLayout([m.shape for m in metas])
        fs = self._format_state(layout, fmt)
        if scalars is None:
            scalars = self.step_scalars(self._step + 1)
        with deferred_interrupts(), backend.lock:
            hook = "optirs_alloc"
            try:
                if self._state is None:
                    state = fm.alloc_state(backend, fs, self.state_slots(self._params))
                else:
                    hook = "optirs_to_device"
                    self.move_to_gpu()
                    state = self._state
                hook = "optirs_formats_stage"
                staged = stage(backend.ctx, plist, glist, fmt)
                if check_grads is not None:
                    hook = "optirs_formats_check"
                    check_grads(backend.ctx, staged.grads, layout, fmt, device_flag)
                hook = "optirs_formats_step"
                step(backend.ctx, self.definition.kernel, staged.params, staged.grads, state, layout, fs, fmt,
                     scalars, self.precision.seed, self._step + 1, device_flag)
                if staged.finish is not None:
                    hook = "optirs_formats_stage's finish"
                    staged.finish()
                skipped = device_flag is not None and self._found_inf(device_flag)
            except Exception as exc:
                error = backend.plugin_error(exc, hook)
                if error is exc:
                    raise
                raise error from exc
            if skipped and self._state is None:
                return False  # a skipped first step leaves the optimizer fresh (no state)
            self._layout, self._state, self._state_on_device, self._format = layout, state, True, fmt
            if not skipped:
                self._step += 1
            return not skipped

    def _found_inf(self, found_inf: Any) -> bool:
        """``step_gpu``'s ``found_inf`` as a host bool (a device flag is read back here)."""
        if found_inf is None:
            return False
        if isinstance(found_inf, (bool, np.bool_)):
            return bool(found_inf)
        if isinstance(found_inf, np.ndarray):
            host = found_inf
        else:
            describe(found_inf, "found_inf")  # an array kind optirs does not know is refused here
            backend = self.backend
            try:
                host = np.asarray(backend.to_host(backend.ctx, found_inf))
            except Exception as exc:
                raise InvalidParameterError(f"found_inf could not be read back by the {backend.name} backend "
                                            f"({exc}), expected a bool, a numpy array or this backend's array") from exc
        if host.size != 1:
            raise InvalidParameterError(f"found_inf has {host.size} elements, expected a bool or a 1-element array")
        return bool(host.reshape(-1)[0] != 0)

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
        per_param: List[Dict[str, np.ndarray]] = []
        extra: Dict[str, Any] = {}
        if self._format is not None and self._state is not None:
            # The compact buffers as they are (int8 codes + block scales, bfloat16, remainders).
            per_param = fm.checkpoint_state(self._format_state(), self._host_state())
            extra["format"] = fm.format_record(self._format)
        elif self._state is not None and self._layout is not None:
            flat = self._host_state()
            state_layout = self.definition.state_layout(self._layout, tuple(flat))
            views = {k: state_layout.views(k, v) for k, v in flat.items()}
            per_param = [{k: views[k][i].copy() for k in flat if views[k][i] is not None}
                         for i in range(len(self._layout))]
        return {
            "optimizer": self.name,
            "hyperparameters": self._params.to_dict(),
            "step": self._step,
            "shapes": [list(s) for s in self._layout.shapes] if self._layout else [],
            "state": per_param,
            **extra,
        }

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
        slots = self.state_slots(params)
        if not shapes:
            if entries or step:
                raise InvalidParameterError("state_dict has state or steps but no shapes, expected both or neither")
            self._params, self._layout, self._state, self._state_on_device, self._step = params, None, None, False, 0
            self._format, self._validated = None, None
            return
        if len(entries) != len(shapes):
            raise InvalidParameterError(f"state_dict has {len(entries)} state entries for {len(shapes)} tensors, expected one per tensor")
        layout = TensorLayout(shapes)
        if fmt is not None:
            flat_state = fm.restore_state(fm.format_state(self.definition, params, layout, fmt), entries, slots)
            self._params, self._layout, self._state, self._state_on_device = params, layout, flat_state, False
            self._step, self._format, self._validated = step, fmt, None
            return
        state_layout = self.definition.state_layout(layout, tuple(slots))
        values = []  # every entry checked and converted before the flat buffers are made
        for i, entry in enumerate(entries):
            wanted = state_layout.state_shapes(i)
            if not isinstance(entry, Mapping) or set(entry) != set(wanted):
                got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
                raise InvalidParameterError(f"state[{i}] has slots {got}, expected {sorted(wanted)} for shape {shapes[i]}")
            values.append({k: ck.float32_array(entry[k], f"state[{i}][{k!r}]", shape) for k, shape in wanted.items()})
        flat = {k: np.zeros(n, STATE_DTYPE) for k, n in state_layout.buffer_sizes().items()}
        views = {k: state_layout.views(k, flat[k]) for k in flat}
        for i, entry in enumerate(values):
            for k, value in entry.items():
                views[k][i][...] = value
        self._params, self._layout, self._state, self._state_on_device = params, layout, flat, False
        self._step, self._format, self._validated = step, None, None

    def __repr__(self) -> str:
        where = self._backend.name if self._backend else self.config.backend
        return f"{type(self).__name__}({self._params!r}, backend={where!r}, step={self._step})"


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
