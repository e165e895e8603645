"""A property-based fuzz of the public API (keep the promise under bad input).

Random models (shapes, 0-d, empty), arrays (dtypes, non-contiguous views, Fortran order,
read-only, wrong kinds), hyperparameters (out of range, inf, nan, huge ints, wrong types) and
state_dict edits (dropped and renamed keys, wrong dtypes and shapes, None), one optimizer at a
time, on the cpu backend (and opencl with fewer examples). The invariants:

* every exception is a ``GpuOptimError`` (optirs' own error types);
* after any exception the parameters (every array the call was given) and the state
  (``state_dict()``) are bit-identical to before the call.

derandomize=True keeps CI stable: the same examples every run.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from dataclasses import fields
from typing import Any, Dict, List

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings, strategies as st  # noqa: E402

import optirs  # noqa: E402
from optirs.core.errors import GpuOptimError  # noqa: E402
from optirs.core.simulator import cuda_simulator_enabled  # noqa: E402
from optirs.optim.optimizers import OPTIMIZERS, GpuOptimizerConfig  # noqa: E402

NAMES = sorted(OPTIMIZERS)
# Checks of cases fixed elsewhere; set True once they hold.
# Overlapping parameters are rejected (the memory-identity check), and a parameter made read-only
# after a step is rejected on the repeat call (the validation cache re-checks it): both fuzzed.
OVERLAP_CHECKED = True
READONLY_RECHECKED = True
EXAMPLES = {"cpu": 250, "opencl": 40, "cuda": 20}
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# ---------------------------------------------------------------- comparing before and after


def _snapshot_state(opt) -> Dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    """Bit-identical: arrays by dtype, shape and bytes (NaN payloads included), the rest by ==."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _array_bytes(arrays: List[Any]) -> List[Any]:
    out = []
    for a in arrays:
        if isinstance(a, np.ndarray):
            out.append((a.dtype, a.shape, a.tobytes()))
        elif hasattr(a, "get"):  # pyopencl.array.Array
            out.append(("opencl", a.get().tobytes()))
        else:
            out.append(("object", repr(a)))
    return out


def _call(opt, fn, arrays: List[Any], label: str = "call"):
    """Run ``fn``; on an exception check the invariants and return it (None on success)."""
    state, before = _snapshot_state(opt), _array_bytes(arrays)
    step = opt.step_count
    try:
        fn()
    except GpuOptimError as exc:
        assert opt.step_count == step, f"{exc!r} changed the step count"
        assert _same(_snapshot_state(opt), state), f"{exc!r} changed the state"
        assert _array_bytes(arrays) == before, f"{exc!r} changed an array it was given"
        event(f"{label}: {type(exc).__name__}")
        return exc
    # Anything else escapes: pytest reports it as not a GpuOptimError.
    event(f"{label}: ok")
    return None


# ---------------------------------------------------------------- strategies: hyperparameters


def _float_values():
    return st.one_of(
        st.floats(min_value=0.0, max_value=1.0),  # mostly in range
        st.floats(allow_nan=True, allow_infinity=True),  # anything, inf and nan included
        st.sampled_from([0.0, -0.0, -1.0, 1.0, 1e-45, 1e38, 3.5e38, 1e300, -1e300, math.inf, -math.inf, math.nan]),
        st.integers(min_value=-3, max_value=3),
    )


WRONG_TYPES = ["0.1", b"1", None, [0.1], (0.1,), {}, 1j, Fraction(1, 3), object(), np.float32(0.5),
               np.float64(0.5), np.int64(1), np.array(0.5), np.array([0.5]), np.bool_(True), True, False]


def _wrong_type_values(zero_d: bool = True):
    return st.sampled_from([v for v in WRONG_TYPES if zero_d or not (isinstance(v, np.ndarray) and v.ndim == 0)])


def _huge_ints():
    # Python ints beyond int64 (they still convert to a finite float64).
    # fixed by the validation work (hyperparameter float32 range): ints beyond float64 (10**400)
    # make math.isfinite raise OverflowError in params._real; re-enable: add 10**400, -(10**400).
    return st.sampled_from([2**63, 2**64 + 1, -(2**70), 10**400, -(10**400)])


def _hp_value(field_default: Any):
    if isinstance(field_default, bool):
        return st.one_of(st.booleans(), _wrong_type_values(), st.integers(-1, 2))
    if isinstance(field_default, tuple):  # Adafactor's eps pair
        # fixed by the validation work (hyperparameters): a 0-d array as Adafactor's eps has
        # __len__ but len() raises TypeError in AdafactorParams; re-enable: zero_d=True.
        return st.one_of(st.tuples(st.one_of(st.none(), _float_values()), _float_values()),
                         st.lists(_float_values(), max_size=3), _wrong_type_values(zero_d=True))
    return st.one_of(_float_values(), _huge_ints(), _wrong_type_values())


@st.composite
def hyperparameters(draw, definition, fuzz: bool = True):
    """A keyword dict for ``definition.params_type``: an example, with some fields fuzzed."""
    base = dict(draw(st.sampled_from(definition.examples or (definition.default_params(),))).to_dict())
    if not fuzz:
        return base
    for f in fields(definition.params_type):
        if draw(st.integers(0, 3)) == 0:
            base[f.name] = draw(_hp_value(base[f.name] if base[f.name] is not None else 1.0))
    if draw(st.integers(0, 10)) == 0:  # unknown names: from_dict (the dict path) must reject them
        base[draw(st.sampled_from(["bogus", "learning_rate", ""]))] = 0.1
    return base


# ---------------------------------------------------------------- strategies: arrays


SHAPES = st.one_of(
    st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    st.sampled_from([(), (0,), (3, 0), (1,), (7,), (2, 3)]),
)


def _model_shapes():
    return st.lists(SHAPES, min_size=1, max_size=3)


def _values(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


WRONG_DTYPES = [np.float64, np.float16, np.int32, np.int64, np.bool_, np.complex64, np.uint8]


@st.composite
def bad_array(draw, rng: np.random.Generator, shape) -> Any:
    """An array (or not) that a step should reject or take, built around ``shape``."""
    how = draw(st.sampled_from(BAD_ARRAYS))
    return how, _bad_array(draw, how, rng, shape)


BAD_ARRAYS = ["dtype", "bfloat16", "strided", "fortran", "readonly", "reshaped", "zero_d", "empty", "list",
              "none", "scalar", "object", "structured", "big_endian", "subclass", "matrix", "masked", "good"]
# fixed by the validation work (array subclasses): a numpy.ma.MaskedArray reaches the cpu kernel
# and numba raises NumbaTypeError; re-enable: add "masked" to BAD_ARRAYS.
# Replacing one array of a (params, grads) pair by one of these must raise, whichever side it is on.
ALWAYS_REJECTED = {"dtype", "reshaped", "list", "none", "scalar", "object",
                   "structured", "big_endian"}


class _Subclass(np.ndarray):
    """A plain ndarray subclass (like a framework's tensor-as-ndarray)."""


def _bad_array(draw, how: str, rng: np.random.Generator, shape) -> Any:
    if how == "dtype":
        return _values(rng, shape, draw(st.sampled_from(WRONG_DTYPES)))
    if how == "bfloat16":
        import ml_dtypes

        return _values(rng, shape).astype(ml_dtypes.bfloat16)
    if how == "strided":
        base = _values(rng, tuple(shape) + (2,)) if shape else _values(rng, (2,))
        return base[..., 0] if shape else base[::2]
    if how == "fortran":
        return np.asfortranarray(_values(rng, tuple(shape) + (2,)))
    if how == "readonly":
        a = _values(rng, shape)
        a.setflags(write=False)
        return a
    if how == "reshaped":
        return _values(rng, (int(np.prod(shape)) + 1,))
    if how == "zero_d":
        return np.float32(1.5) if draw(st.booleans()) else np.array(1.5, np.float32)
    if how == "empty":
        return np.zeros((0,), np.float32)
    if how == "list":
        return _values(rng, shape).tolist()
    if how == "none":
        return None
    if how == "scalar":
        return 1.0
    if how == "object":
        return np.empty(shape, dtype=object)
    if how == "structured":
        return np.zeros(shape, dtype=[("x", np.float32)])
    if how == "big_endian":
        return _values(rng, shape).astype(">f4")
    if how == "subclass":
        return _values(rng, shape).view(_Subclass)
    if how == "masked":
        a = _values(rng, shape)
        return np.ma.masked_array(a, mask=np.zeros(a.shape, bool))
    if how == "matrix":
        return np.asmatrix(_values(rng, (1, int(np.prod(shape)))))
    return _values(rng, shape)


def _must_raise(how: str, side: str, bad: Any, shape, n_arrays: int, holds_state: bool,
                held_dtype: Any = None) -> bool:
    if how == "bfloat16" or (how == "dtype" and bad.dtype == np.float16):
        # 16-bit parameters are a step format of their own (docs/formats.md): accepted only when
        # every parameter has that dtype (a one-array model here) and the state held, if any, is of
        # that format (``held_dtype``: its parameters' dtype); 16-bit gradients of float32
        # parameters are always refused.
        return side == "grads" or n_arrays > 1 or (holds_state and held_dtype != bad.dtype.name)
    if how in ("strided", "fortran"):  # a view numpy still calls C-contiguous (size-1 axes) is fine
        return not bad.flags.c_contiguous or bad.shape != tuple(shape)
    if how in ALWAYS_REJECTED or (how == "readonly" and side == "params"):
        return True
    if how in ("zero_d", "empty", "matrix"):
        return not isinstance(bad, np.ndarray) or bad.shape != tuple(shape)
    return False


# ---------------------------------------------------------------- strategies: state_dict edits


def _edit_state_dict(draw, sd: Dict[str, Any]):
    """(the edit's name, the edited copy of ``sd``)."""
    what = draw(st.sampled_from(EDITS))
    return what, _edit(draw, what, copy.deepcopy(sd))


EDITS = ["drop", "rename", "none_value", "step", "optimizer", "hyper", "entry_drop_slot", "entry_rename_slot",
         "entry_wrong_shape", "entry_wrong_dtype", "entry_none", "entries_len", "shapes", "extra_key",
         "not_a_mapping"]


def _edit(draw, what: str, sd: Dict[str, Any]) -> Any:
    keys = sorted(sd)
    if what == "drop":
        del sd[draw(st.sampled_from(keys))]
    elif what == "rename":
        k = draw(st.sampled_from(keys))
        sd[k + "_x"] = sd.pop(k)
    elif what == "none_value":
        # fixed by the validation work: load_state_dict fields (None shapes/state/hyperparameters
        # raise TypeError today); restricted to the fields it already checks.
        sd[draw(st.sampled_from(["step", "optimizer", "shapes", "state", "hyperparameters"]))] = None
    elif what == "step":
        sd["step"] = draw(st.sampled_from([-1, 1.5, "3", True, np.float32(2.0), 2**70, None]))
    elif what == "optimizer":
        sd["optimizer"] = draw(st.sampled_from(["nope", "", None, 3] + NAMES))
    elif what == "hyper":
        hp = dict(sd["hyperparameters"])
        k = draw(st.sampled_from(sorted(hp)))
        hp[k] = draw(_hp_value(hp[k] if hp[k] is not None else 1.0))
        sd["hyperparameters"] = hp
    elif what == "entries_len":
        if sd["state"]:
            sd["state"] = sd["state"][:-1]
        else:
            sd["state"] = [{}]
    elif what == "shapes":
        sd["shapes"] = [list(s) + [2] for s in sd["shapes"]] or [[3]]
    elif what == "extra_key":
        sd["extra"] = 1
    elif what == "not_a_mapping":
        return draw(st.sampled_from([None, [], "state", 3]))
    elif sd["state"]:
        i = draw(st.integers(0, len(sd["state"]) - 1))
        entry = sd["state"][i]
        if not entry:
            sd["state"][i] = {"bogus": np.zeros(1, np.float32)}
            return sd
        k = draw(st.sampled_from(sorted(entry)))
        if what == "entry_drop_slot":
            del entry[k]
        elif what == "entry_rename_slot":
            entry[k + "_x"] = entry.pop(k)
        elif what == "entry_wrong_shape":
            entry[k] = np.zeros(np.shape(entry[k]) + (2,), np.float32)
        elif what == "entry_wrong_dtype":
            # float64 and int values of the right shape are cast to float32 (not an error); other
            # dtypes: fixed by the validation work (load_state_dict fields: complex values raise
            # numpy's ComplexWarning/TypeError, strings ValueError today), restricted to these.
            entry[k] = np.asarray(entry[k]).astype(draw(st.sampled_from([np.float64, np.float16, np.int64,
                                                                          np.complex64, np.str_])))
        elif what == "entry_none":
            entry[k] = None
    return sd


# ---------------------------------------------------------------- the scenario


def _scenario(data, backend: str) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    name = data.draw(st.sampled_from(NAMES), label="optimizer")
    cls = OPTIMIZERS[name]
    definition = cls.definition
    params_type = cls.params_type
    hp = params_type(**data.draw(hyperparameters(definition, fuzz=False)))
    opt = cls(hp, GpuOptimizerConfig(backend=backend))
    shapes = data.draw(_model_shapes(), label="shapes")
    params = [_values(rng, s) for s in shapes]
    grads = [_values(rng, s) for s in shapes]
    if data.draw(st.booleans(), label="first step"):
        opt.step_gpu(params, grads)

    for _ in range(data.draw(st.integers(1, 6), label="operations")):
        op = data.draw(st.sampled_from(["bad_step", "bad_step", "bad_list", "good_step", "hyperparameters",
                                        "set_params", "load", "load", "load_roundtrip", "move", "overlap",
                                        "readonly_after_step"]), label="op")
        if op == "bad_step":
            # One array of the model replaced by a fuzzed one (params or grads side).
            i = data.draw(st.integers(0, len(shapes) - 1))
            side = data.draw(st.sampled_from(["params", "grads"]))
            how, bad = data.draw(bad_array(rng, shapes[i]))
            p = list(params)
            g = [x.copy() for x in grads]
            (p if side == "params" else g)[i] = bad
            held = opt.state_dict()
            holds_state = bool(held["state"])
            held_dtype = held["format"]["param_dtype"] if "format" in held else "float32"
            exc = _call(opt, lambda: opt.step_gpu(p, g), p + g, f"bad_step {how}")
            if _must_raise(how, side, bad, shapes[i], len(shapes), holds_state, held_dtype):
                assert exc is not None, f"{side}[{i}] = {how} array {bad!r} was accepted"
        elif op == "bad_list":
            choice = data.draw(st.sampled_from(["short", "empty", "swap", "other_model", "same_twice", "tuple_mix"]))
            rejected = (choice == "short" and len(params) > 1) or choice == "empty" or (
                choice == "same_twice" and params[0].size > 0)
            if choice == "short" and len(params) > 1:
                p, g = params[:-1], grads
            elif choice == "empty":
                p, g = [], []
            elif choice == "swap" and len(params) > 1:
                p, g = params[::-1], grads[::-1]
            elif choice == "other_model":
                other = data.draw(_model_shapes())
                p, g = [_values(rng, s) for s in other], [_values(rng, s) for s in other]
            elif choice == "same_twice" and params[0].size:
                p, g = [params[0]] + params, [grads[0]] + grads
            else:
                p, g = tuple(params), list(grads)
            exc = _call(opt, lambda: opt.step_gpu(p, g), list(p) + list(g), f"bad_list {choice}")
            if rejected:
                assert exc is not None, f"{choice}: params {p!r} were accepted"
        elif op == "overlap":
            # The model's shapes as views of one buffer, each overlapping the next by one element.
            sizes = [int(np.prod(s)) for s in shapes]
            if len(sizes) < 2 or not all(sizes):
                continue
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) - np.arange(len(sizes))
            buffer = _values(rng, (int(starts[-1]) + sizes[-1],))
            p = [buffer[o:o + n].reshape(s) for o, n, s in zip(starts, sizes, shapes)]
            g = [_values(rng, s) for s in shapes]
            exc = _call(opt, lambda: opt.step_gpu(p, g), [buffer] + g, "overlap")
            # fixed by the validation work (overlap): only views starting at the same address are
            # caught today; re-enable the check below after merging.
            if OVERLAP_CHECKED:
                assert exc is not None, "overlapping params were accepted"
        elif op == "readonly_after_step":
            # A parameter made read-only after it passed validation in an earlier step.
            if not opt.step_count or not READONLY_RECHECKED:
                continue
            i = data.draw(st.integers(0, len(shapes) - 1))
            params[i].setflags(write=False)
            try:
                exc = _call(opt, lambda: opt.step_gpu(params, grads), params + grads, "readonly_after_step")
            finally:
                params[i].setflags(write=True)
            if READONLY_RECHECKED:
                assert exc is not None, f"params[{i}] was read-only and accepted"
        elif op == "good_step":
            grads = [_values(rng, s) for s in shapes]
            _call(opt, lambda: opt.step_gpu(params, grads), params + grads, "good_step")
        elif op == "hyperparameters":
            kwargs = data.draw(hyperparameters(definition))
            try:
                params_type.from_dict(kwargs)
            except GpuOptimError:
                pass
        elif op == "set_params":
            kwargs = data.draw(hyperparameters(definition))
            try:
                new = params_type.from_dict(kwargs)
            except GpuOptimError:
                continue

            def assign(new=new):
                opt.params = new

            _call(opt, assign, params, "set_params")
        elif op == "load":
            edit, sd = _edit_state_dict(data.draw, opt.state_dict())
            _call(opt, lambda: opt.load_state_dict(sd), params, f"load {edit}")
        elif op == "load_roundtrip":
            sd = opt.state_dict()
            assert _call(opt, lambda: opt.load_state_dict(sd), params, "load_roundtrip") is None
            assert _same(opt.state_dict(), sd)
        elif op == "move":
            (opt.move_to_cpu if data.draw(st.booleans()) else opt.move_to_gpu)()


def _available(backend: str) -> None:
    status = {s.name: s for s in optirs.list_backends()}.get(backend)
    if status is None or not status.available:
        pytest.skip(f"backend {backend} cannot open here: {status.reason if status else 'not installed'}")


def test_fuzz_public_api(backend):
    """``backend``: conftest's fixture (cpu, opencl, cuda: few examples under the simulator)."""
    _available(backend)
    examples = EXAMPLES.get(backend, 4)
    if backend == "cuda" and cuda_simulator_enabled():
        examples = 3

    @settings(max_examples=examples, **FUZZ)
    @given(st.data())
    def run(data):
        _scenario(data, backend)

    run()


@settings(max_examples=300, **FUZZ)
@given(st.data())
def test_fuzz_hyperparameters_raise_only_optirs_errors(data):
    """Constructing any hyperparameter record either works or raises a GpuOptimError."""
    definition = OPTIMIZERS[data.draw(st.sampled_from(NAMES))].definition
    kwargs = data.draw(hyperparameters(definition))
    try:
        definition.params_type.from_dict(kwargs)
    except GpuOptimError:
        pass


@settings(max_examples=100, **FUZZ)
@given(backend=st.one_of(st.sampled_from(["auto", "cpu", "nope", "", "CPU", "occupancy"]), st.text(max_size=5),
                         st.none(), st.integers(), st.just(["cpu"])),
       device=st.one_of(st.none(), st.integers(-2, 2), st.text(max_size=3)))
def test_fuzz_config_raises_only_optirs_errors(backend, device):
    """A config and an optimizer made from it either work or raise a GpuOptimError (no probing needed)."""
    try:
        optirs.GpuAdam(config=GpuOptimizerConfig(backend=backend, device=device))
    except GpuOptimError:
        pass
