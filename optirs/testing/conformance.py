"""The conformance kit: the checks every built-in backend passes, for any backend's own CI.

    from optirs.testing import check_backend
    check_backend("mybackend")   # raises AssertionError naming the check, the optimizer and what differed

or, under pytest, one test per check (``optirs.testing.pytest_plugin``)::

    pytest -p optirs.testing.pytest_plugin --optirs-backend=mybackend

Every check runs through the seed API on numpy input arrays (so the backend's staging and
``Staged.finish`` are part of it) or, where only the backend can be asked, through its own
``optirs_step`` with a :class:`~optirs.plugin.hookspecs.StepRequest`. Results are compared with
:mod:`optirs.core.reference` (float64) within float32 rounding, or bit for bit where the contract
says so. What a backend steps is what its ``optirs_step_support()`` lists; a check of a part it
does not list (step formats, device-side scalars) is skipped with the reason.

The checks (:data:`CHECKS`, in order):

- ``steps``: every optimizer it lists steps like the reference, with each of the definition's
  example hyperparameters, parameters and state, and never writes a gradient;
- ``grad_factor``: ``scalars.grad_factor`` multiplies the gradients first (maximize's -1 against
  the reference on negated gradients, a loss scaler's 1/4);
- ``found_inf``: a host ``found_inf`` skips the whole step; a flag of the backend's own (from
  ``optirs_alloc``) set in the request writes nothing, and one that is clear steps;
- ``unsupported_optimizer``: an optimizer it does not list raises ``UnsupportedOperationError``
  naming the backend, before anything changes (through the seed API and through ``optirs_step``);
- ``failed_step``: a refused step changes nothing visible: the next step goes on as if it never
  happened; a request with a step format or device-side scalars it does not list is refused by
  ``optirs_step`` before anything is written;
- ``resume``: ``state_dict()`` / ``load_state_dict()`` (and a trip of the state to the host) resume
  bit for bit;
- ``formats`` (optional): the optimizers of ``StepSupport.formats`` on bfloat16 parameters with
  float32 master weights: masters and state like the reference, parameters the masters rounded
  to nearest, ``check_finite`` skipping a step with an inf gradient, resume bit for bit;
- ``device_scalars`` (optional): the optimizers of ``StepSupport.capturable`` with the step count,
  lr, gradient scale and ``found_inf`` on the device, like the reference.

Sizes are tiny (the model of tests/test_optimizers.py, a few steps), so the kit runs in seconds
once the backend's kernels are compiled.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from optirs.core import reference
from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.errors import GpuOptimError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.formats import FORMAT_FAMILIES, FormatState, Precision, StepFormat, format_slots, resolve_format
from optirs.core.layout import TensorLayout
from optirs.plugin.hookspecs import DeviceStepInputs, StepControls, StepRequest, StepSupport

# The model of tests/test_optimizers.py: a matrix, vectors, a 3-d tensor (Adafactor factors its
# last two dims) and a single element.
MODEL_SHAPES: Tuple[Tuple[int, ...], ...] = ((17, 9), (300,), (5,), (2, 3, 4), (1,))
STEPS = 3
# float32 kernels against the float64 reference: relative, with a floor of the tensor's scale.
RTOL = 1e-5
# Exact in float32, so the reference sees exactly the gradients the backend multiplies.
GRAD_FACTORS = (-1.0, 0.25)


class Skipped(Exception):
    """A check that does not apply to this backend (an optional part it does not list), and why."""


@dataclass
class _Kit:
    """What every check needs: the backend's name, its options, the opened backend and its support."""

    name: str
    options: Dict[str, Any]
    only: Optional[Tuple[str, ...]]
    backend: Any = None
    support: StepSupport = field(default_factory=StepSupport)

    def listed(self, names: Sequence[str]) -> List[str]:
        return [n for n in names if self.only is None or n in self.only]

    def optimizer(self, name: str, hp: Any, precision: Optional[Precision] = None) -> Any:
        from optirs.optim.optimizers import OPTIMIZERS, GpuOptimizerConfig

        config = GpuOptimizerConfig(backend=self.name, options=dict(self.options))
        return OPTIMIZERS[name](hp, config, precision=precision)


# ---------------------------------------------------------------- helpers


def _problem(seed: int, steps: int = STEPS, shapes: Sequence[Tuple[int, ...]] = MODEL_SHAPES):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]
    return params, grads


def _float32_optimizers(kit: "_Kit") -> List[str]:
    """The float32 optimizers to check (those the backend lists, among those asked for), or Skipped."""
    names = kit.listed(kit.support.optimizers)
    if not names:
        raise Skipped(f"backend {kit.name!r} lists no optimizer in optirs_step_support().optimizers")
    return names


def _richest(definition: OptimizerDefinition) -> Any:
    """The first example hyperparameters that need every state slot any example needs."""
    return max(definition.examples, key=lambda hp: len(definition.state_slots(hp)))


def _copy(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    return [np.array(a, copy=True) for a in arrays]


def _assert_close(actual: Sequence[Any], expected: Sequence[Any], what: str) -> None:
    """float32 results within float32 rounding of the float64 reference (rtol 1e-5, floor 1e-5 of
    the tensor's largest magnitude), as tests/test_optimizers.py compares every built-in."""
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} tensors, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        where = what if len(actual) == 1 else f"{what}, tensor {i}"
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            raise AssertionError(f"{where}: shape {a.shape}, expected {e.shape}")
        scale = float(np.max(np.abs(e))) if e.size else 1.0
        ok = np.isclose(a, e, rtol=RTOL, atol=RTOL * (scale or 1.0), equal_nan=True)
        if not ok.all():
            k = int(np.argmin(ok.reshape(-1)))
            raise AssertionError(
                f"{where}: {int((~ok).sum())} of {a.size} elements differ from the float64 reference "
                f"by more than float32 rounding (rtol {RTOL}); the first at flat index {k}: got "
                f"{float(a.reshape(-1)[k])!r}, expected {float(e.reshape(-1)[k])!r}")


def _assert_same(actual: Sequence[Any], expected: Sequence[Any], what: str) -> None:
    """Bit for bit (shapes and dtypes too)."""
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} arrays, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = np.ascontiguousarray(a), np.ascontiguousarray(e)
        if a.shape != e.shape or a.dtype != e.dtype:
            raise AssertionError(f"{what}, array {i}: {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        if a.size == 0:
            continue
        differs = np.any(a.reshape(a.size, 1).view(np.uint8) != e.reshape(e.size, 1).view(np.uint8), axis=1)
        if differs.any():
            k = int(np.argmax(differs))
            raise AssertionError(f"{what}, array {i}: {int(differs.sum())} of {a.size} elements differ in their bits; "
                                 f"the first at flat index {k}: got {a.reshape(-1)[k].item()!r}, expected "
                                 f"{e.reshape(-1)[k].item()!r}")


def _state_arrays(state_dict: Mapping[str, Any]) -> List[np.ndarray]:
    """Every array of a checkpoint's state, in a fixed order (tensor, then key)."""
    return [np.asarray(entry[k]) for entry in state_dict["state"] for k in sorted(entry)]


def _assert_same_checkpoint(got: Mapping[str, Any], want: Mapping[str, Any], what: str) -> None:
    if got["step"] != want["step"] or got["shapes"] != want["shapes"]:
        raise AssertionError(f"{what}: step {got['step']} and shapes {got['shapes']}, expected step {want['step']} "
                             f"and shapes {want['shapes']}")
    keys = [sorted(e) for e in got["state"]]
    if keys != [sorted(e) for e in want["state"]]:
        raise AssertionError(f"{what}: state keys {keys}, expected {[sorted(e) for e in want['state']]}")
    _assert_same(_state_arrays(got), _state_arrays(want), f"{what}: state")


def _assert_reference_state(state: List[Mapping[str, Any]], expected: List[Mapping[str, Any]], what: str) -> None:
    for t, (mine, ref) in enumerate(zip(state, expected)):
        if set(mine) != set(ref):
            raise AssertionError(f"{what}: tensor {t} has state slots {sorted(mine)}, expected {sorted(ref)}")
        for k in sorted(ref):
            _assert_close([mine[k]], [ref[k]], f"{what}: state {k!r} of tensor {t}")


def _expect_error(kind: type, fn: Callable[[], Any], what: str, naming: Optional[str] = None) -> BaseException:
    try:
        fn()
    except kind as exc:
        if naming is not None and naming not in str(exc):
            raise AssertionError(f"{what} raised {type(exc).__name__}({str(exc)!r}), expected its message to name "
                                 f"{naming}") from exc
        return exc
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}, expected {kind.__name__}") from exc
    raise AssertionError(f"{what} raised nothing, expected {kind.__name__}")


def _host(kit: _Kit, arrays: Sequence[Any]) -> List[np.ndarray]:
    b = kit.backend
    return [np.asarray(b.to_host(b.ctx, a)).reshape(-1).copy() for a in arrays]


def _fresh_state(kit: _Kit, definition: OptimizerDefinition, hp: Any, layout: TensorLayout) -> Dict[str, Any]:
    b = kit.backend
    slots = definition.state_slots(hp)
    sizes = definition.state_layout(layout, tuple(slots)).buffer_sizes()
    return {k: b.alloc(b.ctx, sizes[k], np.float32, slots[k]) for k in sizes}


def _request(kit: _Kit, definition: OptimizerDefinition, hp: Any, staged: Any, state: Dict[str, Any],
             layout: TensorLayout, step: int, *, found_inf: Any = None, device: Optional[DeviceStepInputs] = None,
             fmt: Any = None, format_state: Any = None) -> None:
    """One call of the backend's ``optirs_step`` (as the engine makes it), on staged arrays."""
    b = kit.backend
    scalars = definition.scalars(hp, step)
    with b.lock:
        b.step(b.ctx, StepRequest(definition, staged.params, staged.grads, state, layout, scalars,
                                  StepControls(step, 0, found_inf, False, device), fmt, format_state))
        b.synchronize()


def _finish(kit: _Kit, staged: Any) -> None:
    if staged.finish is not None:
        staged.finish()
    kit.backend.synchronize()


def _stage(kit: _Kit, params: List[np.ndarray], grads: List[np.ndarray], fmt: Any = None) -> Any:
    b = kit.backend
    with b.lock:
        return b.stage(b.ctx, params, grads, fmt)


def _refused_before_writing(kit: _Kit, definition: OptimizerDefinition, hp: Any, what: str,
                            fmt: Any = None, device: Optional[Callable[[TensorLayout], DeviceStepInputs]] = None,
                            seed: int = 0) -> None:
    """A request ``optirs_step`` must refuse: UnsupportedOperationError, and no parameter or state written."""
    params, grads = _problem(seed, 1)
    grads = grads[0]
    layout = TensorLayout([p.shape for p in params])
    if fmt is not None:
        import ml_dtypes

        params = [p.astype(ml_dtypes.bfloat16) for p in params]
        grads = [g.astype(ml_dtypes.bfloat16) for g in grads]
        fs = FormatState(layout, format_slots(definition, hp), fmt)
        b = kit.backend
        sizes, dtypes, fills = fs.buffer_sizes(), fs.buffer_dtypes(), fs.buffer_fills(definition.state_slots(hp))
        state = {k: b.alloc(b.ctx, sizes[k], dtypes[k], fills[k]) for k in sizes}
    else:
        fs, state = None, _fresh_state(kit, definition, hp, layout)
    before_p, before_s = _copy(params), _host(kit, state.values())
    try:
        staged = _stage(kit, params, grads, fmt)
    except GpuOptimError:
        return  # refused while staging: nothing was stepped
    staged_before = _host(kit, staged.params)
    inputs = device(layout) if device is not None else None
    _expect_error(UnsupportedOperationError,
                  lambda: _request(kit, definition, hp, staged, state, layout, 1, device=inputs, fmt=fmt,
                                   format_state=fs), f"optirs_step with {what}")
    _assert_same(_host(kit, staged.params), staged_before, f"the staged parameters after a refused {what}")
    _assert_same(_host(kit, state.values()), before_s, f"the state after a refused {what}")
    _assert_same(params, before_p, f"the caller's parameters after a refused {what}")


def _device_inputs(kit: _Kit, definition: OptimizerDefinition, hp: Any, layout: TensorLayout, *, found: float = 0.0,
                   scale: float = 1.0, sign: float = 1.0, steps: Any = None) -> DeviceStepInputs:
    from optirs.core.scalars import FORMULAS

    b = kit.backend
    f32 = np.float32
    record = b.alloc(b.ctx, len(definition.scalars_type._fields), f32, 0.0)
    steps = b.alloc(b.ctx, len(layout), f32, 0.0) if steps is None else steps
    constants = FORMULAS[definition.name].constants(hp) if definition.name in FORMULAS else ()
    return DeviceStepInputs(steps=steps, record=record, constants=constants, lr=float(hp.lr), sign=sign,
                            grad_scale=b.alloc(b.ctx, 1, f32, scale), found_inf=b.alloc(b.ctx, 1, f32, found))


@contextmanager
def _about(what: str) -> Iterator[None]:
    """Name ``what`` (an optimizer, a case) in any failure inside."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from exc.__cause__
    except Skipped:
        raise
    except Exception as exc:
        raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------- the checks


def check_steps(kit: _Kit) -> None:
    if not kit.support.optimizers:
        raise AssertionError("optirs_step_support().optimizers is empty, expected the optimizers its optirs_step "
                             "runs (a backend without optirs_step steps nothing)")
    names = kit.listed(kit.support.optimizers)
    if not names:
        raise Skipped(f"backend {kit.name!r} lists none of the optimizers asked for ({list(kit.only)})")
    for name in names:
        definition = DEFINITIONS[name]
        for i, hp in enumerate(definition.examples):
            with _about(f"{name} with {hp}"):
                params, grads = _problem(100 + i)
                expected, expected_state = reference.run(name, params, grads, hp)
                opt = kit.optimizer(name, hp)
                for t, g in enumerate(grads, start=1):
                    seen = _copy(g)
                    if opt.step_gpu(params, g) is not True:
                        raise AssertionError(f"step {t} returned False (not applied) without a found_inf flag")
                    _assert_same(g, seen, f"the gradients after step {t} (never written)")
                if opt.step_count != STEPS:
                    raise AssertionError(f"step_count={opt.step_count} after {STEPS} steps")
                _assert_close(params, expected, f"the parameters after {STEPS} steps")
                _assert_reference_state(opt.state_dict()["state"], expected_state, f"after {STEPS} steps")


def check_grad_factor(kit: _Kit) -> None:
    names = _float32_optimizers(kit)
    for name in names:
        hp = _richest(DEFINITIONS[name])
        for factor in GRAD_FACTORS:
            with _about(f"{name} with grad_factor={factor}" + (" (maximize)" if factor < 0 else " (unscale)")):
                params, grads = _problem(200, 2)
                expected, _ = reference.run(name, params, [[np.float32(factor) * g for g in gs] for gs in grads], hp)
                opt = kit.optimizer(name, hp)
                for g in grads:
                    opt.step_gpu(params, g, grad_factor=factor)
                _assert_close(params, expected, "the parameters (the reference on the multiplied gradients)")


def check_found_inf(kit: _Kit) -> None:
    names = _float32_optimizers(kit)
    b = kit.backend
    for name in names:
        definition = DEFINITIONS[name]
        hp = _richest(definition)
        with _about(name):
            start, grads = _problem(300, STEPS)
            params = _copy(start)
            opt = kit.optimizer(name, hp)
            opt.step_gpu(params, grads[0])
            held_p, held_s = _copy(params), opt.state_dict()
            for flag in (True, np.ones(1, np.int32)):
                if opt.step_gpu(params, grads[1], found_inf=flag) is not False:
                    raise AssertionError(f"a step with found_inf={flag!r} returned True, expected False (skipped)")
                _assert_same(params, held_p, f"the parameters after a step with found_inf={flag!r}")
                _assert_same_checkpoint(opt.state_dict(), held_s,
                                        f"the checkpoint after a step with found_inf={flag!r}")
            # The backend's own flag in the request (what a device-side loss scaler hands over).
            engine = opt.engine
            staged = _stage(kit, params, grads[1])
            _request(kit, definition, hp, staged, engine.state, engine.layout, 2,
                     found_inf=b.alloc(b.ctx, 1, np.int32, 1))
            _finish(kit, staged)
            _assert_same(params, held_p, "the parameters after optirs_step with a set found_inf flag")
            _assert_same_checkpoint(opt.state_dict(), held_s,
                                    "the checkpoint after optirs_step with a set found_inf flag")
            if opt.step_gpu(params, grads[1], found_inf=np.zeros(1, np.int32)) is not True:
                raise AssertionError("a step with a clear found_inf returned False, expected True")
            expected, _ = reference.run(name, start, grads[:2], hp)
            _assert_close(params, expected, "the parameters after the skipped steps and 2 applied ones")
            staged = _stage(kit, params, grads[2])
            _request(kit, definition, hp, staged, engine.state, engine.layout, 3,
                     found_inf=b.alloc(b.ctx, 1, np.int32, 0))
            _finish(kit, staged)
            expected, _ = reference.run(name, start, grads, hp)
            _assert_close(params, expected, "the parameters after optirs_step with a clear found_inf flag")


def check_unsupported_optimizer(kit: _Kit) -> None:
    names = kit.listed([n for n in DEFINITIONS if n not in kit.support.optimizers])
    if not names:
        raise Skipped(f"backend {kit.name!r} steps every optimizer")
    for name in names:
        definition = DEFINITIONS[name]
        hp = _richest(definition)
        with _about(f"{name} (not listed)"):
            params, grads = _problem(400, 1)
            before = _copy(params)
            opt = kit.optimizer(name, hp)
            _expect_error(UnsupportedOperationError, lambda: opt.step_gpu(params, grads[0]),
                          f"a {name} step through the seed API", naming=repr(kit.name))
            _assert_same(params, before, "the parameters after the refused step")
            sd = opt.state_dict()
            if opt.step_count != 0 or sd["state"] or sd["shapes"]:
                raise AssertionError(f"the refused step left step_count={opt.step_count}, shapes={sd['shapes']}")
            _refused_before_writing(kit, definition, hp, f"a float32 {name} request (not listed)")


def check_failed_step(kit: _Kit) -> None:
    names = _float32_optimizers(kit)
    import ml_dtypes

    for name in names:
        definition = DEFINITIONS[name]
        hp = _richest(definition)
        with _about(name):
            start, grads = _problem(500, STEPS)
            params = _copy(start)
            opt = kit.optimizer(name, hp)
            for g in grads[:2]:
                opt.step_gpu(params, g)
            held_p, held_s = _copy(params), opt.state_dict()
            wrong = [np.ones(params[0].size + 1, np.float32)] + grads[2][1:]
            _expect_error(ShapeMismatchError, lambda: opt.step_gpu(params, wrong), "a step with a gradient of the "
                          "wrong shape")
            read_only = _copy(params)
            read_only[-1].flags.writeable = False
            _expect_error(ShapeMismatchError, lambda: opt.step_gpu(read_only, grads[2]), "a step on a read-only "
                          "parameter")
            if definition.kernel in FORMAT_FAMILIES and name not in kit.support.formats:
                half = [p.astype(ml_dtypes.bfloat16) for p in params]
                half_before = _copy(half)
                _expect_error(UnsupportedOperationError, lambda: opt.step_gpu(half, [g.astype(ml_dtypes.bfloat16)
                                                                                     for g in grads[2]]),
                              "a bfloat16 step (the backend lists no formats for it)", naming=repr(kit.name))
                _assert_same(half, half_before, "the bfloat16 parameters after the refused step")
            _assert_same(params, held_p, "the parameters after the refused steps")
            _assert_same_checkpoint(opt.state_dict(), held_s, "the checkpoint after the refused steps")
            opt.step_gpu(params, grads[2])
            expected, _ = reference.run(name, start, grads, hp)
            _assert_close(params, expected, "the step after the refused ones, against the reference")
            if opt.step_count != STEPS:
                raise AssertionError(f"step_count={opt.step_count} after {STEPS} steps and refused ones")
            if name not in kit.support.formats:
                _refused_before_writing(kit, definition, hp, "a bfloat16 step format (not listed)",
                                        fmt=StepFormat("bfloat16", "bfloat16"))
            if name not in kit.support.capturable:
                _refused_before_writing(kit, definition, hp, "device-side scalars (not listed)",
                                        device=lambda layout: _device_inputs(kit, definition, hp, layout))


def check_resume(kit: _Kit) -> None:
    names = _float32_optimizers(kit)
    for name in names:
        definition = DEFINITIONS[name]
        hp = _richest(definition)
        with _about(name):
            start, grads = _problem(600, STEPS)
            straight = kit.optimizer(name, hp)
            p_straight = _copy(start)
            for g in grads:
                straight.step_gpu(p_straight, g)
            first = kit.optimizer(name, hp)
            p_resumed = _copy(start)
            for g in grads[:-1]:
                first.step_gpu(p_resumed, g)
            checkpoint = first.state_dict()
            p_moved = _copy(p_resumed)
            second = kit.optimizer(name, definition.default_params())
            second.load_state_dict(checkpoint)
            second.step_gpu(p_resumed, grads[-1])
            _assert_same(p_resumed, p_straight, "the parameters of a run resumed from state_dict()")
            _assert_same_checkpoint(second.state_dict(), straight.state_dict(), "the checkpoint of the resumed run")
            first.move_to_cpu()  # the state to the host and back: optirs_to_host / optirs_to_device
            first.step_gpu(p_moved, grads[-1])
            _assert_same(p_moved, p_straight, "the parameters after move_to_cpu() and a step")
            _assert_same_checkpoint(first.state_dict(), straight.state_dict(), "the checkpoint after move_to_cpu()")


def check_formats(kit: _Kit) -> None:
    names = kit.listed(kit.support.formats)
    if not names:
        raise Skipped(f"backend {kit.name!r} lists no step formats (optirs_step_support().formats is empty)")
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    precision = Precision(master_weights="float32")
    for name in names:
        definition = DEFINITIONS[name]
        hp = _richest(definition)
        with _about(f"{name} on bfloat16 parameters with float32 master weights"):
            start, grads = _problem(700, STEPS + 1)
            params = [p.astype(bf16) for p in start]
            masters0 = [p.astype(np.float32) for p in params]
            opt = kit.optimizer(name, hp, precision)
            for g in grads[:STEPS]:
                if opt.step_gpu(params, g) is not True:
                    raise AssertionError("a format step returned False (not applied) without a found_inf flag")
            expected, expected_state = reference.run(name, masters0, grads[:STEPS], hp)
            masters = opt.engine.master_weights()
            if masters is None:
                raise AssertionError("the optimizer keeps no float32 master weights")
            _assert_close(masters, expected, f"the master weights after {STEPS} steps")
            _assert_same(params, [m.astype(bf16) for m in masters], "the bfloat16 parameters (the masters rounded "
                         "to nearest even)")
            state = [{k: v for k, v in entry.items() if k in ref}
                     for entry, ref in zip(opt.state_dict()["state"], expected_state)]
            _assert_reference_state(state, expected_state, f"after {STEPS} steps")
            # check_finite: an inf gradient sets the flag on the device and the step writes nothing
            held_p, held_s = _copy(params), opt.state_dict()
            poisoned = _copy(grads[STEPS])
            poisoned[0].reshape(-1)[-1] = np.inf
            fmt = resolve_format(precision, bf16, np.float32, definition.kernel)
            engine = opt.engine
            applied = engine.step(params, poisoned, shapes=[p.shape for p in params], hp=hp, fmt=fmt,
                                  check_finite=True)
            if applied:
                raise AssertionError("a check_finite step with an inf gradient was applied, expected it skipped")
            _assert_same(params, held_p, "the parameters after a check_finite step with an inf gradient")
            _assert_same_checkpoint(opt.state_dict(), held_s, "the checkpoint after a check_finite step with an inf "
                                    "gradient")
            resumed = kit.optimizer(name, hp, precision)
            resumed.load_state_dict(held_s)
            p_resumed = _copy(params)
            if not engine.step(params, grads[STEPS], shapes=[p.shape for p in params], hp=hp, fmt=fmt,
                               check_finite=True):
                raise AssertionError("a check_finite step with finite gradients was skipped")
            resumed.step_gpu(p_resumed, grads[STEPS])
            _assert_same(p_resumed, params, "the parameters of a format run resumed from state_dict()")
            _assert_same_checkpoint(resumed.state_dict(), opt.state_dict(), "the checkpoint of the resumed format run")


def check_device_scalars(kit: _Kit) -> None:
    names = kit.listed(kit.support.capturable)
    if not names:
        raise Skipped(f"backend {kit.name!r} lists no device-side scalars (optirs_step_support().capturable is "
                      "empty)")
    b = kit.backend
    scale, sign = 4.0, -1.0
    for name in names:
        definition = DEFINITIONS[name]
        hp = _richest(definition)
        with _about(f"{name} with device-side scalars"):
            start, grads = _problem(800, STEPS)
            layout = TensorLayout([p.shape for p in start])
            params = [b.to_device(b.ctx, p.reshape(-1)) for p in start]
            state = _fresh_state(kit, definition, hp, layout)
            live = _device_inputs(kit, definition, hp, layout, scale=scale, sign=sign)
            skip = _device_inputs(kit, definition, hp, layout, scale=scale, sign=sign, found=1.0, steps=live.steps)
            for t, g in enumerate(grads):
                dev_g = [b.to_device(b.ctx, x.reshape(-1)) for x in g]
                for inputs in ((skip, live) if t == 1 else (live,)):
                    with b.lock:
                        b.step(b.ctx, StepRequest(definition, params, dev_g, state, layout, definition.scalars(hp, 1),
                                                  StepControls(t + 1, 0, None, False, inputs)))
                        b.synchronize()
            counts = _host(kit, [live.steps])[0]
            if not np.array_equal(counts, np.full(len(layout), STEPS, np.float32)):
                raise AssertionError(f"the device step counts are {counts.tolist()} after {STEPS} steps and a "
                                     f"skipped one, expected every one {STEPS}")
            factor = np.float32(sign / scale)
            expected, expected_state = reference.run(name, start, [[factor * x for x in g] for g in grads], hp)
            got = [h.reshape(s) for h, s in zip(_host(kit, params), layout.shapes)]
            _assert_close(got, expected, f"the parameters after {STEPS} steps (grad factor {factor})")
            where = definition.state_layout(layout, tuple(state))
            views = {k: where.views(k, _host(kit, [v])[0]) for k, v in state.items()}
            mine = [{k: views[k][t] for k in views if views[k][t] is not None} for t in range(len(layout))]
            _assert_reference_state(mine, expected_state, f"after {STEPS} steps")


# name -> check, in the order they run. A check raises AssertionError when the backend fails it
# and Skipped when it does not apply.
CHECKS: Dict[str, Callable[[_Kit], None]] = {
    "steps": check_steps,
    "grad_factor": check_grad_factor,
    "found_inf": check_found_inf,
    "unsupported_optimizer": check_unsupported_optimizer,
    "failed_step": check_failed_step,
    "resume": check_resume,
    "formats": check_formats,
    "device_scalars": check_device_scalars,
}
OPTIONAL_CHECKS = ("formats", "device_scalars")


def _open(name: str, options: Optional[Mapping[str, Any]], optimizers: Optional[Sequence[str]]) -> _Kit:
    from optirs.plugin.registry import REGISTRY

    if optimizers is not None:
        unknown = sorted(set(optimizers) - set(DEFINITIONS))
        if unknown:
            raise AssertionError(f"optimizers={list(optimizers)} names {unknown}, expected optimizer definitions "
                                 f"{sorted(DEFINITIONS)}")
    kit = _Kit(name, dict(options or {}), None if optimizers is None else tuple(optimizers))
    try:
        kit.backend = REGISTRY.get_backend(name, kit.options)
    except GpuOptimError as exc:
        raise AssertionError(f"backend {name!r} does not open: {exc}") from exc
    kit.support = kit.backend.support
    return kit


def check(name: str, what: str, *, options: Optional[Mapping[str, Any]] = None,
          optimizers: Optional[Sequence[str]] = None) -> Optional[str]:
    """Run the conformance check ``what`` (a key of :data:`CHECKS`) on the backend called ``name``.

    :param name: the backend's registered name (an entry point's, or ``optirs.register_plugin``'s).
    :param what: the check.
    :param options: backend options (as ``GpuOptimizerConfig(options=...)``).
    :param optimizers: check only these optimizer definitions (default: every one).
    :return: None when it passed; the reason when it does not apply to this backend (skipped).
    :raises AssertionError: naming the backend, the check, the optimizer and what differed.
    """
    if what not in CHECKS:
        raise AssertionError(f"check {what!r}, expected one of {list(CHECKS)}")
    kit = _open(name, options, optimizers)
    try:
        CHECKS[what](kit)
    except Skipped as exc:
        return str(exc)
    except AssertionError as exc:
        raise AssertionError(f"backend {name!r} fails the {what!r} check: {exc}") from exc.__cause__
    return None


def check_backend(name: str, *, options: Optional[Mapping[str, Any]] = None,
                  optimizers: Optional[Sequence[str]] = None, checks: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Run every conformance check (or those named in ``checks``) on the backend called ``name``.

    :return: check name -> ``"passed"`` or ``"skipped: <reason>"``.
    :raises AssertionError: at the first check the backend fails, naming the backend, the check,
        the optimizer and what differed.
    """
    results = {}
    for what in (CHECKS if checks is None else checks):
        reason = check(name, what, options=options, optimizers=optimizers)
        results[what] = "passed" if reason is None else f"skipped: {reason}"
    return results


__all__ = ["CHECKS", "MODEL_SHAPES", "OPTIONAL_CHECKS", "Skipped", "check", "check_backend"]
