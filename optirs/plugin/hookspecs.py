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

import numpy as np
import pluggy

from optirs.core.arrays import ArrayMeta
from optirs.core.layout import TensorLayout

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
# optirs.optim.mixed_precision.MixedPrecisionOptimizer steps float16/bfloat16 parameters over
# float32 master weights that live on the backend. Per step it describes the caller's half arrays,
# runs one unscale pass (half gradients -> float32 buffer, flagging inf/NaN) and, when the step is
# applied, one narrow pass (float32 masters -> rounded half parameters). Both passes cover every
# tensor of ``layout``; float16 rounds as numpy's cast, bfloat16 as ml_dtypes' (nearest even).


@hookspec
def optirs_mixed_precision_describe(ctx: Any, array: Any, what: str, half_dtype: np.dtype) -> ArrayMeta:
    """Describe one of the caller's half-precision arrays as the mixed-precision passes will read it.

    The backend checks that ``array`` is its own kind (e.g. a numpy array on the host, a CUDA
    device array, a ``pyopencl.array.Array``) and reports its dtype as the passes see it (the
    cuda backend reports ``half_dtype`` for bfloat16 tensors handed over as uint16/int16 bit
    patterns, since ``__cuda_array_interface__`` has no bfloat16). The caller compares dtypes,
    shapes, contiguity, writeability and addresses itself.

    :param ctx: the context from :func:`optirs_open`.
    :param array: a parameter or gradient of the caller (the backend's device array kind).
    :param what: how error messages name the array, e.g. ``"params[3]"``.
    :param half_dtype: the dtype the caller configured: numpy float16 or ml_dtypes bfloat16.
    :return: an :class:`optirs.core.arrays.ArrayMeta`; ``address`` tells aliases apart
        (0 when unknown).
    :raises optirs.InvalidParameterError: when ``array`` is not an array this backend can use,
        naming ``what`` and the kind expected.
    """


@hookspec
def optirs_mixed_precision_unscale(ctx: Any, grads: List[Any], out: Any, layout: TensorLayout,
                                   inv_scale: np.float32, bfloat16: bool) -> bool:
    """Write ``float32(grad) * inv_scale`` of every half gradient into ``out`` and tell whether any is inf/NaN.

    One pass over the model (one call on the CPU; on devices at most one launch per tensor).
    A finite half gradient whose product overflows float32 counts as non-finite.

    :param ctx: the context from :func:`optirs_open`.
    :param grads: the caller's half gradients (checked by :func:`optirs_mixed_precision_describe`),
        one per tensor of ``layout``, any shape with that tensor's size.
    :param out: a flat float32 device array of ``layout.total`` elements (from :func:`optirs_alloc`);
        tensor ``t`` goes to ``out[layout.offsets[t]:][:layout.sizes[t]]``.
    :param layout: the model's :class:`optirs.core.layout.TensorLayout`; backends may keep
        prepared data in ``layout.cache``.
    :param inv_scale: 1 / loss scale, a float32 value; products are float32.
    :param bfloat16: True when the gradients are bfloat16, False for float16.
    :return: True when any unscaled value is inf or NaN (``out`` then holds them, and the caller
        skips the step).
    """


@hookspec
def optirs_mixed_precision_narrow(ctx: Any, masters: Any, params: List[Any], layout: TensorLayout,
                                  bfloat16: bool) -> None:
    """Round the float32 master weights to nearest even into the caller's half parameters, in place.

    One pass over the model, like :func:`optirs_mixed_precision_unscale`. NaN stays NaN (float16
    keeps the top payload bits, bfloat16 becomes the quiet NaN, as ml_dtypes), values beyond the
    half range become inf.

    :param ctx: the context from :func:`optirs_open`.
    :param masters: the flat float32 device array of master weights, laid out by ``layout``.
    :param params: the caller's half parameters (checked by :func:`optirs_mixed_precision_describe`),
        one per tensor of ``layout``; overwritten.
    :param layout: the model's :class:`optirs.core.layout.TensorLayout`.
    :param bfloat16: True when the parameters are bfloat16, False for float16.
    """

# ---- sparse rows (section owned by the sparse work)

# ---- replica reduction (section owned by the data-parallel work)

# ---- fake quantization (section owned by the quantization work)

# ---- fused elementwise groups (section owned by the fusion work)


# Capability name -> the hooks a backend implements to offer it (all of them).
CAPABILITIES: Dict[str, Tuple[str, ...]] = {
    "mixed_precision": ("optirs_mixed_precision_describe", "optirs_mixed_precision_unscale",
                        "optirs_mixed_precision_narrow"),
}


STEP_HOOKS = {
    "adam": "optirs_step_adam",
    "adamw": "optirs_step_adamw",
    "sgd": "optirs_step_sgd",
    "rmsprop": "optirs_step_rmsprop",
    "adagrad": "optirs_step_adagrad",
    "lamb": "optirs_step_lamb",
}
OPTIMIZER_NAMES = tuple(STEP_HOOKS)
