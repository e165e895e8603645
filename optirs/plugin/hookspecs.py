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

# ---- fused elementwise groups (section owned by the fusion work)
# A fusion plan (optirs.analysis.fusion) becomes one kernel per group. The ``fusion`` analysis
# plugin generates each group's source in every dialect (optirs_fusion_generate); a backend with
# the ``fusion`` capability compiles the dialect it runs (optirs_fusion_compile) and runs it on its
# own flat device arrays (optirs_fusion_run). Kernel text names no sizes, so a backend may cache
# compiled kernels by text and share them between groups and plans.

# Imported here (not at the top) to keep this section's edits within its banner.
from typing import TYPE_CHECKING  # noqa: E402

import numpy as np  # noqa: E402

if TYPE_CHECKING:  # types of the analysis layer, named in hook signatures only
    from optirs.analysis.fusion import FusionGraph, FusionGroup

FUSION_DIALECTS = ("numba-parallel", "numba-cuda", "opencl-c")
"""The languages fused kernels are generated in: Python for ``numba.njit(parallel=True)`` (function
``kernel_``), Python for ``numba.cuda.jit`` (``kernel_`` and, for reductions over all axes,
``finish_``), and OpenCL C (kernels ``kernel_`` [``finish_``], ``#include`` lines for
``optirs.backends.common.opencl_source``)."""


@dataclass(frozen=True)
class FusedKernelText:
    """One dialect's program for a fused group: its source text and its kernel's parameters, in order.

    Parameter names say what to pass: ``n`` (elements of the domain), ``chunk``, ``layout`` (A, K, B)
    or ``A_``/``K_``/``B_``, ``dims`` or ``d<k>`` (the domain), ``st<j>`` or ``s<j>_<k>`` (input j's
    element strides), ``in<j>``, ``out<j>`` (elementwise outputs), ``red<j>`` (reductions), ``part<j>``
    (float64 partials of an all-axes reduction, one per chunk, made by the backend).
    """

    dialect: str
    text: str
    params: Tuple[str, ...]


@dataclass(frozen=True)
class FusedGroupSource:
    """The generated source of one fused group, with its arity, dtypes and sizes.

    Outputs are the group's elementwise outputs (written at each element's flat index), then its
    reductions (``reductions[j]`` is ``"sum"`` or ``"max"``; sums accumulate in float64).
    """

    group: int
    input_names: Tuple[str, ...]  # the graph values read, one per input
    output_names: Tuple[str, ...]  # the graph values written, one per output
    domain: Tuple[int, ...]
    input_dtypes: Tuple[np.dtype, ...]
    input_strides: Tuple[Tuple[int, ...], ...]  # element strides along the domain, 0 where broadcast
    output_dtypes: Tuple[np.dtype, ...]
    output_sizes: Tuple[int, ...]
    reductions: Tuple[str, ...]
    layout: Optional[Tuple[int, int, int]]  # (A, K, B) of a one-axis reduction, else None
    chunk: int  # elements per partial of an all-axes reduction
    kernels: Tuple[FusedKernelText, ...]

    @property
    def arity(self) -> Tuple[int, int]:
        """(inputs, outputs)."""
        return len(self.input_dtypes), len(self.output_dtypes)

    @property
    def elements(self) -> int:
        """Elements of the iteration domain (the ``n`` of :func:`optirs_fusion_run`)."""
        return int(np.prod(self.domain, dtype=np.int64))

    def kernel(self, dialect: str) -> FusedKernelText:
        """The program in ``dialect``.

        :raises UnsupportedOperationError: when it was not generated in that dialect.
        """
        for k in self.kernels:
            if k.dialect == dialect:
                return k
        from optirs.core.errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"fused group {self.group}: dialect {dialect!r} was not generated; have {[k.dialect for k in self.kernels]}"
        )


@dataclass(frozen=True)
class CompiledFusedKernel:
    """A fused group compiled by a backend: what it was made from and the backend's own kernel object.

    ``kernel`` is of the backend's own kind (a numba dispatcher, a pyopencl kernel, ...); only the
    backend that made it reads it. ``extra`` holds whatever else that backend keeps with it.
    """

    source: FusedGroupSource
    text: str  # the program text compiled (the backend's dialect, headers inlined)
    kernel: Any
    extra: Any = None


@hookspec(firstresult=True)
def optirs_fusion_generate(graph: "FusionGraph", group: "FusionGroup") -> Optional[FusedGroupSource]:
    """Generate the kernels of one fused group in every dialect a plugin knows. Stops at the first non-None result.

    :param graph: the :class:`optirs.analysis.fusion.FusionGraph` the group belongs to.
    :param group: the :class:`optirs.analysis.fusion.FusionGroup` (not opaque) to generate.
    :return: the group's :class:`FusedGroupSource`, or None to defer to another plugin.
    """


@hookspec
def optirs_fusion_compile(ctx: Any, source: FusedGroupSource) -> CompiledFusedKernel:
    """Compile one fused group's kernel in this backend's dialect; the handle goes to :func:`optirs_fusion_run`.

    :param ctx: the context from :func:`optirs_open`.
    :param source: the group's generated source, dtypes and sizes.
    :return: the compiled kernel, holding ``source``.
    :raises optirs.UnsupportedOperationError: when the device cannot run it (e.g. no float64), or
        ``source`` lacks this backend's dialect.
    """


@hookspec
def optirs_fusion_run(ctx: Any, compiled: CompiledFusedKernel, inputs: Sequence[Any], outputs: Sequence[Any], n: int) -> None:
    """Run one compiled fused group: read ``inputs``, write ``outputs`` (queued; synchronize to wait).

    :param ctx: the context from :func:`optirs_open`.
    :param compiled: what :func:`optirs_fusion_compile` returned on this context.
    :param inputs: flat device arrays of this backend (as :func:`optirs_to_device` makes), one per
        ``source.input_dtypes``, in order.
    :param outputs: flat device arrays of this backend (as :func:`optirs_alloc` makes), one per
        ``source.output_dtypes`` and of ``source.output_sizes``, written in place.
    :param n: elements of the group's domain (``source.elements``).
    """


# Capability name -> the hooks a backend implements to offer it (all of them).
CAPABILITIES: Dict[str, Tuple[str, ...]] = {
    "fusion": ("optirs_fusion_compile", "optirs_fusion_run"),
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
