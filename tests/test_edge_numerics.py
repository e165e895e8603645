"""Wrong answers at the edges: infinite weights without weight decay, LAMB's norms of
large or non-finite values, and skipping a step on non-finite gradients (``found_inf``).

Every case runs on every backend (the ``backend`` fixture: cpu, opencl, the cuda simulator) and is
compared with an independent reference: torch.optim (float32, CPU) for the optimizers torch has,
lion-pytorch for Lion, and optirs.core.reference (float64 numpy) for LAMB.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.optim.mixed_precision import MixedPrecisionConfig, MixedPrecisionOptimizer
from optirs.optim.optimizers import OPTIMIZERS
from optirs.optim.sparse import CooGradient, SparseAdam, SparseAdamConfig, SparseSgd, SparseSgdConfig

from conftest import from_backend_array, to_backend_array
from test_mixed_precision import require_in_place, simulator_arrays  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch")

INF = np.inf
STEPS = 3


def assert_same_values(actual, expected, rtol=1e-5):
    """NaN where expected is NaN, the same infinities, finite values within ``rtol``."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    special = ~np.isfinite(expected)
    np.testing.assert_array_equal(actual[special], expected[special])  # NaN == NaN here
    np.testing.assert_allclose(actual[~special], expected[~special], rtol=rtol, atol=1e-6)


def inf_problem(rng):
    """Two tensors: one with +inf and -inf weights among finite ones, one all finite."""
    p0 = rng.standard_normal(7).astype(np.float32)
    p0[1], p0[4] = INF, -INF
    params = [p0, rng.standard_normal((3, 4)).astype(np.float32)]
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(STEPS)]
    return params, grads


# ---------------------------------------------------------------- 1. 0 * inf with weight_decay = 0

# (optirs name, optirs hyperparameters, torch class, torch keyword arguments): weight_decay 0 always.
TORCH_CASES = [
    ("sgd", optirs.SgdParams(lr=0.1), torch.optim.SGD, dict(lr=0.1)),
    ("sgd", optirs.SgdParams(lr=0.1, momentum=0.9, dampening=0.1), torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, dampening=0.1)),
    ("sgd", optirs.SgdParams(lr=0.1, momentum=0.9, nesterov=True), torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("adam", optirs.AdamParams(lr=1e-2), torch.optim.Adam, dict(lr=1e-2)),
    ("adam", optirs.AdamParams(lr=1e-2, amsgrad=True), torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    ("adamw", optirs.AdamParams(lr=1e-2, weight_decay=0.0), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0)),
    ("rmsprop", optirs.RmspropParams(lr=1e-2), torch.optim.RMSprop, dict(lr=1e-2)),
    ("rmsprop", optirs.RmspropParams(lr=1e-2, momentum=0.9, centered=True), torch.optim.RMSprop,
     dict(lr=1e-2, momentum=0.9, centered=True)),
    ("adagrad", optirs.AdagradParams(lr=1e-2, lr_decay=0.1), torch.optim.Adagrad, dict(lr=1e-2, lr_decay=0.1)),
    ("adafactor", optirs.AdafactorParams(lr=1e-2), torch.optim.Adafactor, dict(lr=1e-2)),
]


def torch_run(cls, kwargs, params, grads):
    ts = [torch.tensor(p, requires_grad=True) for p in params]
    opt = cls(ts, **kwargs)
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g)
        opt.step()
    return [t.detach().numpy() for t in ts]


@pytest.mark.parametrize("name,hp,cls,kwargs", TORCH_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(TORCH_CASES)])
def test_infinite_weights_without_weight_decay_match_torch(backend, rng, name, hp, cls, kwargs):
    """torch adds weight_decay * p only when weight_decay != 0: inf stays inf (0 * inf was NaN)."""
    params, grads = inf_problem(rng)
    expected = torch_run(cls, kwargs, params, grads)
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    with np.errstate(invalid="ignore"):
        for gs in grads:
            opt.step_gpu(params, gs)
    if name != "adafactor":  # Adafactor's RMS(p) makes the whole tensor non-finite, in torch too
        assert np.isinf(params[0][[1, 4]]).all()
    for a, e in zip(params, expected):
        assert_same_values(a, e)


@pytest.mark.parametrize("name,hp", [("lion", optirs.LionParams(lr=1e-2)),
                                     ("lamb", optirs.LambParams(weight_decay=0.0)),
                                     ("lamb", optirs.LambParams(weight_decay=0.0, max_trust_ratio=0.5))],
                         ids=["lion", "lamb", "lamb-max_trust_ratio"])
def test_infinite_weights_without_weight_decay_match_reference(backend, rng, name, hp):
    """Lion (decoupled decay of factor exactly 1) and LAMB (no wd * p term in the direction)."""
    params, grads = inf_problem(rng)
    with np.errstate(invalid="ignore", over="ignore"):
        expected, _ = reference.run(name, params, grads, hp)
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    with np.errstate(invalid="ignore"):
        for gs in grads:
            opt.step_gpu(params, gs)
    for a, e in zip(params, expected):
        assert_same_values(a, np.asarray(e, np.float32))
    assert np.isfinite(params[1]).all()  # the other tensor keeps its own trust ratio


def test_reference_lion_keeps_infinite_weights_as_lion_pytorch():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    p = [np.array([INF, -INF, 1.0, 2.0], np.float32)]
    g = [[np.array([0.5, -0.5, 0.25, -1.0], np.float32)]]
    hp = optirs.LionParams(lr=1e-2)
    expected = torch_run(lambda ts, **kw: lion_pytorch.Lion(ts, lr=hp.lr, betas=(hp.beta1, hp.beta2)), {}, p, g)
    got, _ = reference.run("lion", p, g, hp)
    assert_same_values(got[0], expected[0])


def test_sparse_steps_keep_infinite_weights_as_torch(backend):
    """The sparse kernels run the same element math: an infinite row stays infinite."""
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal((6, 3)).astype(np.float32)
    p0[2, 1], p0[4, 0] = INF, -INF
    idx = np.array([2, 4, 2, 0])
    vals = rng.standard_normal((4, 3)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tgrad = torch.sparse_coo_tensor(torch.as_tensor(idx)[None], torch.as_tensor(vals), (6, 3))
    for make, tcls, kw in [(lambda: SparseAdam(SparseAdamConfig(lr=0.05, backend=backend)), torch.optim.SparseAdam,
                            dict(lr=0.05)),
                           (lambda: SparseSgd(SparseSgdConfig(lr=0.1, backend=backend)), torch.optim.SGD,
                            dict(lr=0.1))]:
        p = p0.copy()
        make().step(p, CooGradient(idx, vals))
        tp = torch.tensor(p0, requires_grad=True)
        topt = tcls([tp], **kw)
        tp.grad = tgrad
        topt.step()
        assert_same_values(p, tp.detach().numpy())
        assert np.isinf(p[2, 1]) and np.isinf(p[4, 0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_overflowed_half_weight_stays_infinite(backend, dtype, simulator_arrays):  # noqa: F811
    """A float16 weight that overflowed to inf: the master weight is inf, and stays inf (was NaN)."""
    require_in_place(backend)
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    host32 = np.array([INF, -INF, 1.0, 3.0, -0.5], np.float32)
    grad32 = np.array([0.5, -0.25, 0.5, 1.0, 2.0], np.float32)
    inner = optirs.GpuSgd(optirs.SgdParams(lr=0.1, momentum=0.9), optirs.GpuOptimizerConfig(backend=backend))
    opt = MixedPrecisionOptimizer(inner, MixedPrecisionConfig(dtype, init_scale=1.0, dynamic=False))
    dev = [to_backend_array(backend, host32.astype(np_dtype))]
    for _ in range(STEPS):
        assert opt.step_gpu(dev, [to_backend_array(backend, grad32.astype(np_dtype))]) is True
    expected = torch_run(torch.optim.SGD, dict(lr=0.1, momentum=0.9), [host32.astype(np_dtype).astype(np.float32)],
                         [[grad32.astype(np_dtype).astype(np.float32)]] * STEPS)
    assert_same_values(opt.master_weights()[0], expected[0])
    got = from_backend_array(dev[0])
    if got.dtype == np.uint16:
        got = got.view(np_dtype)
    assert_same_values(got.astype(np.float32), expected[0].astype(np_dtype).astype(np.float32))


# ---------------------------------------------------------------- 2. LAMB's norms at the edges


def lamb_case(p_first, g_first):
    params = [np.array(p_first, np.float32), np.array([1.0, -2.0, 3.0, 0.5, -0.25], np.float32)]
    grads = [np.array(g_first, np.float32), np.array([0.1, 0.2, -0.3, 0.4, 0.05], np.float32)]
    return params, grads


LAMB_EDGE_INPUTS = {
    "large": ([2e19, 1.0, -1.0], [0.5, 0.5, 0.5]),
    "largest": ([3e38, -3e38, 1.0], [0.5, -0.5, 0.25]),
    "large-grad": ([1.0, 2.0, 3.0], [3e19, -0.5, 0.5]),
    "inf-weight": ([INF, -INF, 1.0], [0.5, 0.5, 0.5]),
    "nan-weight": ([np.nan, 1.0, 2.0], [0.5, 0.5, 0.5]),
    "inf-grad": ([1.0, 2.0, 3.0], [INF, 0.5, 0.5]),
    "nan-grad": ([1.0, 2.0, 3.0], [np.nan, 0.5, 0.5]),
}
LAMB_HPS = {
    "default": optirs.LambParams(),
    "no-decay": optirs.LambParams(weight_decay=0.0),
    "trust-clip": optirs.LambParams(max_trust_ratio=0.5),
    "grad-clip": optirs.LambParams(max_grad_norm=1.0),
    "both-clips": optirs.LambParams(weight_decay=0.0, max_trust_ratio=0.5, max_grad_norm=1.0),
}


@pytest.mark.parametrize("hp_name", list(LAMB_HPS))
@pytest.mark.parametrize("case", list(LAMB_EDGE_INPUTS))
def test_lamb_edges_follow_the_reference(backend, case, hp_name):
    """Norms of large finite values are finite (squares taken in float64); with non-finite inputs
    every backend gives the reference's result: a NaN norm makes a NaN trust ratio or clip factor
    (never clipped to max_trust_ratio or 1), an infinite gradient norm clips the others to 0."""
    hp = LAMB_HPS[hp_name]
    params, grads = lamb_case(*LAMB_EDGE_INPUTS[case])
    with np.errstate(invalid="ignore", over="ignore"):
        expected, expected_state = reference.lamb(params, grads, [], hp, 1)
        expected = [np.asarray(e, np.float64).astype(np.float32) for e in expected]
    opt = optirs.GpuLamb(hp, optirs.GpuOptimizerConfig(backend=backend))
    opt.step_gpu(params, grads)
    for a, e in zip(params, expected):
        assert_same_values(a, e)
    if case.startswith("large"):
        assert all(np.isfinite(p).all() for p in params)


# ---------------------------------------------------------------- 3. found_inf: skip the whole step


def _flags(backend):
    """Every accepted form of a set flag: host bools, numpy arrays, the backend's device array."""
    return [True, np.bool_(True), np.array([1], np.uint8), np.array([np.nan], np.float32),
            np.array([np.inf], np.float32), to_backend_array(backend, np.array([1.0], np.float32))]


@pytest.mark.parametrize("name", ["adam", "sgd", "lamb", "adafactor", "lion"])
def test_found_inf_skips_the_whole_step(backend, rng, name, simulator_arrays):  # noqa: F811
    hp = OPTIMIZERS[name]().params
    params = [rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(6).astype(np.float32)]
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(3)]
    poisoned = [np.full(p.shape, np.nan, np.float32) for p in params]
    expected, expected_state = reference.run(name, params, grads, hp)
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    opt.step_gpu(params, grads[0], found_inf=False)
    opt.step_gpu(params, grads[1], found_inf=np.array([0.0], np.float32))
    before, state_before = [p.copy() for p in params], opt.state_dict()
    for flag in _flags(backend):
        opt.step_gpu(params, poisoned, found_inf=flag)
        assert opt.step_count == 2
        for a, b in zip(params, before):
            np.testing.assert_array_equal(a, b)
        after = opt.state_dict()
        assert after["step"] == 2
        for mine, ref in zip(after["state"], state_before["state"]):
            for k in ref:
                np.testing.assert_array_equal(mine[k], ref[k])
    opt.step_gpu(params, grads[2])  # the run goes on as if the skipped calls never happened
    assert opt.step_count == 3
    for a, e in zip(params, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(e))))


def test_found_inf_on_a_first_step_allocates_nothing(backend):
    opt = optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend=backend))
    p = np.ones(5, np.float32)
    opt.step_gpu(p, np.full(5, np.inf, np.float32), found_inf=True)
    np.testing.assert_array_equal(p, np.ones(5, np.float32))
    assert opt.step_count == 0 and opt.state_dict()["state"] == []


@pytest.mark.parametrize("flag,words", [(np.array([1.0, 0.0]), "2 elements"), ("yes", "found_inf"),
                                        (np.zeros(0), "0 elements")])
def test_bad_found_inf_is_refused_and_changes_nothing(flag, words):
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1, momentum=0.9), optirs.GpuOptimizerConfig(backend="cpu"))
    p = np.ones(4, np.float32)
    opt.step_gpu(p, np.ones(4, np.float32))
    before, state = p.copy(), opt.state_dict()
    with pytest.raises(optirs.InvalidParameterError, match=words):
        opt.step_gpu(p, np.ones(4, np.float32), found_inf=flag)
    np.testing.assert_array_equal(p, before)
    assert opt.step_count == 1
    np.testing.assert_array_equal(opt.state_dict()["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])
