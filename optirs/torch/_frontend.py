"""The machinery behind :mod:`optirs.torch`: a ``torch.optim.Optimizer`` that steps through an
optirs definition and the bound backend.

Per (param group, device, dtype) the optimizer keeps a *bucket*: the group's tensors that have a
gradient, their :class:`optirs.core.layout.TensorLayout`, one flat torch buffer per state slot
(laid out by the definition's ``state_layout``), and ``self.state[p][slot]`` as views into those
buffers, so torch's ``state`` and ``state_dict()`` see the live state without copies. A step is
one call of the backend's step hook per bucket, with the scalars of
``definition.scalars(hyperparameters, step)`` built from ``param_groups[i]`` at that step, so
every ``torch.optim.lr_scheduler`` works unchanged.

A bucket is rebuilt (its state copied once into fresh flat buffers) when the tensors with a
gradient change, the slots change (``amsgrad`` switched on), or the state was replaced
(``load_state_dict``, or an entry of ``opt.state[p]`` assigned by hand).

Formats (docs/formats.md): a group's ``master_weights`` / ``state_dtype`` /
``stochastic_rounding`` / ``seed`` and its tensors' dtype give a bucket its
:class:`~optirs.core.formats.StepFormat`; float32 tensors with float32 state run the step hook as
above, every other format a :class:`_FormatBucket` (optirs.torch._formats) whose flat buffers are
the ``FormatState``'s, each in its own dtype.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.layout import TensorLayout
from optirs.core.scalars import FORMULAS
from optirs.plugin.hookspecs import DeviceStepInputs, StepControls, StepRequest

STATE_DTYPE = torch.float32
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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
        return backend.hook("measure", "optirs_torch_device")(backend.ctx)

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


def _host_array(backend, tensor: torch.Tensor):
    """The backend's array over a torch tensor's memory, without a copy."""
    if tensor.is_cpu:
        return tensor.detach().numpy()
    # CUDA tensors: the backend reads __cuda_array_interface__ (detach: a tensor that requires
    # grad refuses to export it).
    return tensor.detach()


def _state_array(backend, flat: torch.Tensor):
    """The backend's device array over a flat state buffer (same memory)."""
    if flat.is_cpu:
        view = backend.host_view(flat.numpy())
        if view is None:
            raise UnsupportedOperationError(
                f"backend {backend.name!r} cannot work in host memory, expected a backend whose memory is the "
                "host's for torch CPU tensors (backend='cpu')"
            )
        return view
    return flat


def _slot_views(state_layout, slot: str, flat: torch.Tensor) -> List[Optional[torch.Tensor]]:
    """Per-tensor torch views of a flat state buffer, where the definition's layout puts them.

    The layout answers with numpy views of a host buffer; the same offsets and shapes are read off
    a scratch array (never touched) and applied to the torch buffer, whatever its device.
    """
    probe = np.empty(flat.numel(), np.float32)
    base = probe.__array_interface__["data"][0]
    out: List[Optional[torch.Tensor]] = []
    for v in state_layout.views(slot, probe):
        if v is None:
            out.append(None)
            continue
        offset = (v.__array_interface__["data"][0] - base) // 4 if v.size else 0
        out.append(flat[offset : offset + v.size].view(v.shape))
    return out


class _TrackedState(defaultdict):
    """``opt.state`` (torch's ``defaultdict(dict)``) that counts the entries set or removed, so a
    step sees in one comparison that no ``opt.state[p] = ...`` replaced a bucket's entries.
    (The entries stay plain dicts: ``state_dict()`` hands them to ``torch.save``.) Pickled or
    copied it is a plain defaultdict again, and the next step rebuilds."""

    def __init__(self, items: Any = ()):
        super().__init__(dict)
        dict.update(self, items)
        self.version = 0

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self.version += 1

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self.version += 1

    def _changed(name):  # noqa: N805 - builds the counting wrappers below
        def method(self, *args, **kwargs):
            self.version += 1
            return getattr(dict, name)(self, *args, **kwargs)

        method.__name__ = name
        return method

    pop = _changed("pop")
    popitem = _changed("popitem")
    clear = _changed("clear")
    update = _changed("update")
    setdefault = _changed("setdefault")
    del _changed

    def __reduce__(self):
        return (defaultdict, (dict,), None, None, iter(self.items()))


class _Bucket:
    """One launch's worth: the tensors of one group on one device with one dtype and one step count.

    ``device_steps``: the step count lives on the device (``steps``, a float32 tensor on the
    parameters' device, one entry per tensor, torch's capturable ``state[p]["step"]``) and every
    step is the backend's ``capturable`` pair (scalars kernel, then the step kernel reading the
    record it wrote), so nothing is read back on the host: ``capturable=True``, and the
    GradScaler's device ``found_inf`` / ``grad_scale`` on a backend with that capability.
    """

    def __init__(self, opt: "OptirsOptimizer", definition: OptimizerDefinition, backend, params: List[torch.Tensor],
                 slots: Dict[str, float], step: int, device_steps: bool = False):
        self.definition, self.backend, self.params = definition, backend, params
        self.key = tuple(map(id, params))
        self.slots = slots
        device = self.device = params[0].device
        self.layout = TensorLayout([tuple(p.shape) for p in params])
        self.state_layout = definition.state_layout(self.layout, tuple(slots))
        sizes = self.state_layout.buffer_sizes()
        self.flat = {k: torch.full((sizes[k],), fill, dtype=STATE_DTYPE, device=device) for k, fill in slots.items()}
        self.views = {k: _slot_views(self.state_layout, k, v) for k, v in self.flat.items()}
        self.device_state = {k: _state_array(backend, v) for k, v in self.flat.items()}
        self.param_arrays = [_host_array(backend, p) for p in params]
        self.param_ptrs = tuple(p.data_ptr() for p in params)
        self.step = step
        self.has_step = opt._has_step_state
        self.device_steps = False
        # torch keeps one 0-dim float32 "step" tensor per parameter; here they are views of one
        # buffer, written once per step (on the host, or by the device scalars kernel).
        self.steps = torch.full((len(params),), float(step), dtype=torch.float32,
                                device=device if device_steps else "cpu")
        self.step_views = [self.steps[i] for i in range(len(params))]
        # Copy the existing state in, then point opt.state at the views.
        for i, p in enumerate(params):
            old = opt.state.get(p, {}) if p in opt.state else {}
            for k in slots:
                value = old.get(k)
                view = self.views[k][i]
                if view is None:
                    continue
                if isinstance(value, torch.Tensor):
                    if tuple(value.shape) != tuple(view.shape):
                        raise ShapeMismatchError(
                            f"state[{k!r}] of a parameter of shape {tuple(p.shape)} has shape {tuple(value.shape)}, "
                            f"expected {tuple(view.shape)}"
                        )
                    view.copy_(value.detach().to(device=device, dtype=STATE_DTYPE))
            entry: Dict[str, Any] = {}
            if self.has_step:
                entry["step"] = self.step_views[i]
            for k in slots:
                if self.views[k][i] is not None:
                    entry[k] = self.views[k][i]
            opt.state[p] = entry
        self.entries = [opt.state[p] for p in params]
        self.state_seen, self.version = None, None  # intact() looks at the entries once
        self._checks()
        self._grads: List[torch.Tensor] = []
        self._gptrs: tuple = ()
        self._garrays: list = []
        if device_steps:
            self.use_device_steps(opt)

    def _checks(self) -> None:
        # (entry, key, value) of everything opt.state must still hold, flattened for a C-speed check.
        triples = [(e, "step", s) for e, s in zip(self.entries, self.step_views)] if self.has_step else []
        for i, entry in enumerate(self.entries):
            triples += [(entry, k, views[i]) for k, views in self.views.items() if views[i] is not None]
        self._check_entries = [t[0] for t in triples]
        self._check_keys = [t[1] for t in triples]
        self._check_values = [t[2] for t in triples]

    def use_device_steps(self, opt: "OptirsOptimizer") -> None:
        """Move the step count to the device (once; it stays there for this bucket's life)."""
        if self.device_steps:
            return
        if not self.backend.steps(self.definition.name, device_scalars=True):
            raise UnsupportedOperationError(
                f"backend {self.backend.name!r} has no device-side scalars for {self.definition.name!r} (the "
                f"'capturable' capability); it implements {sorted(self.backend.capabilities)}")
        steps = self.steps.to(self.device) if self.steps.device != self.device else self.steps
        self.steps = steps
        self.step_views = [steps[i] for i in range(len(self.params))]
        if self.has_step:
            for entry, view in zip(self.entries, self.step_views):
                entry["step"] = view
        self._checks()
        fields = self.definition.scalars_type._fields
        self.record = torch.zeros(len(fields), dtype=torch.float32, device=self.device)  # written on the device
        self.type_record: Any = None  # a host record of the family: its type only (the hook reads the device one)
        self.lr_buffer: Optional[torch.Tensor] = None
        self.device_steps = True

    def intact(self, opt: "OptirsOptimizer") -> bool:
        """Whether opt.state still holds this bucket's views (nothing replaced them)."""
        # (the parameters' memory is checked per group by _group_tensors, which drops the
        # group's buckets when it changes, ``p.data = ...``)
        state = opt.state
        version = getattr(state, "version", None)
        if version is None or version != self.version or state is not self.state_seen:
            # something set or removed entries (or replaced opt.state): look at ours one by one
            if not all(map(operator.is_, map(state.get, self.params), self.entries)):
                return False
            self.state_seen, self.version = state, version
        return all(map(operator.is_, map(dict.get, self._check_entries, self._check_keys), self._check_values))

    def grad_arrays(self, grads: List[torch.Tensor]):
        """The gradients as the backend reads them: the tensors themselves (maximize and the
        GradScaler's unscale are the scalars' ``grad_factor``, applied inside the step).

        The same gradient tensors with the same memory as the last step
        (``zero_grad(set_to_none=False)``) give the same list, so the backend's caches of it hit
        (the backends keep the latest list alive anyway)."""
        if len(grads) == len(self._grads) and all(map(operator.is_, grads, self._grads)):
            ptrs = tuple(map(torch.Tensor.data_ptr, grads))
            if ptrs == self._gptrs:
                return self._garrays
        else:
            ptrs = tuple(map(torch.Tensor.data_ptr, grads))
        if grads and grads[0].is_cpu:
            self._garrays = [(g.detach() if g.requires_grad else g).numpy() for g in grads]
        else:  # device tensors as they are (a detach per tensor costs more than the rest of the step)
            self._garrays = [g.detach() if g.requires_grad else g for g in grads]
        self._grads, self._gptrs = list(grads), ptrs
        return self._garrays


def _storage(precision: Any, params: List[torch.Tensor], definition: OptimizerDefinition):
    """The storage format of a bucket's tensors (None: float32 tensors and state, the step hook).

    The gradients' dtype is resolved per launch (they may be unscaled into float32)."""
    from dataclasses import replace

    from optirs.core.formats import resolve_format

    dtype = str(params[0].dtype).replace("torch.", "")
    fmt = resolve_format(precision, dtype, dtype, definition.kernel)
    fmt = replace(fmt, grad_dtype="float32")
    return None if fmt.plain else fmt


def closure_and_amp(opt: Any, closure: Optional[Callable[[], Any]], grad_scale: Any, found_inf: Any):
    """(``closure()``'s loss, evaluated with grad enabled, or None; ``grad_scale``; ``found_inf``),
    the last two from the attributes of those names that ``torch.amp.GradScaler`` sets on
    optimizers with ``_step_supports_amp_scaling`` when not passed."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    if grad_scale is None:
        grad_scale = getattr(opt, "grad_scale", None)
    if found_inf is None:
        found_inf = getattr(opt, "found_inf", None)
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


class OptirsOptimizer(torch.optim.Optimizer):
    """Base of the optirs.torch optimizers: torch's Optimizer (param_groups, hooks, state,
    state_dict) over an optirs definition's one-launch step.

    Subclasses set ``definition_name`` and implement :meth:`_hyperparameters` (a param group to
    the definition's params record and the definition to run it with).
    """

    definition_name: str = ""
    _has_step_state: bool = True
    # GradScaler passes grad_scale / found_inf to step (torch's fused optimizers' contract).
    _step_supports_amp_scaling = True

    def __init__(self, params: Any, defaults: Dict[str, Any], *, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None):
        if foreach not in (None, False):
            raise UnsupportedOperationError(
                f"foreach={foreach!r}, expected None or False: optirs always runs one fused launch per "
                "(group, device, dtype)"
            )
        if fused not in (None, True):
            raise UnsupportedOperationError(
                f"fused={fused!r}, expected None or True: optirs always runs one fused launch (there is no "
                "unfused path to choose)"
            )
        if not isinstance(backend, str) or not backend:
            raise InvalidParameterError(f"backend={backend!r}, expected a backend name or 'auto'")
        if backend_options is not None and not isinstance(backend_options, dict):
            raise InvalidParameterError(f"backend_options={backend_options!r}, expected a dict or None")
        self._backend_name = backend
        self._backend_options = dict(backend_options or {})
        self._backends: Dict[str, Any] = {}
        self._buckets: Dict[tuple, Tuple[tuple, List[_Bucket]]] = {}
        # per-step work done once: each group's checked hyperparameters (keyed by their values),
        # its parameters' checks (keyed by the list and their memory), formats per dtype
        self._plans: Dict[int, tuple] = {}
        self._groups: Dict[int, tuple] = {}
        self._formats: Dict[tuple, Any] = {}
        super().__init__(params, defaults)

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
        return tuple(float(v.item()) if isinstance(v, torch.Tensor) else v for v in value)  # type: ignore[return-value]

    def _check_group(self, group: Dict[str, Any]):
        """(definition, hp, slots, precision) of a group, checked (the flags, the hyperparameters,
        capturable on an elementwise definition without a compact format)."""
        capturable = bool(group.get("capturable", False))
        check_flags(group, capturable_ok=True)
        name, hp = self._hyperparameters(group)
        definition = DEFINITIONS[name]
        precision = self._precision(group)
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
        return definition, hp, definition.state_slots(hp), precision

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        # Check the group's hyperparameters before torch adds it, so a bad group changes nothing.
        probe = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_group(probe)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts every state tensor but "step" to its floating-point parameter's dtype; the
        # masters and compact state keep their own: of 16-bit parameters everything (float32
        # masters and scales, bfloat16 moments, int8 codes), of float32 parameters the bfloat16
        # and integer tensors (a float64 value in a checkpoint is meant to arrive as float32).
        saved = state_dict.get("state", {})
        for saved_group, group in zip(state_dict.get("param_groups", []), self.param_groups):
            for index, p in zip(saved_group.get("params", []), group["params"]):
                entry = saved.get(index)
                if entry is None or p not in self.state:
                    continue
                for k, v in entry.items():
                    if k != "step" and isinstance(v, torch.Tensor) and (
                            p.dtype != STATE_DTYPE or v.dtype == torch.bfloat16 or not v.is_floating_point()):
                        self.state[p][k] = v.detach().to(device=p.device).clone()
        self._buckets.clear()  # the next step copies the loaded state into fresh flat buffers
        self._groups.clear()

    # ------------------------------------------------------------ the step

    def _backend_for(self, device: torch.device):
        backend = self._backends.get(device.type)
        if backend is None:
            backend = self._backends[device.type] = _open_backend(
                self._backend_name, self._backend_options, device.type)
        return backend

    def _param_step(self, p: torch.Tensor) -> int:
        state = self.state.get(p) if p in self.state else None
        if not state:
            return 0
        if self._has_step_state:
            step = state.get("step", 0)
            return int(step.item()) if isinstance(step, torch.Tensor) else int(step)
        # SGD: a momentum buffer (compact ones under momentum_buffer.codes / .scales) means it has stepped
        return 1 if any(k.split(".")[0] == "momentum_buffer" and v is not None for k, v in state.items()) else 0

    def _buckets_for(self, key: tuple, params: List[torch.Tensor], definition: OptimizerDefinition,
                     slots: Dict[str, float], fmt: Optional[Any] = None, hp: Any = None,
                     seed: int = 0, capturable: bool = False) -> List[_Bucket]:
        ids = tuple(map(id, params))
        hit = self._buckets.get(key)
        if hit is not None and hit[0] == ids:
            buckets = hit[1]
            if all(b.definition is definition and b.slots == slots and getattr(b, "storage", None) == fmt
                   and getattr(b, "seed", seed) == seed and (not capturable or b.device_steps)
                   and b.intact(self) for b in buckets):
                return buckets
        if type(self.state) is not _TrackedState:
            self.state = _TrackedState(self.state)  # (load_state_dict gives torch's plain one)
        backend = self._backend_for(params[0].device)
        if capturable and not backend.supports("capturable"):
            raise UnsupportedOperationError(
                f"capturable=True on {params[0].device.type} tensors, expected tensors on a device whose backend has "
                f"the 'capturable' capability (CUDA tensors on the cuda backend): backend {backend.name!r} implements "
                f"{sorted(backend.capabilities)}. torch's capturable optimizers refuse CPU tensors too")
        by_step: Dict[int, List[torch.Tensor]] = {}
        for p in params:
            by_step.setdefault(self._param_step(p), []).append(p)
        if fmt is not None:
            from optirs.torch._formats import _FormatBucket

            buckets = [_FormatBucket(self, definition, backend, ps, slots, step, fmt, hp, seed)
                       for step, ps in sorted(by_step.items())]
            self._buckets[key] = (ids, buckets)
            return buckets
        buckets = [_Bucket(self, definition, backend, ps, slots, step, device_steps=capturable)
                   for step, ps in sorted(by_step.items())]
        self._buckets[key] = (ids, buckets)
        return buckets

    def _bad_tensor(self, gi: int, j: int, p: torch.Tensor, g: torch.Tensor) -> None:
        """The error of a parameter / gradient the step cannot take (the fast check found one)."""
        if g.is_sparse:
            raise UnsupportedOperationError(
                f"param_groups[{gi}]['params'][{j}] has a sparse gradient, expected a dense one: "
                "use optirs.SparseAdam / optirs.SparseSgd (or torch.optim.SparseAdam) for sparse gradients"
            )
        if p.dtype not in PARAM_DTYPES or g.dtype not in (p.dtype, STATE_DTYPE):
            raise UnsupportedOperationError(
                f"param_groups[{gi}]['params'][{j}] is {p.dtype} with a {g.dtype} gradient, expected "
                "torch.float32, bfloat16 or float16 parameters with gradients of their dtype or float32"
            )
        if not p.is_contiguous() or not g.is_contiguous():
            raise ShapeMismatchError(
                f"param_groups[{gi}]['params'][{j}] or its gradient is not contiguous, expected contiguous tensors"
            )
        if g.shape != p.shape or g.device != p.device:
            raise ShapeMismatchError(
                f"param_groups[{gi}]['params'][{j}] has shape {tuple(p.shape)} on {p.device}, but its "
                f"gradient {tuple(g.shape)} on {g.device}; expected the same"
            )

    def _group_tensors(self, gi: int, group: Dict[str, Any]) -> Dict[tuple, List[torch.Tensor]]:
        """The group's parameters with a gradient, per (group, device, dtype), every one checked.

        The parameters' part (dtype, device, contiguity) is checked once per list of parameters
        and memory (their data_ptr); the gradients are new tensors every step under
        ``zero_grad(set_to_none=True)``, so theirs is checked every step, in one tight loop (torch
        itself guarantees that an assigned gradient has its parameter's shape and device)."""
        params = group["params"]
        grads = [p.grad for p in params]
        ptrs = tuple(map(torch.Tensor.data_ptr, params))
        cached = self._groups.get(gi)
        if cached is None or cached[0] != ptrs or cached[1] is not params or len(cached[2]) != len(params):
            keys = []
            for j, p in enumerate(params):
                if p.dtype not in PARAM_DTYPES or not p.is_contiguous():
                    keys.append(None)  # checked with its gradient below (a parameter without one is skipped)
                else:
                    keys.append((gi, str(p.device), p.dtype))
            cached = self._groups[gi] = (ptrs, params, keys)
            # the group's buckets were built on the old memory: intact() then need not re-read it
            for k in [k for k in self._buckets if k[0] == gi]:
                del self._buckets[k]
        keys = cached[2]
        out: Dict[tuple, List[torch.Tensor]] = {}
        for j, (p, g, key) in enumerate(zip(params, grads, keys)):
            if g is None:
                continue
            # (a sparse gradient is not contiguous: _bad_tensor names it)
            if key is None or not g.is_contiguous() or (g.dtype is not key[2] and g.dtype is not STATE_DTYPE):
                self._bad_tensor(gi, j, p, g)
            bucket = out.get(key)
            if bucket is None:
                out[key] = [p]
            else:
                bucket.append(p)
        return out

    def _grad_factor(self, group: Dict[str, Any], inv_scale: Optional[float]) -> float:
        """The scalars' ``grad_factor``: what the step multiplies every gradient element by first."""
        negate = bool(group.get("maximize", False)) and not self._native_maximize
        factor = 1.0 if inv_scale is None else inv_scale
        return -factor if negate else factor

    _native_maximize = False

    def _plan(self, gi: int, group: Dict[str, Any]):
        """(definition, hp, slots, precision) of a group, cached on its hyperparameters' values
        (the record is rebuilt, and checked, whenever a scheduler or the user changes one)."""
        items = []
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                # a tensor's value is read each step (capturable lr: on the device, not here)
                v = ("tensor", id(v)) if k == "lr" and group.get("capturable", False) else ("tensor", self._scalar(group, k) if v.numel() == 1 else id(v))
            elif isinstance(v, (list, tuple)):
                v = tuple(float(x.item()) if isinstance(x, torch.Tensor) else x for x in v)
            items.append((k, v))
        sig = tuple(items)
        cached = self._plans.get(gi)
        if cached is not None and cached[0] == sig:
            return cached[1]
        plan = self._check_group(group)
        self._plans[gi] = (sig, plan)
        return plan

    # Under torch.compile the step is a graph break: dynamo runs it eagerly rather than tracing
    # into the launch (and into numba's compiler on a first call).
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None):
        """One step of every param group; returns ``closure()``'s loss (evaluated with grad enabled).

        ``grad_scale`` / ``found_inf`` (or the attributes of the same names that
        ``torch.amp.GradScaler`` sets on optimizers with ``_step_supports_amp_scaling``): the
        gradients are unscaled by ``1 / grad_scale`` and nothing changes when ``found_inf`` is
        non-zero (the step count does not advance either), as torch's fused optimizers do. On a
        device whose backend has the ``capturable`` capability both stay on the device (no host
        synchronisation); on the CPU they are read on the host (free there).
        """
        loss, grad_scale, found_inf = closure_and_amp(self, closure, grad_scale, found_inf)
        amp = grad_scale is not None or found_inf is not None
        # Check every group first, so a bad one leaves every parameter and state as it was.
        plans = []
        for gi, group in enumerate(self.param_groups):
            definition, hp, slots, precision = self._plan(gi, group)
            capturable = bool(group.get("capturable", False))
            for key, params in self._group_tensors(gi, group).items():
                fmt = self._storage(precision, params, definition)
                if capturable and fmt is not None:
                    raise UnsupportedOperationError(
                        f"capturable=True on {key[2]} parameters, expected float32 ones: capturable steps run float32 "
                        "parameters and state")
                plans.append((key, params, definition, hp, slots, group, fmt, precision.seed, capturable))
        launches = []
        host_amp = False
        for key, params, definition, hp, slots, group, fmt, seed, capturable in plans:
            for bucket in self._buckets_for(key, params, definition, slots, fmt, hp, seed, capturable):
                if amp and fmt is None and not bucket.device_steps and self._device_amp(bucket, definition):
                    bucket.use_device_steps(self)
                device = fmt is None and bucket.device_steps
                host_amp |= amp and not device
                launches.append((bucket, hp, group, device))
        inv_scale = None
        if host_amp:
            # Buckets that step with host scalars read the AMP tensors on the host (free on the CPU).
            if found_inf is not None and float(found_inf) != 0.0:
                launches = [t for t in launches if t[3]]
            if grad_scale is not None:
                scale = float(grad_scale)
                if not (scale > 0.0 and np.isfinite(scale)):
                    raise InvalidParameterError(f"grad_scale={scale!r}, expected a finite scale > 0")
                inv_scale = 1.0 / scale
        for bucket, hp, group, device in launches:
            if device:
                self._launch_device(bucket, hp, group, grad_scale, found_inf)
            else:
                self._launch(bucket, hp, self._grad_factor(group, inv_scale))
        return loss

    def _storage(self, precision: Any, params: List[torch.Tensor], definition: OptimizerDefinition):
        key = (precision, params[0].dtype, definition.name)
        hit = self._formats.get(key, self)
        if hit is self:
            hit = self._formats[key] = _storage(precision, params, definition)
        return hit

    def _device_amp(self, bucket: _Bucket, definition: OptimizerDefinition) -> bool:
        """Whether the GradScaler's tensors can stay on the device for this bucket: a non-CPU
        bucket of an elementwise definition on a backend with the ``capturable`` capability."""
        return (not bucket.params[0].is_cpu and definition.name in FORMULAS
                and bucket.backend.supports("capturable"))

    # ------------------------------------------------------------ formats

    _FORMAT_KEYS = ("master_weights", "state_dtype", "stochastic_rounding", "seed")
    FORMAT_KEYS = _FORMAT_KEYS  # the step-format keywords a param group may set

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

    def _launch(self, bucket: _Bucket, hp: Any, factor: float) -> None:
        if getattr(bucket, "storage", None) is not None:
            bucket.launch(hp, factor)
            return
        backend = bucket.backend
        grads = [p.grad for p in bucket.params]
        garrays = bucket.grad_arrays(grads)
        staged = backend.stage(backend.ctx, bucket.param_arrays, garrays, None)
        scalars = bucket.definition.scalars(hp, bucket.step + 1, grad_factor=factor)
        backend.step(backend.ctx, StepRequest(bucket.definition, staged.params, staged.grads, bucket.device_state,
                                              bucket.layout, scalars, StepControls(bucket.step + 1)))
        if staged.finish is not None:
            staged.finish()
        bucket.step += 1
        if bucket.has_step:
            bucket.steps.fill_(float(bucket.step))

    @staticmethod
    def _on_device(t: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
        """A one-element float32 tensor on ``device`` with ``t``'s value: ``t`` itself where it is
        one (read in place, so a change between CUDA-graph replays takes effect), else a copy
        made on the stream (eager steps; under capture keep such tensors on the device)."""
        if t.numel() != 1:
            raise InvalidParameterError(f"{what} is a tensor of {t.numel()} elements, expected 1 element")
        t = t.detach()
        if t.dtype is STATE_DTYPE and t.device == device:
            return t
        return t.to(device=device, dtype=STATE_DTYPE).reshape(1)

    def _launch_device(self, bucket: _Bucket, hp: Any, group: Dict[str, Any], grad_scale: Optional[torch.Tensor],
                       found_inf: Optional[torch.Tensor]) -> None:
        """The backend's capturable pair: the scalars record computed on the device from the
        device step count, the lr (a float, or a tensor read at every step) and the gradient factor
        (maximize's sign over grad_scale), then the step reading it; found_inf skips both on the device."""
        definition, device = bucket.definition, bucket.device
        lr = group["lr"]
        lr_in = self._on_device(lr, device, "lr") if isinstance(lr, torch.Tensor) else float(lr)
        sign = -1.0 if bool(group.get("maximize", False)) and not self._native_maximize else 1.0
        inputs = DeviceStepInputs(
            steps=bucket.steps, record=bucket.record, constants=FORMULAS[definition.name].constants(hp), lr=lr_in,
            sign=sign, grad_scale=None if grad_scale is None else self._on_device(grad_scale, device, "grad_scale"),
            found_inf=None if found_inf is None else self._on_device(found_inf, device, "found_inf"))
        if bucket.type_record is None:
            bucket.type_record = definition.scalars(hp, 1)
        grads = [g.detach() if g.requires_grad else g for g in (p.grad for p in bucket.params)]
        backend = bucket.backend
        backend.step(backend.ctx, StepRequest(definition, bucket.param_arrays, grads, bucket.flat, bucket.layout,
                                              bucket.type_record, StepControls(device=inputs)))
