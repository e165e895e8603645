"""The plugin interface of optirs, as pluggy hook specifications.

A *backend* is one plugin object registered under its name (``cpu``, ``cuda``, ``opencl``, or a
third party's entry-point name). The registry binds a chosen backend's own implementations once;
the hot path calls them directly and never loops over every plugin. A backend may implement a
subset of the step hooks: the capability matrix (``optirs info``) is read from which it implements.

An *analysis* plugin (occupancy, fusion, quantization, ...) answers the analysis hooks at the end.

Lifecycle: ``optirs_probe`` (cheap, never raises) -> ``optirs_open`` (a context) -> per step
``optirs_stage`` -> ``optirs_step_<optimizer>`` -> ``Staged.finish()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pluggy

from optirs.core.layout import TensorLayout
from optirs.core.scalars import AdafactorScalars, LionScalars

PROJECT = "optirs"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class DeviceInfo:
    """One device a backend can run on, as ``optirs info`` shows it."""

    name: str
    kind: str = "cpu"  # "gpu", "cpu", "accelerator", "simulator"
    memory_bytes: Optional[int] = None
    compute_units: Optional[int] = None
    details: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend opens on this machine, why not if not, and its devices."""

    available: bool
    reason: str = ""
    devices: Sequence[DeviceInfo] = ()


@dataclass
class Staged:
    """Parameters and gradients as the backend's own flat (1-D) device arrays for one step.

    ``finish`` runs after a successful step, e.g. to copy updated parameters back into the
    caller's numpy arrays; it is not called when the step failed, so the caller's arrays keep
    their values.
    """

    params: List[Any]
    grads: List[Any]
    finish: Optional[Callable[[], None]] = None


# ---------------------------------------------------------------- describing and probing


@hookspec
def optirs_plugin_info() -> Dict[str, str]:
    """Describe this plugin for ``optirs info``.

    :return: a dict with at least ``summary`` (one line) and optionally ``version``.
    """


@hookspec
def optirs_probe(options: Dict[str, Any]) -> ProbeResult:
    """Tell whether this backend can open here, cheaply, without raising.

    :param options: backend options from :class:`optirs.GpuOptimizerConfig` (``device``,
        ``platform``, ...).
    :return: a :class:`ProbeResult` naming the reason when unavailable and the devices otherwise.
    """


@hookspec
def optirs_open(options: Dict[str, Any]) -> Any:
    """Open the backend on the device the options choose and return its context.

    The context is passed back as ``ctx`` to every other backend hook.

    :param options: backend options, as for :func:`optirs_probe`.
    :raises optirs.BackendUnavailableError: when it cannot open, saying why.
    """


# ---------------------------------------------------------------- memory and transfer


@hookspec
def optirs_alloc(ctx: Any, size: int, dtype: Any, fill: float) -> Any:
    """Allocate a flat device array of ``size`` elements of ``dtype``, every element ``fill``.

    :param ctx: the context from :func:`optirs_open`.
    :param size: number of elements.
    :param dtype: a numpy dtype.
    :param fill: the initial value of every element.
    :raises optirs.DeviceMemoryError: when the device cannot hold it (sizes asked and free in the message).
    """


@hookspec
def optirs_to_device(ctx: Any, array: Any) -> Any:
    """Copy a host numpy array to a new flat device array of the same dtype.

    :param ctx: the context from :func:`optirs_open`.
    :param array: a numpy array.
    """


@hookspec
def optirs_to_host(ctx: Any, array: Any) -> Any:
    """Copy a device array (as made by this backend) to a new flat numpy array.

    :param ctx: the context from :func:`optirs_open`.
    :param array: a device array made by this backend.
    """


@hookspec
def optirs_stage(ctx: Any, params: List[Any], grads: List[Any]) -> Staged:
    """Make one step's inputs usable by the step hooks.

    Host numpy arrays are uploaded (and written back by ``Staged.finish``); the backend's own
    device arrays are used in place, without copies. Shapes, dtypes and contiguity were checked
    by the caller.

    :param ctx: the context from :func:`optirs_open`.
    :param params: the caller's parameter arrays (numpy or the backend's device kind).
    :param grads: the caller's gradient arrays, same kinds and shapes.
    :raises optirs.InvalidParameterError: for an array kind this backend cannot use.
    """


@hookspec
def optirs_synchronize(ctx: Any) -> None:
    """Wait until all work queued on the context's device has finished.

    :param ctx: the context from :func:`optirs_open`.
    """


# ---------------------------------------------------------------- optimizer steps
# Every step hook updates ``params`` and the flat ``state`` buffers in place, for all tensors of
# the model at once (one launch per step). ``state`` maps slot names to flat device arrays laid
# out by ``layout`` (optirs.core.layout.TensorLayout); ``scalars`` is the optimizer's record from
# optirs.core.scalars, already rounded to float32.


@hookspec
def optirs_step_adam(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: Any, scalars: Any) -> None:
    """Adam with L2 weight decay (``scalars.decoupled`` False); state: exp_avg, exp_avg_sq[, max_exp_avg_sq]."""


@hookspec
def optirs_step_adamw(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: Any, scalars: Any) -> None:
    """AdamW, decoupled weight decay (``scalars.decoupled`` True); state as Adam."""


@hookspec
def optirs_step_sgd(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: Any, scalars: Any) -> None:
    """SGD; state: momentum_buffer when ``scalars.has_momentum``."""


@hookspec
def optirs_step_rmsprop(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: Any, scalars: Any) -> None:
    """RMSprop; state: square_avg[, momentum_buffer][, grad_avg]."""


@hookspec
def optirs_step_adagrad(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: Any, scalars: Any) -> None:
    """Adagrad; state: sum."""


@hookspec
def optirs_step_lamb(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: Any, scalars: Any) -> None:
    """LAMB with per-tensor trust ratios and optional global gradient clipping; state: exp_avg, exp_avg_sq."""


# The six step hooks share their arguments; document them once.
_STEP_ARGS = """

:param ctx: the context from :func:`optirs_open`.
:param params: the model's parameters as staged by :func:`optirs_stage` (flat device arrays), updated in place.
:param grads: the gradients, staged like ``params``.
:param state: slot name -> flat device array holding every tensor's state, updated in place.
:param layout: the :class:`optirs.core.layout.TensorLayout` (offsets, chunk table, ``cache``).
:param scalars: the per-step record from :mod:`optirs.core.scalars`, already float32.
"""
for _step in (optirs_step_adam, optirs_step_adamw, optirs_step_sgd, optirs_step_rmsprop, optirs_step_adagrad,
              optirs_step_lamb):
    _step.__doc__ = (_step.__doc__ or "") + _STEP_ARGS


@hookspec
def optirs_step_lion(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: TensorLayout,
                     scalars: LionScalars) -> None:
    """Lion (sign of the interpolated momentum, decoupled weight decay); state: exp_avg.

    :param ctx: the context from :func:`optirs_open`.
    :param params: the model's parameters as staged by :func:`optirs_stage` (the backend's flat device
        arrays), updated in place.
    :param grads: the gradients, staged like ``params``.
    :param state: ``{"exp_avg": flat device array}`` holding every tensor's momentum at ``layout``'s offsets,
        updated in place.
    :param layout: the model's tensor shapes, offsets and chunk table.
    :param scalars: the step's float32 scalars (:func:`optirs.core.scalars.lion_scalars`).
    """


@hookspec
def optirs_step_adafactor(ctx: Any, params: List[Any], grads: List[Any], state: Dict[str, Any], layout: TensorLayout,
                          scalars: AdafactorScalars) -> None:
    """Adafactor as torch.optim.Adafactor, with its per-tensor and row/column reductions; state:
    row_var, col_var, variance, laid out by :class:`optirs.core.factored.FactoredLayout` (not by ``layout``).

    A tensor of 2+ dims keeps a row mean per row and a column mean per column of its last two dims
    (``row_var``, ``col_var``), a 0-1 dim tensor a full ``variance``; the step size uses RMS(p) per
    tensor and the update is clipped by its RMS, so a backend reduces per tensor before it writes p.

    :param ctx: the context from :func:`optirs_open`.
    :param params: the model's parameters as staged by :func:`optirs_stage` (the backend's flat device
        arrays), updated in place.
    :param grads: the gradients, staged like ``params``.
    :param state: ``{"row_var", "col_var", "variance"}`` -> flat float32 device arrays of at least
        ``optirs.core.factored.factored_layout(layout).buffer_sizes()`` elements, updated in place.
    :param layout: the model's tensor shapes and offsets; the slots' own offsets come from
        ``optirs.core.factored.factored_layout(layout)``.
    :param scalars: the step's float32 scalars (:func:`optirs.core.scalars.adafactor_scalars`).
    """


# ---------------------------------------------------------------- analysis


@hookspec(firstresult=True)
def optirs_launch_config(kernel: Any, device: Any, elements: int) -> Optional[Any]:
    """Choose (grid, block) for a compiled CUDA kernel on a device. Stops at the first non-None result.

    :param kernel: the compiled kernel (register and shared-memory use are read from it).
    :param device: the device whose limits apply (a numba CUDA device, or compute capability tuple).
    :param elements: how many work items the launch must cover.
    :return: ``(grid, block)`` or None to defer to another plugin.
    """


# ---------------------------------------------------------------- capabilities beyond the dense step
# Each feature above the interface asks the bound backend for a capability: the hooks listed in
# CAPABILITIES. A backend that lacks one raises UnsupportedOperationError naming the backend and the
# capability. Sections below are grouped by capability; each starts with its banner.

# ---- mixed precision (section owned by the mixed-precision work)

# ---- sparse rows (section owned by the sparse work)

# ---- replica reduction (section owned by the data-parallel work)

# ---- fake quantization (section owned by the quantization work)

# ---- fused elementwise groups (section owned by the fusion work)


# Capability name -> the hooks a backend implements to offer it (all of them).
CAPABILITIES: Dict[str, Tuple[str, ...]] = {
}


STEP_HOOKS = {
    "adam": "optirs_step_adam",
    "adamw": "optirs_step_adamw",
    "sgd": "optirs_step_sgd",
    "rmsprop": "optirs_step_rmsprop",
    "adagrad": "optirs_step_adagrad",
    "lamb": "optirs_step_lamb",
    "lion": "optirs_step_lion",
    "adafactor": "optirs_step_adafactor",
}
OPTIMIZER_NAMES = tuple(STEP_HOOKS)
