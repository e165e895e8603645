"""The per-optimizer step hooks of earlier releases (``optirs_step_<name>``): the registry adapts
them to ``optirs_step`` for one more release (float32 only, found_inf read on the host) and says
so with a PluginDeprecationWarning naming them."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import PluginError, UnsupportedOperationError
from optirs.core.formats import StepFormat
from optirs.core.layout import TensorLayout
from optirs.plugin.hookspecs import DeviceStepInputs, Staged, StepControls, StepRequest, hookimpl
from optirs.plugin.registry import PluginDeprecationWarning
from optirs.testing import check_backend

from conftest import FakeHostBackend

SHAPES = [(6, 4), (10,)]


class Flag:
    """This backend's own kind of device array, for a found_inf flag: only its optirs_to_host reads it."""

    def __init__(self, value):
        self.value = value


class LegacyBackend(FakeHostBackend):
    """A plugin of an earlier release: SGD and Lion through their own step hooks, nothing else."""

    def __init__(self, fail=None):
        super().__init__()
        self.calls, self.fail = [], fail

    @hookimpl
    def optirs_stage(self, params, grads):
        return Staged([p.reshape(-1) for p in params], [g.reshape(-1) for g in grads])

    @hookimpl
    def optirs_to_host(self, array):
        return np.array([array.value], np.int32) if isinstance(array, Flag) else np.array(array)

    @hookimpl
    def optirs_step_sgd(self, params, grads, state, layout, scalars):
        self.calls.append("sgd")
        if self.fail is not None:
            raise self.fail
        for p, g, o, n in zip(params, grads, layout.offsets, layout.sizes):
            g = g * scalars.grad_factor
            if scalars.weight_decay != 0:
                g = g + scalars.weight_decay * p
            if scalars.has_momentum:
                buf = state["momentum_buffer"][o : o + n]
                buf[...] = g if scalars.first_step else scalars.momentum * buf + scalars.dampening_factor * g
                g = g + scalars.momentum * buf if scalars.nesterov else buf
            p -= scalars.lr * g

    @hookimpl
    def optirs_step_lion(self, params, grads, state, layout, scalars):
        self.calls.append("lion")
        for p, g, o, n in zip(params, grads, layout.offsets, layout.sizes):
            g, m = g * scalars.grad_factor, state["exp_avg"][o : o + n]
            p *= scalars.decay_factor
            p -= scalars.lr * np.sign(scalars.beta1 * m + scalars.one_minus_beta1 * g)
            m[...] = scalars.beta2 * m + scalars.one_minus_beta2 * g


@pytest.fixture
def legacy(fresh_registry):
    plugin = LegacyBackend()
    optirs.register_plugin(plugin, "legacy")
    return plugin


def _model(seed=0, steps=3):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return params, [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]


def test_legacy_hooks_step_float32_with_a_deprecation_warning(legacy):
    with pytest.warns(PluginDeprecationWarning, match=r"plugin 'legacy' implements the per-optimizer step hooks "
                      r"\['optirs_step_lion', 'optirs_step_sgd'\].*implement optirs_step and optirs_step_support"):
        backend = optirs.get_backend("legacy")
    status = {s.name: s for s in optirs.list_backends()}["legacy"]
    assert status.optimizers == ("sgd", "lion") and status.capabilities == ()
    assert backend.step_hook("sgd") == "optirs_step_sgd"
    cases = [("sgd", optirs.SgdParams(lr=0.1, momentum=0.9, nesterov=True)), ("lion", optirs.LionParams(lr=0.01))]
    for name, hp in cases:
        params, grads = _model()
        expected, _ = reference.run(name, params, [[-g for g in gs] for gs in grads], hp)  # maximize
        opt = optirs.OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend="legacy"))
        for g in grads:
            assert opt.step_gpu(params, g, grad_factor=-1.0)
        for a, e in zip(params, expected):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    assert legacy.calls == ["sgd"] * 3 + ["lion"] * 3


def test_legacy_backend_passes_the_conformance_kit(legacy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginDeprecationWarning)
        report = check_backend("legacy")
    assert report["formats"].startswith("skipped: ") and report["device_scalars"].startswith("skipped: ")
    assert {k: v for k, v in report.items() if k not in ("formats", "device_scalars")} == dict.fromkeys(
        ["steps", "grad_factor", "found_inf", "unsupported_optimizer", "failed_step", "resume"], "passed")


def _request(backend, name, params, *, fmt=None, found_inf=None, check_finite=False, device=None, step=1):
    """One optirs_step request through the bound (adapted) step, as the engine makes it."""
    definition = DEFINITIONS[name]
    layout = TensorLayout([p.shape for p in params])
    hp = definition.default_params()
    state = {k: np.full(layout.total, v, np.float32) for k, v in definition.state_slots(hp).items()}
    grads = [np.ones_like(p) for p in params]
    staged = backend.stage(backend.ctx, params, grads, fmt)
    backend.step(backend.ctx, StepRequest(definition, staged.params, staged.grads, state, layout,
                                          definition.scalars(hp, step), StepControls(step, 0, found_inf, check_finite,
                                                                                     device), fmt, None))
    return state


def test_legacy_hooks_refuse_formats_and_device_scalars(legacy):
    with pytest.warns(PluginDeprecationWarning):
        backend = optirs.get_backend("legacy")
    params, grads = _model(1, 1)
    half = [p.astype(ml_dtypes.bfloat16) for p in params]
    before = [h.copy() for h in half]
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend="legacy"))
    with pytest.raises(UnsupportedOperationError, match=r"backend 'legacy' runs no step formats for 'sgd'"):
        opt.step_gpu(half, [g.astype(ml_dtypes.bfloat16) for g in grads[0]])
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(half, before))
    assert opt.step_count == 0
    device = DeviceStepInputs(steps=np.zeros(2, np.float32), record=np.zeros(9, np.float32), constants=(), lr=0.1)
    for kwargs, what in [({"fmt": StepFormat("bfloat16", "bfloat16")}, "step formats"),
                         ({"device": device}, "device-side scalars"), ({"check_finite": True}, "check_finite")]:
        p = [a.copy() for a in (half if "fmt" in kwargs else params)]
        with pytest.raises(UnsupportedOperationError, match=rf"backend 'legacy' does not run {what} for 'sgd'; it "
                           r"steps \['sgd', 'lion'\] in float32 through the per-optimizer hooks"):
            _request(backend, "sgd", p, **kwargs)
    with pytest.raises(UnsupportedOperationError,
                       match=r"backend 'legacy' does not run the 'adam' step; it steps \['sgd', 'lion'\]"):
        _request(backend, "adam", [p.copy() for p in params])
    assert legacy.calls == []


def test_legacy_errors_name_the_hook(fresh_registry):
    error = RuntimeError("kernel exploded")
    optirs.register_plugin(LegacyBackend(fail=error), "legacy")
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend="legacy"))
    p = np.ones(4, np.float32)
    with pytest.warns(PluginDeprecationWarning), pytest.raises(
            PluginError, match=r"plugin 'legacy' raised RuntimeError in optirs_step_sgd: kernel exploded"):
        opt.step_gpu(p, np.ones(4, np.float32))
    assert opt.step_count == 0 and np.array_equal(p, np.ones(4, np.float32))


@pytest.mark.parametrize("flag", [np.ones(1, np.int32), Flag(1)], ids=["numpy", "device"])
def test_legacy_host_found_inf_is_honoured(legacy, flag):
    """A set flag, a numpy array or one of the backend's own read back with optirs_to_host, skips the hook."""
    with pytest.warns(PluginDeprecationWarning):
        backend = optirs.get_backend("legacy")
    params, _ = _model(2, 0)
    before = [p.copy() for p in params]
    _request(backend, "sgd", params, found_inf=flag)
    assert legacy.calls == [] and all(np.array_equal(a, b) for a, b in zip(params, before))
    cleared = np.zeros(1, np.int32) if isinstance(flag, np.ndarray) else Flag(0)
    _request(backend, "sgd", params, found_inf=cleared)
    assert legacy.calls == ["sgd"]
    for p, b in zip(params, before):  # the default SgdParams, gradient 1
        np.testing.assert_array_equal(p, b - np.float32(optirs.SgdParams().lr))
