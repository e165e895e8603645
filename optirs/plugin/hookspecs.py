"""The plugin interface of optirs, as pluggy hook specifications: THE backend interface.

A *backend* is one plugin object registered under its name (``cpu``, ``cuda``, ``opencl``, or a
third party's entry-point name). The registry binds a chosen backend's own implementations once;
the hot path calls them directly and never loops over every plugin. A backend may implement a
subset of the hooks: every feature asks the bound backend for a *capability* (a set of hooks,
:data:`CAPABILITIES`), and what a backend lacks raises ``UnsupportedOperationError`` naming the
backend and the capability. The capability matrix of ``optirs info`` is read from the hooks each
plugin implements.

An *analysis* plugin (occupancy, fusion, quantization, ...) answers the analysis hooks.

Lifecycle: ``optirs_probe`` (cheap, never raises) -> ``optirs_open`` (a context) -> per step
``optirs_stage`` -> ``optirs_step`` (one hook for every optimizer, format and control) ->
``Staged.finish()``.

Backend hooks are called on the bound backend only, so none of them is ``firstresult``; the
analysis hooks are called on every plugin, and say so where the first answer wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

import numpy as np
import pluggy

from optirs.core.arrays import ArrayMeta
from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.formats import FormatState, StepFormat
from optirs.core.layout import TensorLayout
from optirs.core.scalars import AdamScalars, SgdScalars

PROJECT = "optirs"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------- the types that cross the interface


@runtime_checkable
class DeviceArray(Protocol):
    """A flat array in a backend's memory: numpy on the host, a numba/CuPy/torch CUDA array, a
    ``pyopencl.array.Array``, or a third party's own kind. optirs reads only its shape and dtype;
    everything else is the backend's business."""

    @property
    def shape(self) -> Tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...


class BackendContext(Protocol):
    """What a backend's :func:`optirs_open` returns and every other backend hook receives as ``ctx``:
    the opened device with the backend's caches (kernels, queues, staging buffers). Opaque to optirs."""


# Slot name -> flat device array holding that state slot for every tensor of the model.
SlotBuffers = Dict[str, DeviceArray]


class StepScalars(Protocol):
    """The per-step scalars record of one kernel family (a NamedTuple of ``numpy.float32`` and
    ``bool`` fields from :mod:`optirs.core.scalars`), already rounded to float32 on the host."""

    _fields: Tuple[str, ...]


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


class AddressedArrays(list):
    """A list of device arrays that carries their addresses (``addresses``: one int per array, in
    order), read by whoever made it. A front end that has read its arrays' addresses anyway (to
    see that nothing moved since the last step) hands them over this way, vouching that the
    arrays are of the backend's device kind, C-contiguous and of the step's dtypes; a backend
    whose kernels read addresses then stages them without reading each array again. To every
    other backend it is a plain list."""

    __slots__ = ("addresses",)

    def __init__(self, arrays: Sequence[Any], addresses: Tuple[int, ...]):
        super().__init__(arrays)
        self.addresses = addresses


@dataclass
class Staged:
    """Parameters and gradients as the backend's own flat (1-D) device arrays for one step.

    ``finish`` runs after a successful step, e.g. to copy updated parameters back into the
    caller's numpy arrays; it is not called when the step failed, so the caller's arrays keep
    their values.
    """

    params: List[DeviceArray]
    grads: List[DeviceArray]
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
def optirs_open(options: Dict[str, Any]) -> BackendContext:
    """Open the backend on the device the options choose and return its context.

    The context is passed back as ``ctx`` to every other backend hook.

    :param options: backend options, as for :func:`optirs_probe`.
    :return: the backend's context.
    :raises optirs.BackendUnavailableError: when it cannot open, saying why.
    """


# ---------------------------------------------------------------- memory and transfer


@hookspec
def optirs_alloc(ctx: BackendContext, size: int, dtype: np.dtype, fill: float) -> DeviceArray:
    """Allocate a flat device array of ``size`` elements of ``dtype``, every element ``fill``.

    :param ctx: the context from :func:`optirs_open`.
    :param size: number of elements.
    :param dtype: a numpy dtype.
    :param fill: the initial value of every element.
    :return: the new device array.
    :raises optirs.DeviceMemoryError: when the device cannot hold it (sizes asked and free in the message).
    """


@hookspec
def optirs_to_device(ctx: BackendContext, array: np.ndarray) -> DeviceArray:
    """Copy a host numpy array to a new flat device array of the same dtype.

    :param ctx: the context from :func:`optirs_open`.
    :param array: a numpy array.
    :return: the new device array.
    """


@hookspec
def optirs_to_host(ctx: BackendContext, array: DeviceArray) -> np.ndarray:
    """Copy a device array (as made by this backend) to a new flat numpy array.

    :param ctx: the context from :func:`optirs_open`.
    :param array: a device array made by this backend.
    :return: a new numpy array.
    """


@hookspec
def optirs_stage(ctx: BackendContext, params: List[Any], grads: List[Any], fmt: Optional[StepFormat]) -> Staged:
    """Make one step's parameters and gradients usable by :func:`optirs_step`.

    Host numpy arrays are uploaded (and written back by ``Staged.finish``); the backend's own
    device arrays are used in place, without copies. Shapes, dtypes and contiguity were checked
    by the caller. With a step format, 16-bit arrays (numpy ``ml_dtypes.bfloat16`` / ``float16``,
    their uint16 bit views, or the backend's own 16-bit device arrays) are staged as the
    backend's flat uint16 bit arrays; an implementation that takes no ``fmt`` argument stages
    float32 steps only.

    :param ctx: the context from :func:`optirs_open`.
    :param params: the caller's parameter arrays (numpy or the backend's device kind).
    :param grads: the caller's gradient arrays, same kinds and shapes.
    :param fmt: the step's :class:`optirs.core.formats.StepFormat`, or None for float32 parameters,
        gradients and state.
    :return: the staged arrays.
    :raises optirs.InvalidParameterError: for an array kind or dtype this backend cannot use.
    """


@hookspec
def optirs_host_view(ctx: BackendContext, array: np.ndarray) -> Optional[DeviceArray]:
    """This backend's flat device array over the memory of a C-contiguous host numpy array, without a copy.

    Backends whose device memory is the host's (the cpu backend) return a view, so features that
    move whole arrays (fused groups) read inputs and write outputs in place; others need not
    implement it (callers then copy with :func:`optirs_to_device` / :func:`optirs_to_host`).

    :param ctx: the context from :func:`optirs_open`.
    :param array: a C-contiguous numpy array.
    :return: the device array sharing ``array``'s memory, or None to make the caller copy.
    """


@hookspec
def optirs_synchronize(ctx: BackendContext) -> None:
    """Wait until all work queued on the context's device has finished.

    :param ctx: the context from :func:`optirs_open`.
    """


# ---------------------------------------------------------------- the step
# A backend answers one step hook, optirs_step, with a StepRequest: the definition, the staged
# arrays, the state, the layout, the scalars, the step format and the per-step controls. It picks
# its kernel in one place (float32 elementwise, LAMB's passes, Adafactor's reductions, a step
# format, device-side scalars), as torch's adam() picks among its implementations, and says what
# it runs through optirs_step_support.


@dataclass(frozen=True)
class DeviceStepInputs:
    """What a step with device-side scalars reads on the device (every array a float32 device array):
    the step count and the learning rate live on the device, the backend advances the count and
    computes the scalars record in a kernel of its own before the step, so a step captured into a
    CUDA graph replays correctly (optirs.torch's ``capturable=True``). The formulas are
    :data:`optirs.core.scalars.FORMULAS`, computed in float64 and rounded to float32 as the host does.

    :param steps: every tensor's step count (torch's ``state[p]["step"]``), advanced by one per step.
    :param record: where the step's scalars record goes (one float32 per field, bools as 0 / 1).
    :param constants: ``FORMULAS[name].constants(hp)``: the hyperparameters a graph bakes in.
    :param lr: the learning rate, a float (baked in, as torch's float lr) or a one-element device array
        read at every step.
    :param sign: -1.0 with maximize, else 1.0.
    :param grad_scale: None, or a one-element device array: the gradient factor is ``sign / grad_scale``.
    :param found_inf: None, or a one-element device array: when non-zero, the step changes nothing
        (not the count either).
    """

    steps: DeviceArray
    record: DeviceArray
    constants: Tuple[float, ...]
    lr: Any
    sign: float = 1.0
    grad_scale: Optional[DeviceArray] = None
    found_inf: Optional[DeviceArray] = None


class StepControls(NamedTuple):
    """The per-step controls of a :class:`StepRequest`.

    :param step: the 1-based step being taken (stochastic rounding's counter, the formats' first-step reads).
    :param seed: stochastic rounding's seed, in [0, 2**32).
    :param found_inf: None, or a 1-element int32 array of this backend: when it is non-zero (read
        on the device, without a host round trip) the step writes nothing.
    :param check_finite: set ``found_inf[0] = 1`` first when any gradient is inf or NaN (``found_inf``
        is then given), so a loss scaler skips the whole step on the device.
    :param device: None, or the :class:`DeviceStepInputs` of a step whose count, lr and scalars live
        on the device (``scalars`` is then a record of the family's type, its values unused).
    """

    step: int = 1
    seed: int = 0
    found_inf: Optional[DeviceArray] = None
    check_finite: bool = False
    device: Optional[DeviceStepInputs] = None


class StepRequest(NamedTuple):
    """One optimizer step over every tensor of a model, as :func:`optirs_step` receives it.

    :param definition: the optimizer's :class:`~optirs.core.definitions.OptimizerDefinition`
        (``definition.kernel`` is its kernel family, ``definition.slot_names()`` its slots in kernel order).
    :param params: the parameters as staged by :func:`optirs_stage` (flat device arrays), updated in place.
    :param grads: the gradients, staged like ``params``; never written.
    :param state: buffer name -> flat device array, updated in place. Without a format: one buffer
        per slot the hyperparameters need, laid out by ``definition.state_layout``. With a format:
        ``format_state.buffer_sizes()`` / ``buffer_dtypes()`` (slot buffers and the master buffer).
        The engine hands the same dict for as long as its buffers stay the same, and a new dict when
        any buffer is replaced, so a backend may cache what it derives from it by its identity.
    :param layout: the model's :class:`~optirs.core.layout.TensorLayout` (offsets, chunk table, and
        ``cache``, where a backend keeps prepared data: tables, compiled kernels, launches).
    :param scalars: the per-step scalars (:mod:`optirs.core.scalars`), already float32. Its last
        field, ``grad_factor``, multiplies every gradient element before anything else reads it
        (-1 for maximize, ``1 / scale`` for a loss scaler's unscale).
    :param controls: the :class:`StepControls`.
    :param fmt: None for float32 parameters, gradients and state; else the step's
        :class:`~optirs.core.formats.StepFormat` (docs/formats.md is the bit-exact contract).
    :param format_state: with ``fmt``, where each tensor's compact buffers live
        (:class:`~optirs.core.formats.FormatState`).
    """

    definition: OptimizerDefinition
    params: List[DeviceArray]
    grads: List[DeviceArray]
    state: SlotBuffers
    layout: TensorLayout
    scalars: StepScalars
    controls: StepControls
    fmt: Optional[StepFormat] = None
    format_state: Optional[FormatState] = None


class StepSupport(NamedTuple):
    """What a backend's :func:`optirs_step` runs, by optimizer definition name.

    :param optimizers: definitions stepped with float32 parameters, gradients and state.
    :param formats: definitions stepped in every step format (16-bit parameters, compact masters,
        compact state), with ``controls.check_finite``.
    :param capturable: definitions whose scalars the device computes (``controls.device``).
    :param state_dtypes: the state dtypes its formats store (``Precision.state_dtype`` values; a
        backend written before ``"int8_sqrt"`` runs the first three).
    """

    optimizers: Tuple[str, ...] = ()
    formats: Tuple[str, ...] = ()
    capturable: Tuple[str, ...] = ()
    state_dtypes: Tuple[str, ...] = ("float32", "bfloat16", "int8")


@hookspec
def optirs_step_support() -> StepSupport:
    """Say which optimizers, formats and controls this backend's :func:`optirs_step` runs.

    Called once per backend (``optirs info``'s capability matrix, and every feature's choice);
    it takes no context, so the answer cannot depend on the device.

    :return: a :class:`StepSupport`.
    """


@hookspec
def optirs_step(ctx: BackendContext, request: StepRequest) -> None:
    """One optimizer step of every tensor of a model, in place: parameters and state updated.

    The backend picks its kernel from the request: the definition's family, the format, the
    controls. Per element it reads the gradient times ``scalars.grad_factor``, runs the family's
    float32 element step (docs/architecture.md; :mod:`optirs.core.reference` is the float64
    specification every backend is tested against) and writes the parameter and the state; with
    a format, it decodes and encodes as docs/formats.md says. ``controls.found_inf`` (non-zero)
    means nothing is written; ``controls.check_finite`` sets it first from the gradients.

    :param ctx: the context from :func:`optirs_open`.
    :param request: the :class:`StepRequest`.
    :raises optirs.UnsupportedOperationError: for an optimizer, format or control this backend does
        not run (see :func:`optirs_step_support`), before anything is written.
    """


# ---- the per-optimizer step hooks of earlier releases
# ``optirs_step_<name>(ctx, params, grads, state, layout, scalars)``: a backend that implements
# these and not optirs_step still steps float32 (the registry adapts the request, reading a
# found_inf flag on the host) with a PluginDeprecationWarning. They go in the next release.

_STEP_DOC = """{summary} (deprecated: implement :func:`optirs_step`)

The update, per element (``t`` the 1-based step):

.. code-block:: text
{algorithm}

:param ctx: the context from :func:`optirs_open`.
:param params: the model's parameters as staged by :func:`optirs_stage` (flat device arrays), updated in place.
:param grads: the gradients, staged like ``params``.
:param state: slot name -> flat device array holding every tensor's state ({slots}), updated in place;
    only the slots the hyperparameters need are present.
:param layout: the model's :class:`~optirs.core.layout.TensorLayout` (offsets, chunk table, ``cache``).
:param scalars: the per-step scalars (:class:`optirs.core.scalars.{scalars}`), already float32. Its last
    field, ``grad_factor``, multiplies every gradient element before anything else reads it.
"""


def _step_spec(definition: OptimizerDefinition) -> Callable:
    def spec(ctx: BackendContext, params: List[DeviceArray], grads: List[DeviceArray], state: SlotBuffers,
             layout: TensorLayout, scalars: StepScalars) -> None:
        pass

    spec.__name__ = spec.__qualname__ = definition.hook
    spec.__doc__ = _STEP_DOC.format(summary=definition.summary, algorithm=definition.algorithm,
                                    slots=", ".join(definition.slot_names()),
                                    scalars=definition.scalars_type.__name__)
    return hookspec(spec)


for _definition in DEFINITIONS.values():
    globals()[_definition.hook] = _step_spec(_definition)

LEGACY_STEP_HOOKS: Dict[str, str] = {d.name: d.hook for d in DEFINITIONS.values()}
OPTIMIZER_NAMES: Tuple[str, ...] = tuple(DEFINITIONS)


# ---------------------------------------------------------------- analysis


@hookspec(firstresult=True)
def optirs_launch_config(kernel: Any, device: Any, elements: int) -> Optional[Tuple[int, int]]:
    """Choose (grid, block) for a compiled CUDA kernel on a device. Stops at the first non-None result.

    :param kernel: the compiled numba CUDA kernel (its register and shared-memory use are read from it).
    :param device: the device whose limits apply (a numba CUDA device, or a compute capability tuple).
    :param elements: how many work items the launch must cover.
    :return: ``(grid, block)``, or None to defer to another plugin.
    """


# ---------------------------------------------------------------- capabilities beyond the dense step
# Each feature above the interface asks the bound backend for a capability: the hooks listed in
# CAPABILITIES. A backend that lacks one raises UnsupportedOperationError naming the backend and the
# capability. Sections below are grouped by capability; each starts with its banner.

# ---- mixed precision
# optirs.optim.mixed_precision.MixedPrecisionOptimizer steps float16/bfloat16 parameters over
# float32 master weights that live on the backend. Per step it describes the caller's half arrays,
# runs one unscale pass (half gradients -> float32 buffer, flagging inf/NaN) and, when the step is
# applied, one narrow pass (float32 masters -> rounded half parameters). Both passes cover every
# tensor of ``layout``; float16 rounds as numpy's cast, bfloat16 as ml_dtypes' (nearest even).


@hookspec
def optirs_mixed_precision_describe(ctx: BackendContext, array: Any, what: str, half_dtype: np.dtype) -> ArrayMeta:
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
def optirs_mixed_precision_unscale(ctx: BackendContext, grads: List[DeviceArray], out: DeviceArray, layout: TensorLayout,
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
def optirs_mixed_precision_narrow(ctx: BackendContext, masters: DeviceArray, params: List[DeviceArray], layout: TensorLayout,
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

# ---- sparse rows
# Row-sparse steps of embedding tables (optirs.optim.sparse: SparseAdam, SparseSgd). The optimizer
# checks the gradient on the host and sorts it into segments (SparseRows); state slots are flat
# arrays of this backend made with optirs_alloc and read back with optirs_to_host. A step is one
# launch per table on a GPU (dense decay: plus two O(touched rows) launches for row_position).


class SparseRows(NamedTuple):
    """A row-sparse gradient sorted into segments, as the sparse step hooks take it.

    Segment ``k`` is the gradient of table row ``rows[k]``: the sum, in this order, of the value
    rows ``values[order[q]]`` for ``segments[k] <= q < segments[k + 1]`` (duplicates summed in the
    order the caller gave them). The index arrays are host numpy int64 arrays (small: touched
    rows and nnz); the backend copies them to its device as it needs.
    """

    rows: np.ndarray  # int64 (n,): the touched table rows, sorted, unique, in [0, num_rows)
    segments: np.ndarray  # int64 (n + 1,): segment offsets into order, segments[n] == nnz
    order: np.ndarray  # int64 (nnz,): indices into the rows of values
    values: DeviceArray  # float32 (nnz, dim): the gradient rows as staged by optirs_sparse_stage


class SparseTable(NamedTuple):
    """One embedding table and its optimizer state, as the sparse step hooks update them in place."""

    param: DeviceArray  # the float32 (num_rows, dim) table as staged by optirs_sparse_stage
    num_rows: int
    dim: int
    state: Dict[str, Any]  # slot name -> flat array of this backend (optirs_alloc), row-major


@hookspec
def optirs_sparse_stage(ctx: BackendContext, tables: List[Any], values: List[Any]) -> Staged:
    """Make one sparse step's tables and gradient values usable by the sparse step hooks.

    numpy arrays are uploaded (tables are written back by ``Staged.finish``); this backend's own
    device arrays are used in place, without copies. Called for every table of the step before
    any table steps, so a rejected array leaves every table and state as it was.

    :param ctx: the context from :func:`optirs_open`.
    :param tables: float32 ``(num_rows, dim)`` C-contiguous writeable tables, numpy or this
        backend's device arrays (shapes, dtypes and contiguity were checked by the caller).
    :param values: the float32 ``(nnz, dim)`` gradient rows of each table, numpy or this backend's
        device arrays.
    :return: a :class:`Staged` whose ``params`` are the staged tables and ``grads`` the staged values.
    :raises optirs.InvalidParameterError: for an array kind this backend cannot use, naming it.
    """


@hookspec
def optirs_sparse_adam_step(ctx: BackendContext, table: SparseTable, grad: SparseRows, scalars: AdamScalars,
                            dense_decay: bool) -> None:
    """Step one table with Adam on a row-sparse gradient (``m``, ``v`` and the table updated in place).

    Lazy (``dense_decay`` False): only the rows in ``grad`` change, as ``torch.optim.SparseAdam``.
    Dense decay: every row steps, absent rows with a zero gradient, as dense ``torch.optim.Adam``.

    :param ctx: the context from :func:`optirs_open`.
    :param table: the table; ``state`` holds ``exp_avg`` and ``exp_avg_sq`` (float32,
        ``num_rows * dim``) and, with dense decay, ``row_position`` (int64, ``num_rows``, every
        element -1 on entry and again on return: the row -> segment map of the step).
    :param grad: the table's gradient, sorted into segments.
    :param scalars: the step's Adam record (the optimizer folds its bias corrections in).
    :param dense_decay: False: touch only the rows present; True: step every row.
    """


@hookspec
def optirs_sparse_sgd_step(ctx: BackendContext, table: SparseTable, grad: SparseRows, scalars: SgdScalars,
                           first_scalars: SgdScalars, dense_decay: bool) -> None:
    """Step one table with SGD (momentum, dampening, nesterov, L2 decay) on a row-sparse gradient.

    Lazy (``dense_decay`` False): only the rows in ``grad`` change; a row whose ``row_seen`` flag is
    0 steps with ``first_scalars`` (its momentum buffer starts at its gradient) and is then marked 1.
    Dense decay: every row steps with ``scalars``, absent rows with a zero gradient.

    :param ctx: the context from :func:`optirs_open`.
    :param table: the table; ``state`` holds ``momentum_buffer`` (float32, ``num_rows * dim``) when
        ``scalars.has_momentum``, ``row_seen`` (uint8, ``num_rows``) when lazy with momentum, and
        ``row_position`` (int64, ``num_rows``, -1 on entry and on return) with dense decay.
    :param grad: the table's gradient, sorted into segments.
    :param scalars: the step's SGD record (lazy: ``first_step`` False, rows decide it).
    :param first_scalars: lazy with momentum: the record of a row's first step (``first_step``
        True); otherwise unused.
    :param dense_decay: False: touch only the rows present; True: step every row.
    """

# ---- fingerprints
# A fingerprint says whether an array still holds what it held when the fingerprint was taken,
# without a copy: CPUOffload takes one of each gradient as its copy to the host starts and again
# in step(), and copies again (or refuses) what differs. One pass over each array's memory.

FINGERPRINT_INDEX_MASK = 0x7FFFFFFF
"""The low bits of an element's index that its fingerprint key holds (the index modulo 2**31)."""


@hookspec
def optirs_fingerprint(ctx: BackendContext, arrays: Sequence[DeviceArray], out: DeviceArray,
                       rows: Sequence[int]) -> None:
    """Queue each array's fingerprint into a row of ``out`` (on the stream in use).

    The elements of ``arrays[k]`` are read as their bit words ``u`` (16 or 32 bits: float16,
    bfloat16 as int16 / uint16, float32, int32, ...; any shape, C-contiguous, read flat) and
    ``out[rows[k]]`` becomes, in int64 (wrapping):

    - ``out[r, 0]``: the sum of the words as signed integers of their width (any change of one
      element, a scaling, a clamp, an all-reduce moves it);
    - ``out[r, 1]``: the largest key ``(o << 31) | (FINGERPRINT_INDEX_MASK - (i & FINGERPRINT_INDEX_MASK))``
      over the elements ``i``, where ``o`` is the word in floating-point order as 32 bits (``u``
      with the sign bit set if it was clear, else ``~u``; a 16-bit word shifted up by 16): the
      largest value and its first index, which a sign flip moves where the sum can stay. 0 for an
      empty array.

    The rows are overwritten (their previous values do not count); other rows are left alone.

    :param ctx: the context from :func:`optirs_open`.
    :param arrays: the arrays, this backend's own device arrays (numba / CuPy / torch CUDA arrays
        on cuda; numpy arrays on the cpu backend).
    :param out: int64[n, 2], C-contiguous, the same kind of array.
    :param rows: the row of ``out`` of each array.
    :raises optirs.InvalidParameterError: for an array this backend cannot read, an element width
        other than 2 or 4 bytes, a non-contiguous array, or a row outside ``out`` or named twice, before
        anything is queued.
    """


# ---- replica reduction
# One device sums (or averages) N gradient replicas into the first: the single-device half of data
# parallelism (optirs.optim.data_parallel.reduce_replicas). Moving data between devices is a
# collective's job (torch.distributed), never this hook's.


@hookspec
def optirs_replica_reduce(ctx: BackendContext, replicas: Sequence[DeviceArray], average: bool) -> None:
    """Reduce N gradient replicas on the backend's device into the first, in place.

    ``replicas[0][i] = replicas[0][i] + replicas[1][i] + ... + replicas[N-1][i]``, added left to
    right in float32, then divided by ``float32(N)`` with IEEE division when ``average`` (so every
    backend returns numpy's float32 left fold bit for bit). The other replicas are only read.
    The caller has checked that there are at least two replicas (or one with ``average``), all
    float32, C-contiguous, of one shape and array kind, distinct in memory, ``replicas[0]``
    writeable and not empty. Host numpy replicas may be accepted by a device backend (uploaded,
    reduced and written back), as :func:`optirs_stage` does.

    :param ctx: the context from :func:`optirs_open`.
    :param replicas: the replicas, each the backend's own device array (a numba / CuPy / torch CUDA
        array, a ``pyopencl.array.Array``, ...) or a host numpy array; any shape, read as flat.
    :param average: divide the sum by ``len(replicas)`` (``op="mean"``) rather than keep it (``"sum"``).
    :raises optirs.UnsupportedOperationError: when the replicas live on different physical
        devices (or another device than the context's), before anything is written.
    :raises optirs.InvalidParameterError: for an array kind this backend cannot reduce, before
        anything is written.
    """


# ---- fake quantization


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
def optirs_fake_quant_forward(ctx: BackendContext, x: DeviceArray, grid: FakeQuantGrid,
                              rounding: Optional[StochasticKeys]) -> Tuple[DeviceArray, DeviceArray]:
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
def optirs_fake_quant_backward(ctx: BackendContext, x: DeviceArray, grad: DeviceArray,
                               grid: FakeQuantGrid) -> DeviceArray:
    """The straight-through gradient: ``grad`` where ``x`` quantizes inside the range (bits unchanged), ``grad * 0`` elsewhere.

    :param ctx: the context from :func:`optirs_open`.
    :param x: the forward input, as for :func:`optirs_fake_quant_forward`.
    :param grad: float32 gradient of ``grid.shape``, the same kind of array as ``x``.
    :param grid: the grid the forward pass used.
    :return: a new float32 array of ``grid.shape``, of the same kind as ``x``.
    :raises optirs.UnsupportedOperationError: for arrays this backend cannot read.
    :raises optirs.ShapeMismatchError: for a device array that is not C-contiguous.
    """

# ---- fused elementwise groups
# A fusion plan (optirs.analysis.fusion) becomes one kernel per group. The ``fusion`` analysis
# plugin generates each group's source in every dialect (optirs_fusion_generate); a backend with
# the ``fusion`` capability compiles the dialect it runs (optirs_fusion_compile) and runs it on its
# own flat device arrays (optirs_fusion_run). Kernel text names no sizes, so a backend may cache
# compiled kernels by text and share them between groups and plans.

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
def optirs_fusion_generate(graph: Any, group: Any) -> Optional[FusedGroupSource]:
    """Generate the kernels of one fused group in every dialect a plugin knows. Stops at the first non-None result.

    :param graph: the :class:`optirs.analysis.fusion.FusionGraph` the group belongs to (a type of the
        analysis layer above this interface, so not imported here).
    :param group: the :class:`optirs.analysis.fusion.FusionGroup` (not opaque) to generate.
    :return: the group's :class:`FusedGroupSource`, or None to defer to another plugin.
    """


@hookspec
def optirs_fusion_compile(ctx: BackendContext, source: FusedGroupSource) -> CompiledFusedKernel:
    """Compile one fused group's kernel in this backend's dialect; the handle goes to :func:`optirs_fusion_run`.

    :param ctx: the context from :func:`optirs_open`.
    :param source: the group's generated source, dtypes and sizes.
    :return: the compiled kernel, holding ``source``.
    :raises optirs.UnsupportedOperationError: when the device cannot run it (e.g. no float64), or
        ``source`` lacks this backend's dialect.
    """


@hookspec
def optirs_fusion_run(ctx: BackendContext, compiled: CompiledFusedKernel, inputs: Sequence[DeviceArray],
                      outputs: Sequence[DeviceArray], n: int) -> None:
    """Run one compiled fused group: read ``inputs``, write ``outputs`` (queued; synchronize to wait).

    :param ctx: the context from :func:`optirs_open`.
    :param compiled: what :func:`optirs_fusion_compile` returned on this context.
    :param inputs: flat device arrays of this backend (as :func:`optirs_to_device` makes), one per
        ``source.input_dtypes``, in order.
    :param outputs: flat device arrays of this backend (as :func:`optirs_alloc` makes), one per
        ``source.output_dtypes`` and of ``source.output_sizes``, written in place.
    :param n: elements of the group's domain (``source.elements``).
    """


# ---- measurement (optirs bench)
# How a backend's device is timed and what its copy bandwidth is: the yardstick of every figure.
# A backend without these hooks is timed on the host (synchronize, perf_counter) against a numpy copy.


@hookspec
def optirs_measure_copy(ctx: BackendContext, size: int) -> Tuple[str, Callable[[], None]]:
    """A device-to-device copy of ``size`` float32 elements, the copy-bandwidth yardstick.

    :param ctx: the context from :func:`optirs_open`.
    :param size: elements to copy (the buffers are allocated here, once).
    :return: ``(label, copy)``: what the copy is (``"device-to-device copy"``) and a function
        that enqueues one copy.
    """


@hookspec
def optirs_measure_elapsed_ms(ctx: BackendContext, fn: Callable[[], None], reps: int) -> float:
    """Device time per call of ``fn`` over ``reps`` back-to-back calls (device events where it has them).

    :param ctx: the context from :func:`optirs_open`.
    :param fn: enqueues the work to time.
    :param reps: calls to time together.
    :return: milliseconds per call.
    """


@hookspec
def optirs_torch_device(ctx: BackendContext) -> Optional[str]:
    """The torch device whose tensors this backend steps in place (``"cuda"``, ``"cpu"``), for
    peers measured beside it.

    :param ctx: the context from :func:`optirs_open`.
    :return: a torch device string, or None when torch tensors cannot live where this backend works.
    """


@hookspec
def optirs_torch_devices() -> Tuple[str, ...]:
    """The torch device types whose tensors this backend could step in place (``("cuda",)``,
    ``("cpu",)``; ``()``: none), said without opening it.

    ``optirs.torch``'s ``backend="auto"`` opens only the backends that list a model's device type
    (or that do not implement this hook), so a CPU model does not wait for a GPU runtime to load.
    The opened backend's :func:`optirs_torch_device` stays the answer.
    """


# ---- streams
# Which device queue a backend's launches and copies go on, so that they are ordered with the
# caller's own work (torch's current CUDA stream). The rule of a backend that has streams: a
# stream pinned with optirs_use_stream (or the open option ``stream``) takes every launch;
# otherwise a call on torch CUDA tensors goes on torch's current stream of their device at the
# time of the call, and anything else on the legacy default stream (0). A step while the stream
# is being captured into a CUDA graph raises UnsupportedOperationError: its per-step scalars are
# host values and would replay stale. Host backends (cpu) run every call to completion in order:
# their only stream is 0.


@hookspec
def optirs_use_stream(ctx: BackendContext, stream: Optional[Any]) -> None:
    """Put every later launch and copy of ``ctx`` on ``stream``, or return to the rule.

    The context is shared by every optimizer opened with the same options; to pin one optimizer
    only, open it with ``GpuOptimizerConfig(options={"stream": handle})``.

    :param ctx: the context from :func:`optirs_open`.
    :param stream: a raw stream handle (``int``, e.g. ``torch.cuda.current_stream().cuda_stream``;
        0 is the legacy default stream), a stream object of torch, numba or CuPy, or None / ``"auto"``
        for the rule (torch's current stream for torch tensors, else 0).
    :raises optirs.InvalidParameterError: for anything else.
    :raises optirs.UnsupportedOperationError: for a stream other than 0 on a backend without streams.
    """


@hookspec
def optirs_current_stream(ctx: BackendContext) -> int:
    """The raw handle of the stream the context's launches go on now (the last call's, or the pinned one).

    :param ctx: the context from :func:`optirs_open`.
    :return: the stream handle; 0 for the legacy default stream (and on backends without streams).
    """



# Capability name -> the hooks a backend implements to offer it (all of them).
CAPABILITIES: Dict[str, Tuple[str, ...]] = {
    "replica_reduce": ("optirs_replica_reduce",),
    "fingerprint": ("optirs_fingerprint",),
    "fake_quant": ("optirs_fake_quant_forward", "optirs_fake_quant_backward"),
    "mixed_precision": ("optirs_mixed_precision_describe", "optirs_mixed_precision_unscale",
                        "optirs_mixed_precision_narrow"),
    "sparse": ("optirs_sparse_stage", "optirs_sparse_adam_step", "optirs_sparse_sgd_step"),
    "fusion": ("optirs_fusion_compile", "optirs_fusion_run"),
    "measure": ("optirs_measure_copy", "optirs_measure_elapsed_ms", "optirs_torch_device"),
    "streams": ("optirs_use_stream", "optirs_current_stream"),
}
# Capabilities of the step itself, read from optirs_step_support (StepSupport's fields).
STEP_CAPABILITIES: Tuple[str, ...] = ("formats", "capturable")

