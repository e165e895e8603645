"""Bad input: a clear error of optirs' own types, naming the value, and nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import optirs
from optirs.core import reference
from optirs.core.errors import GpuOptimError, InvalidParameterError, ShapeMismatchError

from conftest import FakeHostBackend


@pytest.mark.parametrize("cls,kwargs,pattern", [
    (optirs.AdamParams, {"beta1": 1.2}, r"beta1=1.2, expected 0 <= beta1 < 1"),
    (optirs.AdamParams, {"beta2": -0.1}, r"beta2=-0.1"),
    (optirs.AdamParams, {"lr": -1.0}, r"lr=-1.0, expected lr >= 0"),
    (optirs.AdamParams, {"eps": float("nan")}, r"eps=nan, expected a finite real number"),
    (optirs.AdamParams, {"amsgrad": 1}, r"amsgrad=1, expected True or False"),
    (optirs.SgdParams, {"nesterov": True}, r"nesterov=True with momentum=0.0"),
    (optirs.SgdParams, {"momentum": 0.9, "dampening": 0.1, "nesterov": True}, r"dampening=0.1"),
    (optirs.RmspropParams, {"alpha": 1.5}, r"alpha=1.5, expected 0 <= alpha <= 1"),
    (optirs.AdagradParams, {"initial_accumulator_value": -1}, r"initial_accumulator_value=-1"),
    (optirs.LambParams, {"max_trust_ratio": 0.0}, r"max_trust_ratio=0.0, expected max_trust_ratio > 0"),
    (optirs.LambParams, {"max_grad_norm": "1"}, r"max_grad_norm='1', expected a finite real number"),
])
def test_invalid_hyperparameters(cls, kwargs, pattern):
    with pytest.raises(InvalidParameterError, match=pattern):
        cls(**kwargs)


def test_errors_are_the_projects_types():
    assert issubclass(InvalidParameterError, ValueError) and issubclass(InvalidParameterError, GpuOptimError)
    assert issubclass(optirs.DeviceMemoryError, MemoryError)
    with pytest.raises(InvalidParameterError, match="expected AdamParams"):
        optirs.GpuAdam(optirs.SgdParams())
    with pytest.raises(InvalidParameterError, match="expected a GpuOptimizerConfig"):
        optirs.GpuAdam(config={"backend": "cpu"})
    with pytest.raises(InvalidParameterError, match="backend=''"):
        optirs.GpuOptimizerConfig(backend="")


def _started(backend, rng):
    """An Adam optimizer after two steps on a two-tensor model, and that model."""
    params = [rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(10).astype(np.float32)]
    opt = optirs.GpuAdam(optirs.AdamParams(amsgrad=True), optirs.GpuOptimizerConfig(backend=backend))
    for _ in range(2):
        opt.step_gpu(params, [np.ones_like(p) for p in params])
    return opt, params


def _bad_calls(params):
    p0, p1 = params
    g0, g1 = np.ones_like(p0), np.ones_like(p1)
    ro = p1.copy()
    ro.flags.writeable = False
    return [
        ((params, [g0]), ShapeMismatchError, r"2 params and 1 grads"),
        (([p0, p1], [g0, np.ones(11, np.float32)]), ShapeMismatchError, r"grads\[1\] has shape \(11,\), expected \(10,\)"),
        (([p0, p1], [g0, g1.astype(np.float64)]), ShapeMismatchError, r"grads\[1\] has dtype float64, expected float32"),
        (([p0, p1.astype(np.float64)], [g0, g1.astype(np.float64)]), ShapeMismatchError, r"params\[1\] has dtype float64"),
        (([p0, p1], [np.asfortranarray(np.ones((6, 4), np.float32)), g1]), ShapeMismatchError, r"grads\[0\] is not C-contiguous"),
        (([p0, ro], [g0, g1]), ShapeMismatchError, r"params\[1\] is read-only"),
        (([p0], [g0]), ShapeMismatchError, r"parameter list changed: got 1 tensors"),
        (([p0, p0.reshape(-1)[:10]], [g0, g1]), InvalidParameterError, r"params\[1\] is the same memory as params\[0\]"),
        (([p0, [1.0] * 10], [g0, g1]), InvalidParameterError, r"params\[1\] of type builtins.list, expected a numpy array"),
        (([], []), InvalidParameterError, r"params=\[\], expected at least one array"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_step_changes_nothing(backend, rng, case):
    opt, params = _started(backend, rng)
    before_params = [p.copy() for p in params]
    before_state = opt.state_dict()
    args, error, pattern = _bad_calls(params)[case]
    with pytest.raises(error, match=pattern):
        opt.step_gpu(*args)
    for p, b in zip(params, before_params):
        np.testing.assert_array_equal(p, b)
    after = opt.state_dict()
    assert after["step"] == before_state["step"] == 2
    for a, b in zip(after["state"], before_state["state"]):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])


def test_bad_state_dict_changes_nothing(rng):
    opt, params = _started("cpu", rng)
    good = opt.state_dict()
    bad_cases = [
        ({**good, "optimizer": "sgd"}, r"for optimizer 'sgd', expected 'adam'"),
        ({**good, "step": -3}, r"step=-3, expected an integer >= 0"),
        ({**good, "hyperparameters": {**good["hyperparameters"], "beta1": 2.0}}, r"beta1=2.0"),
        ({**good, "hyperparameters": {**good["hyperparameters"], "momentum": 0.9}}, r"unknown AdamParams fields \['momentum'\]"),
        ({**good, "hyperparameters": {**good["hyperparameters"], "amsgrad": False}}, r"state\[0\] has slots"),
        ({**good, "state": good["state"][:1]}, r"1 state entries for 2 tensors"),
        ({**good, "state": [good["state"][0], {**good["state"][1], "exp_avg": np.zeros(9)}]}, r"state\[1\]\['exp_avg'\] has shape \(9,\), expected \(10,\)"),
        ({k: v for k, v in good.items() if k != "shapes"}, r"state_dict keys"),
    ]
    for bad, pattern in bad_cases:
        with pytest.raises(GpuOptimError, match=pattern):
            opt.load_state_dict(bad)
        now = opt.state_dict()
        assert now["step"] == 2 and now["hyperparameters"] == good["hyperparameters"]
        np.testing.assert_array_equal(now["state"][1]["exp_avg"], good["state"][1]["exp_avg"])


def test_changing_hyperparameters_that_change_state_is_refused(rng):
    opt, _ = _started("cpu", rng)
    with pytest.raises(InvalidParameterError, match="state slots"):
        opt.params = optirs.AdamParams(amsgrad=False)
    assert opt.params.amsgrad


# ------------------------------------------------------------------ properties (hypothesis)

shapes = st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4)


def _three_steps_match_reference(cls, name, hp, shapes, seed):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    expected, _ = reference.run(name, params, grads, hp)
    opt = cls(hp, optirs.GpuOptimizerConfig(backend="cpu"))
    for g in grads:
        opt.step_gpu(params, g)
    for a, e in zip(params, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(e).max())))


@settings(max_examples=25, deadline=None)
@given(shapes=shapes, lr=st.floats(1e-4, 0.1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       wd=st.floats(0.0, 0.2), amsgrad=st.booleans(), seed=st.integers(0, 2**16))
def test_adam_any_shapes_and_hyperparameters(shapes, lr, beta1, beta2, wd, amsgrad, seed):
    hp = optirs.AdamParams(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, amsgrad=amsgrad)
    _three_steps_match_reference(optirs.GpuAdam, "adam", hp, shapes, seed)


@settings(max_examples=25, deadline=None)
@given(shapes=shapes, momentum=st.floats(0.0, 0.99), dampening=st.floats(0.0, 0.9), nesterov=st.booleans(),
       wd=st.floats(0.0, 0.2), seed=st.integers(0, 2**16))
def test_sgd_any_shapes_and_hyperparameters(shapes, momentum, dampening, nesterov, wd, seed):
    if nesterov and (momentum == 0 or dampening != 0):
        with pytest.raises(InvalidParameterError):
            optirs.SgdParams(momentum=momentum, dampening=dampening, nesterov=nesterov)
        return
    hp = optirs.SgdParams(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
    _three_steps_match_reference(optirs.GpuSgd, "sgd", hp, shapes, seed)


@settings(max_examples=40, deadline=None)
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.text(max_size=3)))
def test_beta1_accepts_exactly_the_unit_interval(value):
    valid = (isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) and 0 <= value < 1)
    if valid:
        assert optirs.AdamParams(beta1=value).beta1 == value
    else:
        with pytest.raises(InvalidParameterError, match="beta1="):
            optirs.AdamParams(beta1=value)


class _SwappableTensor:
    """Stands in for a torch CUDA tensor whose storage can be replaced (``tensor.data = ...``)."""

    def __init__(self, host: np.ndarray):
        self.host = host

    def data_ptr(self) -> int:
        return self.host.__array_interface__["data"][0]

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.host.shape, "typestr": self.host.dtype.str, "data": (self.data_ptr(), False),
                "strides": None, "version": 3}


def test_swapped_storage_is_validated_again(fresh_registry):
    """The same objects with new storage of another shape are checked again, not trusted from the last step."""
    from optirs.plugin.hookspecs import Staged, StepSupport, hookimpl

    class HostCai(FakeHostBackend):
        @hookimpl
        def optirs_stage(self, params, grads):
            return Staged([p.host.reshape(-1) for p in params], [g.host.reshape(-1) for g in grads])

        @hookimpl
        def optirs_step_support(self):
            return StepSupport(optimizers=("sgd",))

        @hookimpl
        def optirs_step(self, request):
            for p, g in zip(request.params, request.grads):
                p -= request.scalars.lr * g

    optirs.register_plugin(HostCai(), "hostcai")
    p, g = _SwappableTensor(np.ones(4, np.float32)), _SwappableTensor(np.ones(4, np.float32))
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.5), optirs.GpuOptimizerConfig(backend="hostcai"))
    opt.step_gpu([p], [g])
    np.testing.assert_array_equal(p.host, 0.5)
    p.host, g.host = np.ones(5, np.float32), np.ones(5, np.float32)
    with pytest.raises(ShapeMismatchError, match="parameter list changed"):
        opt.step_gpu([p], [g])
    np.testing.assert_array_equal(p.host, 1.0)
