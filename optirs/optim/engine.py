"""The step engine: one optimizer's state over one model on one backend, and the step transaction.

Every front door steps through a :class:`StepEngine`: the seed API (:mod:`optirs.optim.optimizers`),
``optirs.torch`` (one engine per bucket of a param group), ``CPUOffload`` (the engines of its
inner optimizers), ``MixedPrecisionOptimizer``, data parallelism and ``optirs bench``. An engine
owns the backend, the layout, the state (float32, or a step format's compact buffers), the step
count and the engine's lock; the front door owns its arrays' checks and its hyperparameters.

A step is two phases. :meth:`StepEngine.prepare` checks everything that can fail (the backend
runs this optimizer, format and controls; the layout and the held state's format match; the
per-step scalars exist) and allocates a first step's state, changing nothing the engine holds.
:func:`run_steps` then runs any number of prepared steps as one transaction: under the engines'
and the backends' locks, with SIGINT deferred (:mod:`optirs.core.interrupts`), each is staged,
stepped through the backend's one step hook (``optirs_step``) and finished, and only then is each
counted. A KeyboardInterrupt lands before or after all of them; a non-optirs exception from a
hook becomes a :class:`~optirs.core.errors.PluginError` naming the plugin and the hook, and a
step whose hook raised is not counted (the steps before it in the transaction are).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from optirs.core import checkpoint as ck
from optirs.core.definitions import OptimizerDefinition
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.formats import FormatState, StepFormat
from optirs.core.interrupts import deferred_interrupts
from optirs.core.layout import TensorLayout
from optirs.optim import formats as fm
from optirs.plugin.hookspecs import DeviceStepInputs, StepControls, StepRequest

STATE_DTYPE = np.dtype(np.float32)

# (sizes, dtypes, fills) of the buffers -> buffer name -> the backend's array (optirs_alloc by default)
Allocator = Callable[[Dict[str, int], Dict[str, np.dtype], Dict[str, float]], Dict[str, Any]]


def storage(fmt: Optional[StepFormat]) -> Optional[StepFormat]:
    """What a state in ``fmt`` keeps (the gradients' dtype may change step to step); None for float32."""
    if fmt is None or fmt.plain:
        return None
    return fmt if fmt.grad_dtype == "float32" else replace(fmt, grad_dtype="float32")


class PreparedStep:
    """One engine's step, checked and ready: :func:`run_steps` launches and counts it.

    ``skip``: a host found_inf flag was set, so nothing is launched or counted. ``applied`` says
    after the launch whether the step took effect (a device found_inf flag may have skipped it).
    """

    __slots__ = ("engine", "params", "grads", "fmt", "layout", "slots", "state", "fresh", "scalars", "controls",
                 "format_state", "skip", "applied")

    def __init__(self, engine: "StepEngine", params: List[Any], grads: List[Any], fmt: Optional[StepFormat],
                 layout: TensorLayout, slots: Dict[str, float], state: Optional[Dict[str, Any]], fresh: bool,
                 scalars: Any, controls: StepControls, format_state: Optional[FormatState], skip: bool):
        self.engine, self.params, self.grads, self.fmt, self.layout = engine, params, grads, fmt, layout
        self.slots, self.state, self.fresh, self.scalars, self.controls = slots, state, fresh, scalars, controls
        self.format_state, self.skip, self.applied = format_state, skip, False

    def launch(self) -> None:
        """Stage, step and finish (the caller holds the transaction: :func:`run_steps`)."""
        engine = self.engine
        backend = engine.backend
        ctx = backend.ctx
        hook = "optirs_to_device"
        try:
            state = self.state
            if not self.fresh and not engine.state_on_device:
                state = self.state = engine._device_state()
            controls = self.controls
            if controls.device is None:
                hook = "optirs_stage"
                staged = backend.stage(ctx, self.params, self.grads, self.fmt)
                params, grads, finish = staged.params, staged.grads, staged.finish
            else:  # the caller's device arrays as they are: nothing may be copied during a capture
                params, grads, finish = self.params, self.grads, None
            hook = ""  # the step hook (named only if it raises)
            backend.step(ctx, StepRequest(engine.definition, params, grads, state, self.layout, self.scalars,
                                          controls, self.fmt, self.format_state))
            if finish is not None:
                hook = "optirs_stage's finish"
                finish()
            applied = True
            if controls.found_inf is not None and controls.device is None:
                hook = "optirs_to_host"
                applied = not _flag_set(backend.to_host(ctx, controls.found_inf))
        except Exception as exc:
            error = backend.plugin_error(exc, hook or backend.step_hook(engine.definition.name))
            if error is exc:
                raise
            raise error from exc
        self.applied = applied

    def commit(self) -> None:
        """Install the step's state and count it (a skipped first step leaves the engine fresh)."""
        engine = self.engine
        if not self.applied and self.fresh:
            return
        engine.layout, engine.slots, engine.fmt = self.layout, self.slots, self.fmt
        engine.state, engine.state_on_device = self.state, True
        engine._format_state = self.format_state
        if self.controls.device is not None:
            engine.counts_on_device = True
        elif self.applied:
            engine.step_count += 1


def _flag_set(host: Any) -> bool:
    return bool(np.asarray(host).reshape(-1)[0] != 0)


def run_steps(steps: Sequence[PreparedStep]) -> None:
    """Launch prepared steps as one transaction (module docstring), then count each.

    A step whose launch raised is not counted and its error is raised after the steps before it
    were counted; the steps after it are not launched.
    """
    if len(steps) == 1:
        engine = steps[0].engine
        locks = [engine.lock, engine.backend.lock]
    else:
        engines = {id(s.engine): s.engine for s in steps}
        backends = {id(e.backend): e.backend for e in engines.values()}
        # one order for every thread: no two transactions wait on each other
        locks = [engines[k].lock for k in sorted(engines)] + [backends[k].lock for k in sorted(backends)]
    with deferred_interrupts():
        held = 0
        try:
            for lock in locks:
                lock.acquire()
                held += 1
            done: List[PreparedStep] = []
            try:
                for s in steps:
                    if not s.skip:
                        s.launch()
                        done.append(s)
            finally:
                for s in done:
                    s.commit()
        finally:
            for lock in reversed(locks[:held]):
                lock.release()


class StepEngine:
    """One optimizer's step over one model on one backend (module docstring).

    :param definition: the optimizer's definition.
    :param backend: the opened backend (:class:`optirs.plugin.registry.Backend`).
    :param allocate: makes a first step's state buffers (default: ``optirs_alloc``); front ends that
        keep the state in their own tensors (optirs.torch) allocate those and return the backend's
        arrays over them.

    What it holds: ``layout`` (the model's :class:`~optirs.core.layout.TensorLayout`), ``slots``
    (slot name -> initial value), ``fmt`` (the state's :class:`~optirs.core.formats.StepFormat`
    storage, None for float32), ``state`` (buffer name -> the backend's flat array, or numpy on the
    host after :meth:`to_host`), ``step_count``. ``fmt`` is the last step's format (its gradients'
    dtype included); what the state keeps is ``storage(fmt)``.
    """

    def __init__(self, definition: OptimizerDefinition, backend: Any, allocate: Optional[Allocator] = None):
        self.definition = definition
        self.backend = backend
        self._allocate = allocate
        self.lock = threading.RLock()
        self.layout: Optional[TensorLayout] = None
        self.slots: Optional[Dict[str, float]] = None
        self.fmt: Optional[StepFormat] = None
        self.state: Optional[Dict[str, Any]] = None
        self.state_on_device = False
        self.step_count = 0
        self.counts_on_device = False  # device-side scalars advance a count the caller holds
        self._format_state: Optional[FormatState] = None

    def __repr__(self) -> str:
        held = "no state" if self.state is None else f"{len(self.layout)} tensors, {fm.describe(self.fmt)}"
        return f"<StepEngine {self.definition.name} on {self.backend.name}: {held}, step {self.step_count}>"

    # ------------------------------------------------------------ a step

    def prepare(self, params: List[Any], grads: List[Any], *, shapes: Sequence[Tuple[int, ...]], hp: Any = None,
                slots: Optional[Dict[str, float]] = None, fmt: Optional[StepFormat] = None, scalars: Any = None,
                grad_factor: float = 1.0, found_inf: Any = None, check_finite: bool = False,
                device: Optional[DeviceStepInputs] = None, seed: int = 0,
                layout: Optional[TensorLayout] = None) -> PreparedStep:
        """Check one step and make it ready for :func:`run_steps`; nothing the engine holds changes.

        :param params: the parameters, as the caller's arrays (numpy or the backend's kind), checked
            by the front door (shapes, dtypes, memory).
        :param grads: their gradients.
        :param shapes: the tensors' shapes (the layout of a first step; later steps must match).
        :param hp: the hyperparameters (the state slots and, unless ``scalars`` is given, the scalars).
        :param slots: slot name -> initial value (``definition.state_slots(hp)`` when not given).
        :param fmt: the step's format; None or a plain one for float32.
        :param scalars: the per-step scalars record (default: ``definition.scalars(hp, step, grad_factor)``).
        :param grad_factor: what every gradient is multiplied by first (maximize's sign, a loss scale's inverse).
        :param found_inf: None; a host bool or numpy array (non-zero: the step is skipped, nothing
            launched); or the backend's 1-element int32 array, read on the device.
        :param check_finite: the backend sets ``found_inf`` first from the gradients (allocated here
            when not given); the step counts only if none is inf or NaN.
        :param device: device-side scalars (the count, lr and record live on the device).
        :param seed: stochastic rounding's seed.
        :param layout: the layout to use for a first step (a front end that keeps one per bucket).
        """
        definition, backend = self.definition, self.backend
        fmt = None if fmt is None or fmt.plain else fmt
        name = definition.name
        if not backend.steps(name, fmt, device is not None):
            support = backend.support
            if fmt is not None and name in support.formats:
                raise UnsupportedOperationError(
                    f"backend {backend.name!r} stores no state_dtype={fmt.state_dtype!r} (needed for {fm.describe(fmt)}); "
                    f"expected one of {list(support.state_dtypes)} on this backend")
            if fmt is not None:
                raise UnsupportedOperationError(
                    f"backend {backend.name!r} runs no step formats for {name!r} (the 'formats' capability), needed "
                    f"for {fm.describe(fmt)}; expected a backend that runs them (this one runs formats of "
                    f"{list(support.formats)}) or float32 parameters with state_dtype='float32'")
            if device is not None:
                raise UnsupportedOperationError(
                    f"backend {backend.name!r} has no device-side scalars for {name!r} (the 'capturable' capability); "
                    f"it has them for {list(support.capturable)}")
            raise UnsupportedOperationError(
                f"backend {backend.name!r} does not run the {name!r} step; it runs {list(support.optimizers)}")
        if slots is None:
            slots = definition.state_slots(hp)
        held = self.layout
        if held is not None:
            if shapes is not held.shapes and not held.matches(shapes):
                raise ShapeMismatchError(
                    f"the parameter list changed: got {len(shapes)} tensors with shapes {list(shapes)}, expected "
                    f"{len(held)} tensors with shapes {held.shapes} as in earlier steps")
            layout = held
        elif layout is None or not layout.matches(shapes):
            layout = TensorLayout(shapes)
        if self.state is not None:
            if storage(fmt) != storage(self.fmt):
                raise ShapeMismatchError(
                    f"the optimizer's state is in format {fm.describe(self.fmt)}, but these arrays step as "
                    f"{fm.describe(fmt)}; expected parameters of the dtype of earlier steps")
            if slots != self.slots:
                raise InvalidParameterError(
                    f"these hyperparameters need state slots {sorted(slots)}, but the optimizer holds "
                    f"{sorted(self.slots)}; expected hyperparameters that keep the same state")
        skip = False
        if found_inf is not None and not check_finite and _host_flag(found_inf) is not None:
            skip, found_inf = _host_flag(found_inf), None
        if check_finite and fmt is None:
            raise UnsupportedOperationError(f"check_finite on a float32 {name} step, expected a step format (the "
                                            "gradients' check runs in the formats capability)")
        format_state = None
        if fmt is not None:
            format_state = self._format_state_for(layout, fmt, slots)
        if scalars is None:
            scalars = definition.scalars(hp, self.step_count + 1, grad_factor=grad_factor)
        fresh = self.state is None
        state = self.state
        if fresh and not skip:
            state = self._fresh_state(layout, fmt, slots, format_state)
        if check_finite and found_inf is None:
            found_inf = self._call("optirs_alloc", backend.alloc, backend.ctx, 1, np.int32, 0)
        controls = StepControls(self.step_count + 1, int(seed) & 0xFFFFFFFF, found_inf, check_finite, device)
        return PreparedStep(self, params, grads, fmt, layout, slots, state, fresh, scalars, controls, format_state, skip)

    def prepare_again(self, last: PreparedStep, params: List[Any], grads: List[Any], hp: Any,
                      grad_factor: float = 1.0) -> Optional[PreparedStep]:
        """The next step like ``last`` (a step :meth:`prepare` made with host scalars and no
        found_inf, that ran), over these arrays and hyperparameters: None when anything ``last``
        was checked against changed since (the state, its format or layout), and the caller
        calls :meth:`prepare`. The caller vouches that the arrays, the state slots and the format
        are what ``last`` was prepared with (a front end's cached plan)."""
        if (last.engine is not self or last.state is not self.state or last.fmt is not self.fmt
                or last.layout is not self.layout or self.state is None or last.controls.found_inf is not None
                or last.controls.check_finite or last.controls.device is not None):
            return None
        step = self.step_count + 1
        controls = StepControls(step, last.controls.seed, None, False, None)
        return PreparedStep(self, params, grads, last.fmt, last.layout, last.slots, last.state, False,
                            self.definition.scalars(hp, step, grad_factor=grad_factor), controls, last.format_state,
                            False)

    def step(self, params: List[Any], grads: List[Any], **kwargs: Any) -> bool:
        """:meth:`prepare` and :func:`run_steps` one step; returns whether it was applied."""
        with self.lock:
            prepared = self.prepare(params, grads, **kwargs)
            run_steps([prepared])
            return prepared.applied

    def _format_state_for(self, layout: TensorLayout, fmt: StepFormat, slots: Dict[str, float]) -> FormatState:
        fs = self._format_state
        if fs is None or fs.layout is not layout or fs.fmt != storage(fmt) or fs.slot_names != tuple(slots):
            fs = fm.format_state(self.definition, layout, storage(fmt), slots)
        return fs

    def _fresh_state(self, layout: TensorLayout, fmt: Optional[StepFormat], slots: Dict[str, float],
                     format_state: Optional[FormatState]) -> Dict[str, Any]:
        if format_state is not None:
            sizes, dtypes = format_state.buffer_sizes(), format_state.buffer_dtypes()
            fills = format_state.buffer_fills(dict(slots))
        else:
            sizes = self.definition.state_layout(layout, tuple(slots)).buffer_sizes()
            dtypes = {k: STATE_DTYPE for k in sizes}
            fills = {k: float(slots[k]) for k in sizes}
        backend = self.backend
        with backend.lock:  # the context's stream and caches are shared
            if self._allocate is not None:
                return self._call("optirs_alloc", self._allocate, sizes, dtypes, fills)
            return {k: self._call("optirs_alloc", backend.alloc, backend.ctx, sizes[k], dtypes[k], fills[k])
                    for k in sizes}

    def _call(self, hook: str, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            error = self.backend.plugin_error(exc, hook)
            if error is exc:
                raise
            raise error from exc

    # ------------------------------------------------------------ where the state lives

    def _device_state(self) -> Dict[str, Any]:
        """The state on the device (moved there if it is on the host)."""
        if self.state is not None and not self.state_on_device:
            backend = self.backend
            self.state = {k: backend.to_device(backend.ctx, v) for k, v in self.state.items()}
            self.state_on_device = True
        return self.state

    def to_device(self) -> None:
        """Make the state device-resident (no-op where it is)."""
        with self.lock:
            self._call("optirs_to_device", self._device_state)

    def to_host(self) -> None:
        """Bring the state to host memory (numpy); the next step sends it back."""
        with self.lock:
            if self.state is not None and self.state_on_device:
                self.state, self.state_on_device = self.host_state(), False
                if self.layout is not None:
                    # what the backend derived from the device buffers (a prepared launch holds
                    # them) must not keep them alive: the point of moving them is to free them
                    self.layout.cache.clear()

    def host_state(self) -> Dict[str, np.ndarray]:
        """Host copies of the flat state buffers, each in its own dtype (empty before the first step)."""
        with self.lock:
            if self.state is None:
                return {}
            dtypes = self.buffer_dtypes()
            if not self.state_on_device:
                return {k: np.array(v, dtype=dtypes[k], copy=True) for k, v in self.state.items()}
            backend = self.backend
            return {k: np.asarray(self._call("optirs_to_host", backend.to_host, backend.ctx, v)).view(dtypes[k])
                    .reshape(-1) for k, v in self.state.items()}

    def buffer_dtypes(self) -> Dict[str, np.dtype]:
        """Buffer name -> the dtype of its flat buffer."""
        if self.state is None:
            return {}
        if self.fmt is not None:
            return self.format_state().buffer_dtypes()
        return {k: STATE_DTYPE for k in self.state}

    def format_state(self) -> Optional[FormatState]:
        """Where a step format's buffers live (None for float32 state)."""
        if self.fmt is None or self.layout is None:
            return None
        if self._format_state is None:
            self._format_state = fm.format_state(self.definition, self.layout, storage(self.fmt), self.slots)
        return self._format_state

    def state_bytes(self) -> int:
        """Bytes of state held (every buffer, in its own dtype)."""
        if self.state is None:
            return 0
        dtypes = self.buffer_dtypes()
        return sum(int(v.size) * dtypes[k].itemsize for k, v in self.state.items())

    def master_weights(self) -> Optional[List[np.ndarray]]:
        """Host copies of float32 master weights, shaped like the parameters (None when the format keeps none)."""
        fs = self.format_state()
        if fs is None or fs.master_buffer() != "master":
            return None
        flat = self.host_state()["master"]
        return [v.copy() for v in fs.views("master", flat)]

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self) -> Dict[str, Any]:
        """``{"step", "shapes", "state"[, "format"]}``: the count, the tensors' shapes and per tensor
        its state (host copies; a format's compact buffers as they are: docs/formats.md)."""
        with self.lock:
            out: Dict[str, Any] = {"step": self.step_count,
                                   "shapes": [list(s) for s in self.layout.shapes] if self.layout else [], "state": []}
            if self.state is None or self.layout is None:
                return out
            flat = self.host_state()
            if self.fmt is not None:
                out["state"] = fm.checkpoint_state(self.format_state(), flat)
                out["format"] = fm.format_record(self.fmt)
                return out
            state_layout = self.definition.state_layout(self.layout, tuple(flat))
            views = {k: state_layout.views(k, v) for k, v in flat.items()}
            out["state"] = [{k: views[k][i].copy() for k in flat if views[k][i] is not None}
                            for i in range(len(self.layout))]
            return out

    def restore(self, step: int, shapes: List[Tuple[int, ...]], entries: List[Any], slots: Dict[str, float],
                fmt: Optional[StepFormat]) -> None:
        """Install a checkpoint's state (fields already read by :mod:`optirs.core.checkpoint`); every
        entry is checked and converted before anything changes. The state lands on the host; the
        next step sends it to the device."""
        if not shapes:
            if entries or step:
                raise InvalidParameterError("state_dict has state or steps but no shapes, expected both or neither")
            with self.lock:
                self.reset()
            return
        if len(entries) != len(shapes):
            raise InvalidParameterError(f"state_dict has {len(entries)} state entries for {len(shapes)} tensors, "
                                        "expected one per tensor")
        layout = TensorLayout(shapes)
        fmt = fmt if storage(fmt) is not None else None
        if fmt is not None:
            flat = fm.restore_state(fm.format_state(self.definition, layout, storage(fmt), slots), entries, slots)
        else:
            flat = _restore_float32(self.definition, layout, entries, slots)
        with self.lock:
            self.layout, self.slots, self.fmt, self.state, self.state_on_device = layout, dict(slots), fmt, flat, False
            self._format_state, self.step_count, self.counts_on_device = None, step, False

    def adopt(self, layout: TensorLayout, slots: Dict[str, float], fmt: Optional[StepFormat], state: Dict[str, Any],
              step_count: int) -> None:
        """Hold state a front end made (the backend's arrays over its own buffers), as after a step."""
        fmt = fmt if storage(fmt) is not None else None
        with self.lock:
            self.layout, self.slots, self.fmt, self.state, self.state_on_device = layout, dict(slots), fmt, state, True
            self._format_state, self.step_count, self.counts_on_device = None, int(step_count), False

    def reset(self) -> None:
        """Forget the state and the count (a fresh engine)."""
        with self.lock:
            self.layout = self.slots = self.fmt = self.state = self._format_state = None
            self.state_on_device, self.step_count, self.counts_on_device = False, 0, False

    # ------------------------------------------------------------ copies

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled (and deep-copied) as host copies of the state; the lock is made anew."""
        with self.lock:
            state = dict(self.__dict__)
            state["state"] = self.host_state() if self.state is not None else None
            state["state_on_device"] = False
            del state["lock"]
            return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()


def _host_flag(found_inf: Any) -> Optional[bool]:
    """A host found_inf's value (None for a device array, read on the device)."""
    if isinstance(found_inf, (bool, np.bool_)):
        return bool(found_inf)
    if isinstance(found_inf, np.ndarray):
        if found_inf.size != 1:
            raise InvalidParameterError(f"found_inf has {found_inf.size} elements, expected a bool or a 1-element array")
        return bool(found_inf.reshape(-1)[0] != 0)
    return None


def _restore_float32(definition: OptimizerDefinition, layout: TensorLayout, entries: List[Any],
                     slots: Dict[str, float]) -> Dict[str, np.ndarray]:
    state_layout = definition.state_layout(layout, tuple(slots))
    values = []  # every entry checked and converted before the flat buffers are made
    for i, entry in enumerate(entries):
        wanted = state_layout.state_shapes(i)
        if not isinstance(entry, Mapping) or set(entry) != set(wanted):
            got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise InvalidParameterError(f"state[{i}] has slots {got}, expected {sorted(wanted)} for shape "
                                        f"{layout.shapes[i]}")
        values.append({k: ck.float32_array(entry[k], f"state[{i}][{k!r}]", shape) for k, shape in wanted.items()})
    flat = {k: np.zeros(n, STATE_DTYPE) for k, n in state_layout.buffer_sizes().items()}
    views = {k: state_layout.views(k, flat[k]) for k in flat}
    for i, entry in enumerate(values):
        for k, value in entry.items():
            views[k][i][...] = value
    return flat


__all__ = ["PreparedStep", "StepEngine", "run_steps", "storage"]
