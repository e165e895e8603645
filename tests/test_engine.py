"""The step engine under the seed API: copies, the transaction over several engines, plugin errors.

Every case compares against an independent run (a twin optimizer fed the same arrays, itself
checked against optirs/core/reference.py elsewhere) and checks that a refused or failed call
changes nothing.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.errors import InvalidParameterError, PluginError, UnsupportedOperationError
from optirs.optim.engine import run_steps
from optirs.plugin.hookspecs import Staged, StepSupport, hookimpl

from conftest import FakeHostBackend, from_backend_array, to_backend_array

SHAPES = [(3, 4), (5,)]


def _arrays(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in SHAPES]


def _opt(backend, **hp):
    return optirs.GpuAdamW(optirs.AdamParams(lr=0.01, **hp), optirs.GpuOptimizerConfig(backend=backend))


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_on_like_the_original(backend, how):
    """deepcopy / pickle of a trained optimizer: the copy holds the same state and step count and
    its next steps equal the original's (torch's optimizers copy that way)."""
    opt, params = _opt(backend, amsgrad=True), _arrays(1)
    for k in range(2):
        opt.step_gpu(params, _arrays(10 + k))
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert twin.step_count == 2 and twin.engine is not opt.engine
    twin_params = [p.copy() for p in params]
    for k in range(2, 4):
        opt.step_gpu(params, _arrays(10 + k))
        twin.step_gpu(twin_params, _arrays(10 + k))
    _same(params, twin_params)
    assert twin.step_count == opt.step_count == 4
    for a, b in zip(opt.state_dict()["state"], twin.state_dict()["state"]):
        _same([a[k] for k in sorted(a)], [b[k] for k in sorted(b)])


def test_a_fresh_optimizer_copies_without_opening_its_backend():
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend="cpu"))
    twin = pickle.loads(pickle.dumps(opt))
    assert twin.step_count == 0 and twin.params == opt.params


def test_one_transaction_over_two_engines_counts_both(backend):
    """run_steps launches several engines' steps together (optirs.torch's param groups): each is
    counted once, and the results equal two separate steps."""
    a, b = _opt(backend), _opt(backend, weight_decay=0.3)
    pa, pb, ga, gb = _arrays(2), _arrays(3), _arrays(4), _arrays(5)
    da, db = [to_backend_array(backend, p) for p in pa], [to_backend_array(backend, p) for p in pb]
    steps = []
    for opt, p, g in ((a, da, ga), (b, db, gb)):
        _, shapes, fmt = opt.check_arrays(p, [to_backend_array(backend, x) for x in g])
        steps.append(opt.engine.prepare(p, [to_backend_array(backend, x) for x in g], shapes=shapes, hp=opt.params,
                                        fmt=fmt))
    run_steps(steps)
    assert a.step_count == b.step_count == 1
    for opt, p, g, got in ((a, pa, ga, da), (b, pb, gb, db)):
        expected, _ = reference.run("adamw", p, [g], opt.params)
        for x, e in zip(got, expected):
            np.testing.assert_allclose(from_backend_array(x).reshape(e.shape), e, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ plugins that misbehave


class _Misbehaving(FakeHostBackend):
    """A host backend with the one step hook (SGD) that misbehaves where it is told to."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    @hookimpl
    def optirs_open(self, options):
        if self.where == "open":
            raise KeyError("device")
        return object()

    @hookimpl
    def optirs_stage(self, params, grads):
        if self.where == "stage":
            return None  # not a Staged
        return Staged(params, grads)

    @hookimpl
    def optirs_step_support(self):
        if self.where == "support":
            raise AttributeError("no table")
        if self.where == "state_dtypes":
            return StepSupport(optimizers=("sgd",), state_dtypes=("float32", "int4"))
        if self.where == "formats":  # formats in the state dtypes of a backend written before int8_sqrt
            return StepSupport(optimizers=("sgd",), formats=("sgd",))
        return StepSupport(optimizers=("sgd",))

    @hookimpl
    def optirs_step(self, ctx, request):
        if self.where == "step":
            raise AttributeError("kernel")
        for p, g in zip(request.params, request.grads):
            p -= request.scalars.lr * request.scalars.grad_factor * g


@pytest.mark.parametrize("where,hook", [("open", "optirs_open"), ("stage", "optirs_stage"), ("step", "optirs_step")])
def test_a_misbehaving_plugin_is_a_plugin_error_naming_it_and_the_hook(fresh_registry, where, hook):
    optirs.register_plugin(_Misbehaving(where), "wobbly")
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.5), optirs.GpuOptimizerConfig(backend="wobbly"))
    p = np.ones(4, np.float32)
    with pytest.raises(PluginError, match=f"'wobbly'.*{hook}") as info:
        opt.step_gpu(p, np.ones(4, np.float32))
    assert isinstance(info.value.__cause__, (KeyError, AttributeError))
    np.testing.assert_array_equal(p, np.ones(4, np.float32))
    assert opt.step_count == 0


def test_a_broken_step_support_steps_nothing_and_says_so(fresh_registry):
    optirs.register_plugin(_Misbehaving("support"), "wobbly")
    with pytest.warns(optirs.plugin.registry.PluginWarning, match="optirs_step_support"):
        backend = optirs.get_backend("wobbly")
    assert backend.optimizers == ()
    with pytest.raises(UnsupportedOperationError, match="'wobbly' does not run the 'sgd' step"):
        optirs.GpuSgd(optirs.SgdParams(lr=0.5), optirs.GpuOptimizerConfig(backend="wobbly")).step_gpu(
            np.ones(2, np.float32), np.ones(2, np.float32))


def test_step_support_naming_an_unknown_state_dtype_steps_nothing(fresh_registry):
    optirs.register_plugin(_Misbehaving("state_dtypes"), "wobbly")
    with pytest.warns(optirs.plugin.registry.PluginWarning, match=r"state_dtypes=\('float32', 'int4'\)"):
        backend = optirs.get_backend("wobbly")
    assert backend.optimizers == ()


def test_every_builtin_backend_stores_the_square_root_codes(backend):
    from optirs.core import formats as F

    b = optirs.get_backend(backend)
    assert "int8_sqrt" in b.support.state_dtypes
    assert b.steps("adamw", F.StepFormat("float32", "float32", None, "int8_sqrt", False))


def test_a_state_dtype_the_backend_does_not_store_is_refused_before_any_write(fresh_registry):
    """A backend written before the square-root codes (StepSupport's default state_dtypes) is refused
    them at the engine, naming the dtype and those it stores, before any buffer is made; it still
    steps the dynamic map's int8 state."""
    from optirs.core import formats as F
    from optirs.core.definitions import DEFINITIONS
    from optirs.optim.engine import StepEngine

    optirs.register_plugin(_Misbehaving("formats"), "wobbly")
    b = optirs.get_backend("wobbly")
    engine = StepEngine(DEFINITIONS["sgd"], b)
    fmt = F.StepFormat("float32", "float32", None, "int8_sqrt", False)
    p, g = [np.ones(5000, np.float32)], [np.ones(5000, np.float32)]
    assert not b.steps("sgd", fmt) and b.steps("sgd", F.StepFormat("float32", "float32", None, "int8", False))
    with pytest.raises(UnsupportedOperationError, match=r"state_dtype='int8_sqrt'.*\['float32', 'bfloat16', 'int8'\]"):
        engine.prepare(p, g, shapes=[(5000,)], hp=optirs.SgdParams(lr=0.1, momentum=0.9), fmt=fmt)
    assert engine.state is None


def test_found_inf_that_is_not_a_flag_is_refused(backend):
    opt, p = _opt(backend), _arrays(6)
    before = [x.copy() for x in p]
    for bad in ("yes", np.zeros(2, np.float32)):
        with pytest.raises(InvalidParameterError, match="found_inf"):
            opt.step_gpu(p, _arrays(7), found_inf=bad)
    _same(p, before)
    assert opt.step_count == 0


def test_prepare_again_steps_like_prepare_until_the_engine_changes():
    """A step made by prepare_again from the last one equals a step prepare makes (the same bits
    over three steps), and once the state moved (to_host) it declines so that prepare runs again."""
    from optirs.core.definitions import DEFINITIONS
    from optirs.optim.engine import StepEngine

    backend = optirs.get_backend("cpu")
    definition, hp = DEFINITIONS["adamw"], optirs.AdamParams(lr=0.01, weight_decay=0.1)
    shapes = [tuple(s) for s in SHAPES]
    ours, twin = StepEngine(definition, backend), StepEngine(definition, backend)
    p_ours, p_twin = _arrays(1), _arrays(1)
    last = None
    for k in range(3):
        grads = _arrays(20 + k)
        again = ours.prepare_again(last, p_ours, grads, hp) if last is not None else None
        assert (again is None) == (k == 0)
        last = again or ours.prepare(p_ours, grads, shapes=shapes, hp=hp)
        run_steps([last])
        twin.step(p_twin, [g.copy() for g in grads], shapes=shapes, hp=hp)
    _same(p_ours, p_twin)
    assert ours.step_count == twin.step_count == 3
    ours.to_host()
    assert ours.prepare_again(last, p_ours, _arrays(30), hp) is None
