"""Every optimizer and option, on every backend, against the float64 reference (optirs.core.reference)."""

from __future__ import annotations

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.definitions import DEFINITIONS
from optirs.optim.optimizers import OPTIMIZERS

from conftest import from_backend_array, to_backend_array

MODEL_SHAPES = [(17, 9), (300,), (5,), (2, 3, 4), (1,)]
STEPS = 20

# Every definition's example hyperparameters cover its options.
CASES = {name: d.examples for name, d in DEFINITIONS.items()}
ALL_CASES = [pytest.param(name, hp, id=f"{name}-{i}") for name, hps in CASES.items() for i, hp in enumerate(hps)]


def make_problem(rng, shapes=MODEL_SHAPES, steps=STEPS):
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]
    return params, grads


def assert_close_to_reference(actual, expected):
    """float32 kernels within 1e-5 relative of the float64 reference (absolute floor: 1e-5 of the tensor's scale)."""
    for a, e in zip(actual, expected):
        scale = float(np.max(np.abs(e))) or 1.0
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("name,hp", ALL_CASES)
def test_model_matches_reference(backend, name, hp, rng):
    params, grads = make_problem(rng)
    expected, expected_state = reference.run(name, params, grads, hp)
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    for g in grads:
        opt.step_gpu(params, g)
    assert_close_to_reference(params, expected)
    state = opt.state_dict()["state"]
    for mine, ref in zip(state, expected_state):
        assert set(mine) == set(ref)
        assert_close_to_reference([mine[k] for k in sorted(ref)], [ref[k] for k in sorted(ref)])


@pytest.mark.parametrize("name", list(CASES))
def test_single_array_and_device_arrays(backend, name, rng):
    """One array (not a list), given as the backend's own device array, stepped in place."""
    hp = CASES[name][-1]
    (host,), grads = make_problem(rng, [(123,)], steps=5)
    expected, _ = reference.run(name, [host], grads, hp)
    param = to_backend_array(backend, host)
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    for (g,) in grads:
        opt.step_gpu(param, to_backend_array(backend, g))
    assert_close_to_reference([from_backend_array(param)], expected)


@pytest.mark.parametrize("name", list(CASES))
def test_resume_is_bit_identical(backend, name, rng):
    """state_dict after 7 steps, loaded into a new optimizer, continues exactly like the original."""
    hp = CASES[name][-1]
    params, grads = make_problem(rng, steps=12)
    cfg = optirs.GpuOptimizerConfig(backend=backend)
    straight = [p.copy() for p in params]
    opt = OPTIMIZERS[name](hp, cfg)
    for g in grads:
        opt.step_gpu(straight, g)
    resumed = [p.copy() for p in params]
    first = OPTIMIZERS[name](hp, cfg)
    for g in grads[:7]:
        first.step_gpu(resumed, g)
    checkpoint = first.state_dict()
    second = OPTIMIZERS[name](OPTIMIZERS[name]().params, cfg)
    second.load_state_dict(checkpoint)
    assert second.params == hp and second.step_count == 7
    for g in grads[7:]:
        second.step_gpu(resumed, g)
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)


def test_move_to_cpu_and_back_keeps_state(backend, rng):
    params, grads = make_problem(rng, steps=6)
    twin = [p.copy() for p in params]
    cfg = optirs.GpuOptimizerConfig(backend=backend)
    a, b = optirs.GpuAdam(config=cfg), optirs.GpuAdam(config=cfg)
    a.move_to_gpu()
    for i, g in enumerate(grads):
        a.step_gpu(params, g)
        b.step_gpu(twin, g)
        if i == 2:
            b.move_to_cpu()
            assert not b.state_on_device
            sd_host = b.state_dict()
            b.move_to_gpu()
            assert b.state_on_device
            np.testing.assert_array_equal(sd_host["state"][0]["exp_avg"], b.state_dict()["state"][0]["exp_avg"])
    for x, y in zip(params, twin):
        np.testing.assert_array_equal(x, y)


def test_hyperparameters_change_between_steps(backend, rng):
    """An lr schedule: assigning new params between steps uses them from the next step on."""
    params, grads = make_problem(rng, steps=4)
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1, momentum=0.9), optirs.GpuOptimizerConfig(backend=backend))
    expected = [p.astype(np.float64) for p in params]
    state = [{} for _ in params]
    for t, g in enumerate(grads, start=1):
        hp = optirs.SgdParams(lr=0.1 / t, momentum=0.9)
        opt.params = hp
        opt.step_gpu(params, g)
        expected, state = reference.sgd(expected, g, state, hp, t)
    assert_close_to_reference(params, expected)


def test_zero_gradient_lamb_trust_ratio_is_one(backend):
    """LAMB: a zero parameter tensor has trust ratio 1 (not 0/0)."""
    hp = optirs.LambParams(weight_decay=0.0)
    params = [np.zeros(10, np.float32), np.ones(4, np.float32)]
    grads = [[np.full(10, 0.5, np.float32), np.full(4, -0.25, np.float32)]]
    expected, _ = reference.run("lamb", params, grads, hp)
    opt = optirs.GpuLamb(hp, optirs.GpuOptimizerConfig(backend=backend))
    opt.step_gpu(params, grads[0])
    assert np.all(params[0] != 0)
    assert_close_to_reference(params, expected)
