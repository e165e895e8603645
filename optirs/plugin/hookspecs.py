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
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import pluggy

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

# ---- sparse rows (section owned by the sparse work)

# ---- replica reduction (section owned by the data-parallel work)

# ---- fake quantization (section owned by the quantization work)


class FakeQuantGrid(NamedTuple):
    """One integer fake-quant call's grid, in the flat layout the kernels walk.

    Element ``i`` of the C-ordered input belongs to channel ``(i // inner) % channels``; per
    tensor, ``channels`` is 1 and ``inner`` the size. Every float is float32, as torch's CPU kernel
    computes it (:mod:`optirs.analysis.quantization` builds the record and states the arithmetic).
    """

    shape: Tuple[int, ...]  # the input's shape (results have it too)
    size: int  # the number of elements
    inv_scale: np.ndarray  # float32 (channels,): 1.0f / scale, inf for a subnormal scale as in torch
    scale: np.ndarray  # float32 (channels,)
    zero_point: np.ndarray  # float32 (channels,), integral values
    quant_min: np.float32
    quant_max: np.float32
    inner: int  # elements of one channel's contiguous run
    channels: int
    int64_cast: bool  # per channel: torch casts q to int64 before clamping (NaN, inf, >= 2**63 -> quant_min)


class StochasticKeys(NamedTuple):
    """The two 32-bit hash keys of stochastic rounding, derived from the caller's seed: element ``i``
    draws ``u`` in [0, 1) from a hash of (keys, i), so every backend gives the same bits."""

    key_lo: np.uint64
    key_hi: np.uint64


@hookspec
def optirs_fake_quant_forward(ctx: Any, x: Any, grid: FakeQuantGrid,
                              rounding: Optional[StochasticKeys]) -> Tuple[Any, Any]:
    """Fake-quantize ``x`` on ``grid`` (quantize, clamp, dequantize), bit for bit as torch's CPU kernel.

    :param ctx: the context from :func:`optirs_open`.
    :param x: float32 input of ``grid.shape``: a host numpy array (uploaded, results read back), or
        this backend's own device array (read in place, results left on the device).
    :param grid: the scales, zero points, range and flat channel layout.
    :param rounding: None rounds half to even (torch's ``nearbyint``); :class:`StochasticKeys` round
        down, then up with probability of the fraction, drawing from the keyed hash.
    :return: ``(out, mask)``, new arrays of ``grid.shape`` of the same kind as ``x``: the float32
        values and the straight-through mask ``quant_min <= q <= quant_max`` (bool on the host; a
        device may hold it as bool or uint8).
    :raises optirs.UnsupportedOperationError: for an array this backend cannot read (another
        backend's device array).
    :raises optirs.ShapeMismatchError: for a device array that is not C-contiguous.
    """


@hookspec
def optirs_fake_quant_backward(ctx: Any, x: Any, grad: Any, grid: FakeQuantGrid) -> Any:
    """The straight-through gradient: ``grad`` where ``x`` quantizes inside the range (bits unchanged), ``grad * 0`` elsewhere.

    :param ctx: the context from :func:`optirs_open`.
    :param x: the forward input, as for :func:`optirs_fake_quant_forward`.
    :param grad: float32 gradient of ``grid.shape``, the same kind of array as ``x``.
    :param grid: the grid the forward pass used.
    :return: a new float32 array of ``grid.shape``, of the same kind as ``x``.
    :raises optirs.UnsupportedOperationError: for arrays this backend cannot read.
    :raises optirs.ShapeMismatchError: for a device array that is not C-contiguous.
    """

# ---- fused elementwise groups (section owned by the fusion work)


# Capability name -> the hooks a backend implements to offer it (all of them).
CAPABILITIES: Dict[str, Tuple[str, ...]] = {
    "fake_quant": ("optirs_fake_quant_forward", "optirs_fake_quant_backward"),
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
