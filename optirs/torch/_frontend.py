"""The machinery behind :mod:`optirs.torch`: a ``torch.optim.Optimizer`` that steps through an
optirs definition's :class:`~optirs.optim.engine.StepEngine`.

Per (param group, device, dtype, step count) the optimizer keeps a *bucket*
(:mod:`optirs.torch._buckets`): the group's tensors that have a gradient, their engine, and
``self.state[p]`` as views of the engine's flat buffers, so torch's ``state`` and
``state_dict()`` see the live state without copies. The scalars come from ``param_groups[i]``
at every step, so every ``torch.optim.lr_scheduler`` works unchanged.

``step()`` is one transaction over every group:

1. Check everything, for every group: hyperparameters, tensors and gradients, formats,
   ``capturable``, the GradScaler's values, the state ``opt.state`` holds for tensors that start
   a bucket (a loaded checkpoint, converted where its format differs). New buckets and their
   engines are built here, but neither ``opt.state`` nor any step count is touched.
2. :func:`~optirs.optim.engine.run_steps` over every prepared step (the engines' and backends'
   locks, SIGINT deferred around every launch and count), then the new buckets' ``opt.state``
   entries and the step tensors are installed, still with SIGINT deferred.

A step that fails in 1 changes nothing in any group; a Ctrl-C lands before or after the whole
step. A plugin's own exception is a ``PluginError`` naming the plugin and the hook (the engine's).

A group's *plan* caches what its step needs: when the group's parameter list, its tensors'
dtypes, devices, sizes, strides and memory, which of them have a gradient, and the state's
entries are what they were at the last step, a step re-reads only each parameter's ``.grad``,
checks the tensors' metadata in one C++ call (:mod:`optirs.torch._guards`) and their data
pointers in one ``map``, and launches; anything else re-plans that group (keeping the buckets
whose tensors did not change). The hyperparameter record is rebuilt only when a value changed.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from optirs.core.definitions import DEFINITIONS, ElementwiseState, OptimizerDefinition
from optirs.core.errors import GpuOptimError, InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.formats import INT8_STATES
from optirs.core.interrupts import deferred_interrupts
from optirs.core.layout import storage_order
from optirs.core.scalars import FORMULAS
from optirs.optim.engine import PreparedStep, run_steps
from optirs.plugin.hookspecs import DeviceStepInputs
from optirs.torch._buckets import STATE_DTYPE, Bucket, step_value
from optirs.torch._dtensor import is_dtensor, local, local_ptr, refusal
from optirs.torch._guards import TensorCheck
from optirs.torch._state import TrackedState, plain
from optirs.torch._stepcall import observed_step

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GRAD = operator.attrgetter("grad")
_IS = operator.is_
_DATA_PTR = torch.Tensor.data_ptr
REHEARSALS = 2  # runs of the next step's preparation at the end of a group's first step (_commit)
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled

# backend spec -> opened backend, per torch device type, so "auto" is resolved once.
_AUTO: Dict[Tuple[str, str], Any] = {}


def _open_backend(name: str, options: Dict[str, Any], device_type: str):
    """The optirs backend that steps torch tensors of ``device_type`` in place.

    ``"auto"`` picks the first of ``optirs.SUPPORTED_BACKENDS`` that opens and says (through its
    ``measure`` capability's ``optirs_torch_device``) that its memory is ``device_type``'s.
    """
    from optirs.core.errors import BackendUnavailableError
    from optirs.plugin.registry import REGISTRY, SUPPORTED_BACKENDS

    def torch_device(backend) -> Optional[str]:
        if not backend.supports("measure"):
            return None
        try:
            return backend.hook("measure", "optirs_torch_device")(backend.ctx)
        except Exception as exc:  # a plugin's own error names the plugin and the hook
            error = backend.plugin_error(exc, "optirs_torch_device")
            if error is exc:
                raise
            raise error from exc

    if name != "auto":
        backend = REGISTRY.get_backend(name, options)
        where = torch_device(backend)
        if where != device_type:
            raise UnsupportedOperationError(
                f"backend {name!r} steps torch tensors on {where!r}, but the parameters are on {device_type!r}; "
                f"expected a backend for {device_type!r} tensors (backend='auto' picks one)"
            )
        return backend
    key = (device_type, repr(sorted(options.items())))
    hit = _AUTO.get(key)
    if hit is not None:
        return hit
    reasons = []
    for candidate in SUPPORTED_BACKENDS:
        said = REGISTRY.torch_devices(candidate)
        if said is not None and device_type not in said:
            reasons.append(f"{candidate}: steps {', '.join(map(repr, said)) or 'no torch'} tensors")
            continue  # not opened: a GPU runtime's load is seconds
        try:
            backend = REGISTRY.get_backend(candidate, options)
        except BackendUnavailableError as exc:
            reasons.append(f"{candidate}: {exc}")
            continue
        where = torch_device(backend)
        if where == device_type:
            _AUTO[key] = backend
            return backend
        reasons.append(f"{candidate}: steps {where!r} tensors")
    raise UnsupportedOperationError(
        f"no optirs backend steps torch {device_type!r} tensors in place ({'; '.join(reasons)})")


def closure_and_amp(opt: Any, closure: Optional[Callable[[], Any]], grad_scale: Any, found_inf: Any):
    """(``closure()``'s loss, evaluated with grad enabled, or None; ``grad_scale``; ``found_inf``),
    the last two from the attributes of those names that ``torch.amp.GradScaler`` sets on
    optimizers with ``_step_supports_amp_scaling`` when not passed."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    held = opt.__dict__  # (GradScaler sets them on the instance; a missed getattr costs an exception)
    if grad_scale is None:
        grad_scale = held.get("grad_scale")
    if found_inf is None:
        found_inf = held.get("found_inf")
    return loss, grad_scale, found_inf


def check_flags(group: Dict[str, Any], capturable_ok: bool = False) -> None:
    """``differentiable`` is never honoured; ``capturable`` only where the caller can (the
    optirs.torch optimizers on elementwise definitions; not CPUOffload, whose step is on the host)."""
    if group.get("differentiable", False):
        raise UnsupportedOperationError(
            "differentiable=True, expected False: optirs steps parameters in place in its own kernels, "
            "outside autograd"
        )
    if group.get("capturable", False) and not capturable_ok:
        raise UnsupportedOperationError(
            "capturable=True, expected False: this optimizer steps on the host, so it cannot keep its step "
            "count and learning rate on the device for CUDA-graph capture"
        )


def check_implementation_hints(foreach: Any, fused: Any) -> None:
    """torch's ``foreach`` and ``fused`` choose among torch's implementations; optirs has one (a
    fused launch per bucket), which answers every choice, so any value torch accepts is accepted
    and the combinations torch refuses are refused."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise InvalidParameterError(f"{name}={value!r}, expected None, True or False")
    if foreach and fused:
        raise InvalidParameterError("foreach=True and fused=True, expected at most one of them True "
                                    "(torch refuses both together)")


def _immutable(value: Any) -> bool:
    """Whether a hyperparameter's value cannot change without being replaced."""
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return value is None or isinstance(value, (bool, int, float, str))


class _Hyper(NamedTuple):
    """A group's checked hyperparameters. ``key``: what its buckets depend on (a plan stays valid
    while it is equal; a scheduler changing ``lr`` changes ``hp`` only)."""

    definition: OptimizerDefinition
    hp: Any
    slots: Dict[str, float]
    precision: Any
    capturable: bool
    key: tuple


def _picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], List[Any]]:
    """A C-speed selection of ``indices`` from a list."""
    indices = list(indices)
    if not indices:
        return lambda seq: []
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: [seq[i]]
    get = operator.itemgetter(*indices)
    return lambda seq: list(get(seq))


class _GroupPlan:
    """One group's step as it was planned (module docstring): what a step re-reads, and its buckets.

    ``launches``: (bucket, the selection of the bucket's gradients among the present ones).
    """

    __slots__ = ("params", "n", "key", "mask", "pick", "present", "check", "ptr", "ptrs", "launches", "amp_pending")

    def __init__(self, params: List[torch.Tensor], key: tuple, mask: tuple, present: List[int],
                 grads: List[torch.Tensor], launches: List[Tuple[Bucket, Any]], amp_pending: bool):
        self.params, self.n, self.key, self.mask = params, len(params), key, mask
        self.pick = None if len(present) == len(params) else _picker(present)
        self.present = [params[j] for j in present]
        self.check = TensorCheck(self.present + [grads[j] for j in present])
        self.ptr = local_ptr if any(b.dist for b, _ in launches) else _DATA_PTR
        self.ptrs = tuple(map(self.ptr, self.present))
        self.launches, self.amp_pending = launches, amp_pending

    def current(self, params: List[torch.Tensor], grads: List[Any], key: tuple, state: Any) -> Optional[List[Any]]:
        """The present gradients when nothing this plan depends on changed, else None.

        Per tensor this is a few C-speed passes: the metadata check of parameters and gradients
        (a None where a gradient was fails it), the parameters' data pointers (``p.data = ...``)
        and the state entries' identities; with parameters that had no gradient, which ones."""
        if params is not self.params or len(grads) != self.n or key != self.key:
            return None
        if self.pick is None:
            present = grads
        else:
            if tuple(map(_IS, grads, repeat(None))) != self.mask:
                return None
            present = self.pick(grads)
        if not self.check(self.present + present) or tuple(map(self.ptr, self.present)) != self.ptrs:
            return None
        for bucket, _ in self.launches:
            if not bucket.intact(state):
                return None
        return present


class _Amp(NamedTuple):
    """The GradScaler's inputs of one step, checked: None, a number, or a one-element tensor each."""

    grad_scale: Any
    found_inf: Any

    @staticmethod
    def checked(grad_scale: Any, found_inf: Any) -> "_Amp":
        for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 or value.is_complex() or value.is_sparse:
                    raise InvalidParameterError(
                        f"{name} is a tensor of shape {tuple(value.shape)} ({value.dtype}), expected a 1-element real "
                        "tensor (as torch.amp.GradScaler passes) or a number")
                if name == "grad_scale" and not value.is_floating_point():
                    raise InvalidParameterError(f"grad_scale is a {value.dtype} tensor, expected a floating-point one")
            elif isinstance(value, (bool, np.bool_)) and name == "found_inf":
                continue
            elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise InvalidParameterError(f"{name}={value!r} of type {type(value).__name__}, expected None, a number "
                                            "or a 1-element tensor")
        return _Amp(grad_scale, found_inf)

    def host_values(self) -> Tuple[Optional[float], bool]:
        """(the inverse scale or None, whether an inf was found), read on the host."""
        found = self.found_inf is not None and float(self.found_inf) != 0.0
        inv = None
        if self.grad_scale is not None:
            scale = float(self.grad_scale)
            if not (scale > 0.0 and np.isfinite(scale)):
                raise InvalidParameterError(f"grad_scale={scale!r}, expected a finite scale > 0")
            inv = 1.0 / scale
        return inv, found


_NO_AMP = _Amp(None, None)


class OptirsOptimizer(torch.optim.Optimizer):
    """Base of the optirs.torch optimizers: torch's Optimizer (param_groups, hooks, state,
    state_dict) over an optirs definition's engine, one launch per bucket.

    Subclasses implement :meth:`_hyperparameters` (a param group to the definition's name and
    its params record).
    """

    definition_name: str = ""
    _has_step_state: bool = True
    # GradScaler passes grad_scale / found_inf to step (torch's fused optimizers' contract).
    _step_supports_amp_scaling = True
    _native_maximize = False
    _FORMAT_KEYS = ("master_weights", "state_dtype", "stochastic_rounding", "seed")
    FORMAT_KEYS = _FORMAT_KEYS  # the step-format keywords a param group may set

    def __init__(self, params: Any, defaults: Dict[str, Any], *, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None):
        check_implementation_hints(foreach, fused)
        if not isinstance(backend, str) or not backend:
            raise InvalidParameterError(f"backend={backend!r}, expected a backend name or 'auto'")
        from optirs.plugin.registry import REGISTRY

        REGISTRY.check_backend_name(backend)  # a misspelt name fails here, not at the first step
        if backend_options is not None and not isinstance(backend_options, dict):
            raise InvalidParameterError(f"backend_options={backend_options!r}, expected a dict or None")
        self._backend_name = backend
        self._backend_options = dict(backend_options or {})
        self._init_caches()
        super().__init__(params, defaults)
        self.state = TrackedState(self.state)
        # The backends open now, as torch's optimizers load their compiler at construction: the
        # first step launches instead of starting numba. A backend that cannot open is the first
        # step's to report (with the step's own checks first).
        for device in {p.device for group in self.param_groups for p in group["params"]}:
            try:
                self._backend_for(device)
            except GpuOptimError:
                pass

    def _init_caches(self) -> None:
        """What a step reuses, each rebuilt from param_groups and state when missing (a copy starts
        without them): the opened backends, each group's checked hyperparameters (keyed by their
        values) and plan, the storage format per dtype."""
        held = self.__dict__
        for name in ("_backends", "_hypers", "_plans", "_formats"):
            if name not in held:
                held[name] = {}

    # ------------------------------------------------------------ hyperparameters

    def _hyperparameters(self, group: Dict[str, Any]):  # pragma: no cover - abstract
        """(definition name, params record) for one param group."""
        raise NotImplementedError

    @staticmethod
    def _scalar(group: Dict[str, Any], key: str) -> Any:
        value = group[key]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise InvalidParameterError(f"{key} is a tensor of {value.numel()} elements, expected 1 element")
            if value.is_complex() or value.dtype == torch.bool:
                raise InvalidParameterError(f"{key} is a {value.dtype} tensor, expected a real number")
            if key == "lr" and group.get("capturable", False):
                # capturable: the step reads the tensor on the device (a host read would
                # synchronise, and is refused under capture); the record's lr is a placeholder.
                if not value.is_floating_point():
                    raise InvalidParameterError(f"lr is a {value.dtype} tensor, expected a floating-point tensor")
                return 0.0
            return float(value.item())
        return value

    @staticmethod
    def _pair(group: Dict[str, Any], key: str = "betas") -> Tuple[Any, Any]:
        value = group[key]
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            raise InvalidParameterError(f"{key}={value!r}, expected a pair of floats")
        out = []
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                if v.numel() != 1 or v.is_complex() or v.dtype == torch.bool:
                    raise InvalidParameterError(f"{key}[{i}] is a tensor of shape {tuple(v.shape)} ({v.dtype}), "
                                                "expected a float (or a 1-element real tensor)")
                v = float(v.item())
            out.append(v)
        return tuple(out)  # type: ignore[return-value]

    def _check_group(self, group: Dict[str, Any], where: str = "the param group") -> _Hyper:
        """A group's definition, hyperparameters, slots and precision, checked (the flags, the
        hyperparameters, capturable on an elementwise definition without a compact format)."""
        capturable = bool(group.get("capturable", False))
        check_flags(group, capturable_ok=True)
        try:
            name, hp = self._hyperparameters(group)
            precision = self._precision(group)
        except KeyError as exc:
            missing = exc.args[0] if exc.args else exc
            raise InvalidParameterError(
                f"{where} has no {missing!r}, expected every hyperparameter of {type(self).__name__} "
                f"({sorted(k for k in self.defaults if k != 'params')})") from exc
        definition = DEFINITIONS[name]
        if capturable:
            if name not in FORMULAS:
                raise UnsupportedOperationError(
                    f"capturable=True for {type(self).__name__}, expected False: its step ({name}) needs per-tensor "
                    "reductions between passes, so its scalars cannot be computed on the device; capturable steps "
                    f"exist for {sorted(FORMULAS)}")
            if precision.state_dtype != "float32":
                raise UnsupportedOperationError(
                    f"capturable=True with state_dtype={precision.state_dtype!r}, expected 'float32': capturable "
                    "steps run float32 parameters and state")
        slots = definition.state_slots(hp)
        return _Hyper(definition, hp, slots, precision, capturable,
                      (definition.name, tuple(slots.items()), precision, capturable))

    def _hyper(self, gi: int, group: Dict[str, Any]) -> _Hyper:
        """:meth:`_check_group` of a group, cached on its hyperparameters' values (rebuilt, and
        checked, whenever a scheduler or the user changes one)."""
        cached = self._hypers.get(gi)
        if cached is not None:
            values = cached[1]  # the same immutable values as last time, by identity
            if values is not None and len(values) == len(group) and all(map(_IS, group.values(), values)) \
                    and cached[2] == tuple(group):
                return cached[3]
        capturable = group.get("capturable", False)
        items = []
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                # a tensor's value is read each step (a capturable lr: on the device, not here)
                v = ("tensor", id(v)) if v.numel() != 1 or (k == "lr" and capturable) else ("tensor", v.item())
            elif isinstance(v, (list, tuple)):
                v = tuple(("tensor", x.item() if x.numel() == 1 else id(x)) if isinstance(x, torch.Tensor) else x
                          for x in v)
            items.append((k, v))
        sig = tuple(items)
        if cached is not None and cached[0] == sig:
            hyper = cached[3]
        else:
            hyper = self._check_group(group, f"param_groups[{gi}]")
        # values that cannot change in place (no tensors, no lists) are then compared by identity
        values = list(group.values()) if all(_immutable(v) for k, v in group.items() if k != "params") else None
        self._hypers[gi] = (sig, values, tuple(group), hyper)
        return hyper

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        # Check the group's hyperparameters before torch adds it, so a bad group changes nothing.
        probe = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_group(probe)
        super().add_param_group(param_group)

    def group_hyperparameters(self, group: Dict[str, Any]):
        """(definition name, hyperparameters record) of a param group (what wrappers such as CPUOffload read)."""
        return self._hyperparameters(group)

    def group_precision(self, group: Dict[str, Any]):
        """The group's :class:`~optirs.core.formats.Precision`."""
        return self._precision(group)

    def backend_for(self, device: torch.device):
        """The optirs backend that steps this optimizer's tensors on ``device`` (opened once)."""
        return self._backend_for(device)

    def _precision(self, group: Dict[str, Any]):
        """The group's :class:`~optirs.core.formats.Precision` (its defaults where the optimizer takes none)."""
        from optirs.core.formats import Precision

        return Precision(**{k: group[k] for k in self._FORMAT_KEYS if k in group})

    def _storage(self, precision: Any, dtype: torch.dtype, definition: OptimizerDefinition):
        """The state's storage format for parameters of ``dtype`` (None: float32 tensors and state;
        the gradients' dtype is the step's, resolved per launch)."""
        key = (precision, dtype, definition.name)
        hit = self._formats.get(key, self)
        if hit is self:
            from dataclasses import replace

            from optirs.core.formats import resolve_format

            name = str(dtype).replace("torch.", "")
            fmt = replace(resolve_format(precision, name, name, definition.kernel), grad_dtype="float32")
            hit = self._formats[key] = None if fmt.plain else fmt
        return hit

    # ------------------------------------------------------------ checkpoints and copies

    def state_dict(self) -> Dict[str, Any]:
        """torch's ``state_dict()`` (hooks included), its entries as plain dicts (a checkpoint names
        no optirs class: ``torch.load(weights_only=True)`` reads it)."""
        out = super().state_dict()
        held = out.get("state") if isinstance(out, dict) else None
        if isinstance(held, dict):
            out["state"] = {k: plain(v) for k, v in held.items()}
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
        # steps are checked before torch takes anything (torch would keep a bad one until a step fails)
        for index, entry in (saved.items() if isinstance(saved, dict) else ()):
            if isinstance(entry, dict) and "step" in entry:
                step_value(entry["step"], f"state_dict['state'][{index!r}]")
        super().load_state_dict(state_dict)
        # torch casts every state tensor but "step" to its floating-point parameter's dtype; the
        # masters and compact state keep their own: of 16-bit parameters everything (float32
        # masters and scales, bfloat16 moments, int8 codes), of float32 parameters the bfloat16
        # and integer tensors (a float64 value in a checkpoint is meant to arrive as float32).
        for saved_group, group in zip(state_dict.get("param_groups", []), self.param_groups):
            for index, p in zip(saved_group.get("params", []), group["params"]):
                entry = saved.get(index)
                if entry is None or p not in self.state:
                    continue
                for k, v in entry.items():
                    if k != "step" and isinstance(v, torch.Tensor) and (
                            p.dtype != STATE_DTYPE or v.dtype == torch.bfloat16 or not v.is_floating_point()):
                        self.state[p][k] = v.detach().to(device=p.device).clone()
        self.state = TrackedState(self.state)
        self._plans.clear()  # the next step copies the loaded state into fresh flat buffers
        self._hypers.clear()

    def __getstate__(self) -> Dict[str, Any]:
        """torch's (defaults, state, param_groups) with each state entry as its own tensors (not views
        of flat buffers, which plain pickle would write once per view), and the backend choice: a
        copy rebuilds its buckets and engines from them at its first step."""
        state = super().__getstate__()
        state["state"] = {p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
                          for p, entry in self.state.items()}
        state["_backend_name"], state["_backend_options"] = self._backend_name, dict(self._backend_options)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._init_caches()
        self.state = TrackedState(self.state)

    # ------------------------------------------------------------ the step

    def _backend_for(self, device: torch.device):
        backend = self._backends.get(device.type)
        if backend is None:
            backend = self._backends[device.type] = _open_backend(
                self._backend_name, self._backend_options, device.type)
        return backend

    def _param_step(self, p: torch.Tensor, what: str) -> int:
        """The step count ``opt.state`` holds for ``p`` (0 without state), checked."""
        state = self.state.get(p)
        if not state:
            return 0
        if self._has_step_state:
            if "step" not in state:
                raise InvalidParameterError(f"the state of {what} has keys {sorted(state)} but no 'step', expected "
                                            "its step count (as torch keeps it)")
            return step_value(state["step"], f"the state of {what}")
        # SGD: a momentum buffer (compact ones under momentum_buffer.codes / .scales) means it has stepped
        return 1 if any(k.split(".")[0] == "momentum_buffer" and v is not None for k, v in state.items()) else 0

    def _bad_tensor(self, gi: int, j: int, p: torch.Tensor, g: torch.Tensor) -> Optional[Exception]:
        """The error of a parameter / gradient the step cannot take, or None."""
        where = f"param_groups[{gi}]['params'][{j}]"
        if not isinstance(g, torch.Tensor):
            return InvalidParameterError(f"{where}.grad is a {type(g).__name__}, expected a tensor or None")
        if g.is_sparse or g.layout != torch.strided:
            return UnsupportedOperationError(
                f"{where} has a sparse gradient, expected a dense one: use optirs.SparseAdam / optirs.SparseSgd (or "
                "torch.optim.SparseAdam) for sparse gradients")
        if p.dtype not in PARAM_DTYPES or g.dtype not in (p.dtype, STATE_DTYPE):
            return UnsupportedOperationError(
                f"{where} is {p.dtype} with a {g.dtype} gradient, expected torch.float32, bfloat16 or float16 "
                "parameters with gradients of their dtype or float32")
        if g.shape != p.shape or g.device != p.device:
            return ShapeMismatchError(
                f"{where} has shape {tuple(p.shape)} on {p.device}, but its gradient {tuple(g.shape)} on {g.device}; "
                "expected the same (a gradient of another shape would be read out of bounds)")
        return None

    @staticmethod
    def _layout_error(gi: int, j: int, p: torch.Tensor, g: torch.Tensor, definition: OptimizerDefinition,
                      storage: Any) -> Optional[Exception]:
        """The error of a parameter / gradient whose memory the step cannot address, or None: a
        DTensor pair it cannot step locally (:func:`optirs.torch._dtensor.refusal`); tensors that are
        not dense and non-overlapping, or whose strides differ (any dense layout is stepped in
        place, as one run of memory: channels_last included)."""
        where = f"param_groups[{gi}]['params'][{j}]"
        if is_dtensor(p) or is_dtensor(g):
            error = refusal(p, g, where, None if definition.pointwise else f"{definition.name}'s per-tensor reductions",
                            storage is not None and storage.state_dtype in INT8_STATES)
            if error is not None:
                return error
            p, g = local(p), local(g)
        if p.is_contiguous() and g.is_contiguous():
            return None
        order = storage_order(p.shape, p.stride())
        if order is None:
            return ShapeMismatchError(
                f"{where} has strides {p.stride()} for shape {tuple(p.shape)}, expected a dense, non-overlapping "
                "tensor (any order of dims: contiguous, channels_last, a transpose), whose elements fill one run "
                "of memory")
        if any(n > 1 and a != b for n, a, b in zip(p.shape, p.stride(), g.stride())):
            return ShapeMismatchError(
                f"{where} has strides {p.stride()} but its gradient {g.stride()}, expected the same strides (an "
                "elementwise step pairs their elements by position in memory)")
        if definition.state_layout is not ElementwiseState:
            return UnsupportedOperationError(
                f"{where} has strides {p.stride()} for shape {tuple(p.shape)} (not row-major), expected a contiguous "
                f"tensor for {definition.name}: its state is factored over the last two dims, which this layout "
                "does not keep together in memory")
        return None

    def _plan_group(self, gi: int, group: Dict[str, Any], params: List[torch.Tensor], grads: List[Any],
                    hyper: _Hyper, amp: bool) -> _GroupPlan:
        """A new plan of one group (every tensor checked, buckets reused where their tensors did not
        change, new ones adopting what opt.state holds); nothing of the optimizer changes."""
        definition, slots, precision, capturable = hyper.definition, hyper.slots, hyper.precision, hyper.capturable
        present = [j for j, g in enumerate(grads) if g is not None]
        by_key: Dict[tuple, List[int]] = {}
        for j in present:
            p, g = params[j], grads[j]
            error = self._bad_tensor(gi, j, p, g)
            if error is not None:
                raise error
            by_key.setdefault((p.device, p.dtype), []).append(j)
        old = self._plans.get(gi)
        reusable = {tuple(map(id, b.params)): b for b, _ in old.launches} if old is not None else {}
        launches: List[Tuple[Bucket, Any]] = []
        amp_pending = False
        position = {j: k for k, j in enumerate(present)}
        for (device, dtype), members in by_key.items():
            gdtypes = {grads[j].dtype for j in members}
            if len(gdtypes) > 1:
                raise ShapeMismatchError(
                    f"param_groups[{gi}]'s {dtype} parameters on {device} have gradients of dtypes "
                    f"{sorted(map(str, gdtypes))}, expected one dtype (the parameters' or float32) for all of them: "
                    "one launch reads one gradient dtype")
            storage = self._storage(precision, dtype, definition)
            for j in members:
                error = self._layout_error(gi, j, params[j], grads[j], definition, storage)
                if error is not None:
                    raise error
            if capturable and storage is not None:
                raise UnsupportedOperationError(
                    f"capturable=True on {dtype} parameters, expected float32 ones: capturable steps run float32 "
                    "parameters and state")
            backend = self._backend_for(device)
            if capturable and not backend.supports("capturable"):
                raise UnsupportedOperationError(
                    f"capturable=True on {device.type} tensors, expected tensors on a device whose backend has the "
                    f"'capturable' capability (CUDA tensors on the cuda backend): backend {backend.name!r} implements "
                    f"{sorted(backend.capabilities)}. torch's capturable optimizers refuse CPU tensors too")
            device_amp = (device.type != "cpu" and storage is None and definition.name in FORMULAS
                          and backend.supports("capturable"))
            want_device = capturable or (amp and device_amp)
            by_step: Dict[int, List[int]] = {}
            for j in members:
                by_step.setdefault(self._param_step(params[j], f"param_groups[{gi}]['params'][{j}]"), []).append(j)
            detach = any(grads[j].requires_grad for j in members)
            for step, js in sorted(by_step.items()):
                ps = [params[j] for j in js]
                bucket = reusable.get(tuple(map(id, ps)))
                if bucket is None or not (
                        bucket.matches(ps)
                        and bucket.definition is definition and bucket.slots == slots and bucket.storage == storage
                        and bucket.seed == precision.seed and (bucket.device_steps or not want_device)
                        and bucket.detach_grads == detach and bucket.intact(self.state)):
                    bucket = Bucket(definition, backend, ps, slots, storage, precision.seed, self._has_step_state,
                                    [f"param_groups[{gi}]['params'][{j}]" for j in js], device_steps=want_device,
                                    detach_grads=detach)
                    entries = [self.state.get(p) for p in ps]
                    if any(entries):
                        bucket.adopt(entries, step)
                elif bucket.param_ptrs != tuple(map(local_ptr if bucket.dist else _DATA_PTR, ps)):
                    bucket.refresh_params()  # the same tensors over other memory (p.data = ...)
                amp_pending |= device_amp and not bucket.device_steps
                pick = None if len(js) == len(present) else _picker([position[j] for j in js])
                launches.append((bucket, pick))
        mask = tuple(map(_IS, grads, repeat(None)))
        return _GroupPlan(params, hyper.key, mask, present, grads, launches, amp_pending)

    def _grad_factor(self, group: Dict[str, Any], inv_scale: Optional[float]) -> float:
        """The scalars' ``grad_factor``: what the step multiplies every gradient element by first."""
        negate = bool(group.get("maximize", False)) and not self._native_maximize
        factor = 1.0 if inv_scale is None else inv_scale
        return -factor if negate else factor

    @observed_step  # torch's hooks and profiler annotation when observed; a graph break under torch.compile
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None):
        """One step of every param group, as one transaction (module docstring); returns
        ``closure()``'s loss (evaluated with grad enabled).

        ``grad_scale`` / ``found_inf`` (or the attributes of the same names that
        ``torch.amp.GradScaler`` sets on optimizers with ``_step_supports_amp_scaling``): the
        gradients are unscaled by ``1 / grad_scale`` and nothing changes when ``found_inf`` is
        non-zero (the step count does not advance either), as torch's fused optimizers do. On a
        device whose backend has the ``capturable`` capability both stay on the device (no host
        synchronisation); on the CPU they are read on the host (free there).
        """
        loss, grad_scale, found_inf = closure_and_amp(self, closure, grad_scale, found_inf)
        has_amp = grad_scale is not None or found_inf is not None
        amp = _Amp.checked(grad_scale, found_inf) if has_amp else _NO_AMP
        state = self.state
        # Phase 1: check every group and plan its buckets; nothing of the optimizer changes.
        work: List[Tuple[Dict[str, Any], _Hyper, _GroupPlan, List[torch.Tensor], bool]] = []
        for gi, group in enumerate(self.param_groups):
            hyper = self._hyper(gi, group)
            params = group["params"]
            grads = list(map(_GRAD, params))
            plan = self._plans.get(gi)
            present = None
            if plan is not None and not (has_amp and plan.amp_pending):
                present = plan.current(params, grads, hyper.key, state)
            fresh = present is None
            if fresh:
                plan = self._plan_group(gi, group, params, grads, hyper, has_amp)
                present = [g for g in grads if g is not None]
            work.append((group, hyper, plan, present, fresh))
        inv_scale, found = None, None
        if has_amp and any(not b.device_steps for _, _, plan, _, _ in work for b, _ in plan.launches):
            inv_scale, found = amp.host_values()  # buckets with host scalars read them on the host
        prepared: List[Tuple[Bucket, PreparedStep]] = []
        for group, hyper, plan, present, _ in work:
            factor = self._grad_factor(group, inv_scale)
            for bucket, pick in plan.launches:
                grads = present if pick is None else pick(present)
                if bucket.device_steps:
                    inputs = self._device_inputs(bucket, hyper.hp, group, amp)
                    prepared.append((bucket, bucket.prepare(hyper.hp, grads, 1.0, None, inputs)))
                else:
                    prepared.append((bucket, bucket.prepare(hyper.hp, grads, factor, found)))
        # Phase 2: the transaction, then the new buckets' entries in opt.state.
        with deferred_interrupts():
            grad_mode = _grad_enabled()
            _set_grad_enabled(False)  # as torch's steps run (launches and plugins included)
            try:
                run_steps([p for _, p in prepared])
            finally:
                try:
                    self._commit(work, prepared)
                finally:
                    _set_grad_enabled(grad_mode)
        return loss

    def _commit(self, work: List[tuple], prepared: List[Tuple[Bucket, PreparedStep]]) -> None:
        """After the launches: the step tensors of the stepped buckets; the entries of new buckets
        whose engine holds state now; the plans whose every bucket is installed."""
        for bucket, p in prepared:
            bucket.finish(p)
        if not any(w[4] for w in work):  # every group stepped on its cached plan
            return
        done = {id(bucket): p.applied or (p.skip and bucket.engine.state is not None) for bucket, p in prepared}
        state = self.state
        if type(state) is not TrackedState:
            state = self.state = TrackedState(state)
        installed = []
        for gi, (group, hyper, plan, _, fresh) in enumerate(work):
            if not fresh:
                continue
            complete = True
            for bucket, _ in plan.launches:
                if bucket.entries is None:
                    if done.get(id(bucket)):
                        bucket.install(state)
                    else:
                        complete = False
            if complete:
                self._plans[gi] = plan
                installed.append((group, hyper, plan))
            else:
                self._plans.pop(gi, None)
        # The next step's check and preparation, made now and dropped, twice (the first look at every
        # entry; the first runs of that code, which CPython specializes after its first run): the
        # second step then costs about what a later one does, and the first may take its time.
        for _ in range(REHEARSALS):
            for group, hyper, plan in installed:
                params = group["params"]
                present = plan.current(params, list(map(_GRAD, params)), hyper.key, state)
                if present is not None:
                    factor = self._grad_factor(group, None)
                    for bucket, pick in plan.launches:
                        bucket.rehearse(hyper.hp, present if pick is None else pick(present), factor)

    @staticmethod
    def _on_device(t: Any, device: torch.device, what: str) -> torch.Tensor:
        """A one-element float32 tensor on ``device`` with ``t``'s value: ``t`` itself where it is
        one (read in place, so a change between CUDA-graph replays takes effect), else a copy
        made on the stream (eager steps; under capture keep such tensors on the device)."""
        if not isinstance(t, torch.Tensor):
            return torch.full((1,), float(t), dtype=STATE_DTYPE, device=device)
        if t.numel() != 1:
            raise InvalidParameterError(f"{what} is a tensor of {t.numel()} elements, expected 1 element")
        t = t.detach()
        if t.dtype is STATE_DTYPE and t.device == device:
            return t
        return t.to(device=device, dtype=STATE_DTYPE).reshape(1)

    def _device_inputs(self, bucket: Bucket, hp: Any, group: Dict[str, Any], amp: _Amp) -> DeviceStepInputs:
        """The device-side scalars' inputs: the device step count, the lr (a float, or a tensor read
        at every step), maximize's sign and the GradScaler's device tensors."""
        definition, device = bucket.definition, bucket.device
        lr = group["lr"]
        lr_in = self._on_device(lr, device, "lr") if isinstance(lr, torch.Tensor) else float(lr)
        sign = -1.0 if bool(group.get("maximize", False)) and not self._native_maximize else 1.0
        return DeviceStepInputs(
            steps=bucket.steps, record=bucket.record, constants=FORMULAS[definition.name].constants(hp), lr=lr_in,
            sign=sign,
            grad_scale=None if amp.grad_scale is None else self._on_device(amp.grad_scale, device, "grad_scale"),
            found_inf=None if amp.found_inf is None else self._on_device(amp.found_inf, device, "found_inf"))
