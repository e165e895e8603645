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

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.layout import TensorLayout

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


class _Bucket:
    """One launch's worth: the tensors of one group on one device with one dtype and one step count."""

    def __init__(self, opt: "OptirsOptimizer", definition: OptimizerDefinition, backend, params: List[torch.Tensor],
                 slots: Dict[str, float], step: int):
        self.definition, self.backend, self.params = definition, backend, params
        self.key = tuple(map(id, params))
        self.slots = slots
        device = params[0].device
        self.layout = TensorLayout([tuple(p.shape) for p in params])
        self.state_layout = definition.state_layout(self.layout, tuple(slots))
        sizes = self.state_layout.buffer_sizes()
        self.flat = {k: torch.full((sizes[k],), fill, dtype=STATE_DTYPE, device=device) for k, fill in slots.items()}
        self.views = {k: _slot_views(self.state_layout, k, v) for k, v in self.flat.items()}
        self.device_state = {k: _state_array(backend, v) for k, v in self.flat.items()}
        self.param_arrays = [_host_array(backend, p) for p in params]
        self.param_ptrs = [p.data_ptr() for p in params]
        self.step = step
        self.has_step = opt._has_step_state
        # torch keeps one 0-dim float32 "step" tensor per parameter; here they are views of one
        # buffer, written once per step.
        self.steps = torch.full((len(params),), float(step), dtype=torch.float32)
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

    def intact(self, opt: "OptirsOptimizer") -> bool:
        """Whether opt.state still holds this bucket's views (nothing replaced them)."""
        state = opt.state
        for p, entry, ptr in zip(self.params, self.entries, self.param_ptrs):
            if state.get(p) is not entry or p.data_ptr() != ptr:
                return False
        for i, entry in enumerate(self.entries):
            for k, views in self.views.items():
                v = views[i]
                if v is not None and entry.get(k) is not v:
                    return False
            if self.has_step and entry.get("step") is not self.step_views[i]:
                return False
        return True

    def grad_arrays(self, grads: List[torch.Tensor]):
        """The gradients as the backend reads them: the tensors themselves (maximize and the
        GradScaler's unscale are the scalars' ``grad_factor``, applied inside the step)."""
        return [_host_array(self.backend, g) for g in grads]


def _storage(precision: Any, params: List[torch.Tensor], definition: OptimizerDefinition):
    """The storage format of a bucket's tensors (None: float32 tensors and state, the step hook).

    The gradients' dtype is resolved per launch (they may be unscaled into float32)."""
    from dataclasses import replace

    from optirs.core.formats import resolve_format

    dtype = str(params[0].dtype).replace("torch.", "")
    fmt = resolve_format(precision, dtype, dtype, definition.kernel)
    fmt = replace(fmt, grad_dtype="float32")
    return None if fmt.plain else fmt


def _check_flags(group: Dict[str, Any]) -> None:
    if group.get("differentiable", False):
        raise UnsupportedOperationError(
            "differentiable=True, expected False: optirs steps parameters in place in its own kernels, "
            "outside autograd"
        )
    if group.get("capturable", False):
        raise UnsupportedOperationError(
            "capturable=True, expected False: CUDA-graph capture (step count and lr on the device) "
            "is not available in optirs.torch yet"
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
            return float(value.item())
        return value

    @staticmethod
    def _pair(group: Dict[str, Any], key: str = "betas") -> Tuple[Any, Any]:
        value = group[key]
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            raise InvalidParameterError(f"{key}={value!r}, expected a pair of floats")
        return tuple(float(v.item()) if isinstance(v, torch.Tensor) else v for v in value)  # type: ignore[return-value]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        # Check the group's hyperparameters before torch adds it, so a bad group changes nothing.
        probe = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        _check_flags(probe)
        self._hyperparameters(probe)
        self._precision(probe)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating-point state to its parameter's dtype; the masters and compact state
        # of 16-bit parameters keep their own (float32 masters and scales, bfloat16 moments).
        saved = state_dict.get("state", {})
        for saved_group, group in zip(state_dict.get("param_groups", []), self.param_groups):
            for index, p in zip(saved_group.get("params", []), group["params"]):
                entry = saved.get(index)
                if p.dtype == STATE_DTYPE or entry is None or p not in self.state:
                    continue
                for k, v in entry.items():
                    if k != "step" and isinstance(v, torch.Tensor):
                        self.state[p][k] = v.detach().to(device=p.device).clone()
        self._buckets.clear()  # the next step copies the loaded state into fresh flat buffers

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
                     seed: int = 0) -> List[_Bucket]:
        ids = tuple(map(id, params))
        hit = self._buckets.get(key)
        if hit is not None and hit[0] == ids:
            buckets = hit[1]
            if all(b.definition is definition and b.slots == slots and getattr(b, "storage", None) == fmt
                   and getattr(b, "seed", seed) == seed and b.intact(self) for b in buckets):
                return buckets
        backend = self._backend_for(params[0].device)
        by_step: Dict[int, List[torch.Tensor]] = {}
        for p in params:
            by_step.setdefault(self._param_step(p), []).append(p)
        if fmt is not None:
            from optirs.torch._formats import _FormatBucket

            buckets = [_FormatBucket(self, definition, backend, ps, slots, step, fmt, hp, seed)
                       for step, ps in sorted(by_step.items())]
            self._buckets[key] = (ids, buckets)
            return buckets
        buckets = [_Bucket(self, definition, backend, ps, slots, step) for step, ps in sorted(by_step.items())]
        self._buckets[key] = (ids, buckets)
        return buckets

    def _group_tensors(self, gi: int, group: Dict[str, Any]) -> Dict[tuple, List[torch.Tensor]]:
        out: Dict[tuple, List[torch.Tensor]] = {}
        for j, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
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
            out.setdefault((gi, str(p.device), p.dtype), []).append(p)
        return out

    def _grad_factor(self, group: Dict[str, Any], inv_scale: Optional[float]) -> float:
        """The scalars' ``grad_factor``: what the step multiplies every gradient element by first."""
        negate = bool(group.get("maximize", False)) and not self._native_maximize
        factor = 1.0 if inv_scale is None else inv_scale
        return -factor if negate else factor

    _native_maximize = False

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
        non-zero (the step count does not advance either), as torch's fused optimizers do.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return loss
        inv_scale = None
        if grad_scale is not None:
            scale = float(grad_scale)
            if not (scale > 0.0 and np.isfinite(scale)):
                raise InvalidParameterError(f"grad_scale={scale!r}, expected a finite scale > 0")
            inv_scale = 1.0 / scale
        # Check every group first, so a bad one leaves every parameter and state as it was.
        plans = []
        for gi, group in enumerate(self.param_groups):
            _check_flags(group)
            name, hp = self._hyperparameters(group)
            definition = DEFINITIONS[name]
            slots = definition.state_slots(hp)
            precision = self._precision(group)
            for key, params in self._group_tensors(gi, group).items():
                fmt = _storage(precision, params, definition)
                plans.append((key, params, definition, hp, slots, self._grad_factor(group, inv_scale), fmt,
                              precision.seed))
        for key, params, definition, hp, slots, factor, fmt, seed in plans:
            for bucket in self._buckets_for(key, params, definition, slots, fmt, hp, seed):
                self._launch(bucket, hp, factor)
        return loss

    # ------------------------------------------------------------ formats

    _FORMAT_KEYS = ("master_weights", "state_dtype", "stochastic_rounding", "seed")

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
        staged = backend.stage(backend.ctx, bucket.param_arrays, garrays)
        scalars = bucket.definition.scalars(hp, bucket.step + 1, grad_factor=factor)
        backend.step_fn(bucket.definition.name)(backend.ctx, staged.params, staged.grads, bucket.device_state,
                                                bucket.layout, scalars)
        if staged.finish is not None:
            staged.finish()
        bucket.step += 1
        if bucket.has_step:
            bucket.steps.fill_(float(bucket.step))
