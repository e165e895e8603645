"""Lion and Adafactor on every backend, against the float64 reference (optirs.core.reference), and
the reference itself against torch.optim.Adafactor and lion-pytorch's Lion."""

from __future__ import annotations

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.errors import InvalidParameterError, ShapeMismatchError
from optirs.optim.optimizers import OPTIMIZERS

from conftest import from_backend_array, to_backend_array

torch = pytest.importorskip("torch")

# 1-d, 2-d, 3-d (batched factoring), 0-d, a single element, and an empty tensor.
MODEL_SHAPES = [(13,), (9, 17), (2, 5, 6), (), (1,), (3, 0)]
STEPS = 30

CASES = {
    "lion": [optirs.LionParams(), optirs.LionParams(lr=1e-3, weight_decay=0.1),
             optirs.LionParams(lr=3e-3, beta1=0.5, beta2=0.9, weight_decay=0.01)],
    "adafactor": [optirs.AdafactorParams(), optirs.AdafactorParams(lr=0.05, weight_decay=0.1, maximize=True),
                  optirs.AdafactorParams(lr=1e-3, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=1.5, weight_decay=0.01)],
}
ALL_CASES = [pytest.param(name, hp, id=f"{name}-{i}") for name, hps in CASES.items() for i, hp in enumerate(hps)]
TORCH_CASES = [optirs.AdafactorParams(), optirs.AdafactorParams(lr=0.05, weight_decay=0.1, maximize=True),
               optirs.AdafactorParams(lr=1e-3, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=1.5, weight_decay=0.01)]


def make_problem(rng, shapes=MODEL_SHAPES, steps=STEPS):
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]
    return params, grads


def assert_close(actual, expected, rtol=1e-5):
    """float32 results within float32 rounding of the reference (relative, floor: rtol of the tensor's scale)."""
    for a, e in zip(actual, expected):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape
        if e.size:
            scale = float(np.max(np.abs(e))) or 1.0
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def torch_adafactor(params, hp, dtype):
    eps1 = hp.eps[0]
    if eps1 is None and dtype == torch.float64:  # torch takes eps1 from the parameter's dtype; ours is float32's
        eps1 = float(np.finfo(np.float32).eps)
    return torch.optim.Adafactor(params, lr=hp.lr, beta2_decay=hp.beta2_decay, eps=(eps1, hp.eps[1]), d=hp.d,
                                 weight_decay=hp.weight_decay, maximize=hp.maximize, foreach=False)


def run_torch(make_opt, params, grads, dtype):
    tensors = [torch.tensor(p, dtype=dtype, requires_grad=True) for p in params]
    opt = make_opt(tensors)
    for step in grads:
        for t, g in zip(tensors, step):
            t.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return [t.detach().numpy() for t in tensors], opt, tensors


# ---------------------------------------------------------------- the reference against torch and lion-pytorch


@pytest.mark.parametrize("hp", TORCH_CASES)
def test_reference_adafactor_is_torch_in_float64(rng, hp):
    shapes = [s for s in MODEL_SHAPES if np.prod(s) > 0]  # torch's RMS of an empty tensor is 0/0
    params, grads = make_problem(rng, shapes)
    params = [p.astype(np.float64) for p in params]
    expected, opt, tensors = run_torch(lambda ts: torch_adafactor(ts, hp, torch.float64), params, grads, torch.float64)
    mine, state = reference.run("adafactor", params, grads, hp)
    for a, e in zip(mine, expected):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)
    for t, s in zip(tensors, state):
        torch_state = {k: v.numpy() for k, v in opt.state[t].items() if k != "step"}
        assert set(torch_state) == set(s)
        for k in s:
            np.testing.assert_allclose(s[k], torch_state[k], rtol=1e-12, atol=1e-14)


def test_reference_lion_is_lion_pytorch_in_float64(rng):
    """lion-pytorch (in the test extra) is the independent reference for the Lion update."""
    lion_pytorch = pytest.importorskip("lion_pytorch")
    for hp in CASES["lion"]:
        params, grads = make_problem(rng)
        params = [p.astype(np.float64) for p in params]

        def make(ts):
            return lion_pytorch.Lion(ts, lr=hp.lr, betas=(hp.beta1, hp.beta2), weight_decay=hp.weight_decay)

        expected, opt, tensors = run_torch(make, params, grads, torch.float64)
        mine, state = reference.run("lion", params, grads, hp)
        for a, e in zip(mine, expected):
            np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)
        for t, s in zip(tensors, state):
            np.testing.assert_allclose(s["exp_avg"], opt.state[t]["exp_avg"].numpy(), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- every backend


@pytest.mark.parametrize("name,hp", ALL_CASES)
def test_model_matches_reference(backend, name, hp, rng):
    params, grads = make_problem(rng)
    expected, expected_state = reference.run(name, params, grads, hp)
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    for g in grads:
        opt.step_gpu(params, g)
    assert_close(params, expected)
    state = opt.state_dict()["state"]
    for mine, ref in zip(state, expected_state):
        assert set(mine) == set(ref)
        assert_close([mine[k] for k in sorted(ref)], [ref[k] for k in sorted(ref)])


@pytest.mark.parametrize("hp", TORCH_CASES)
def test_adafactor_matches_torch_in_float32(backend, hp, rng):
    """30 steps on 1-d, 2-d and 3-d tensors equal torch.optim.Adafactor's to float32 rounding."""
    params, grads = make_problem(rng, [(31,), (12, 10), (3, 7, 5)])
    expected, opt, tensors = run_torch(lambda ts: torch_adafactor(ts, hp, torch.float32), params, grads, torch.float32)
    mine = optirs.GpuAdafactor(hp, optirs.GpuOptimizerConfig(backend=backend))
    for g in grads:
        mine.step_gpu(params, g)
    assert_close(params, expected)
    for entry, t in zip(mine.state_dict()["state"], tensors):
        torch_state = {k: v.numpy() for k, v in opt.state[t].items() if k != "step"}
        assert set(entry) == set(torch_state)
        assert_close([entry[k] for k in sorted(entry)], [torch_state[k] for k in sorted(entry)])


@pytest.mark.parametrize("name", list(CASES))
def test_device_arrays_in_separate_buffers(backend, name, rng):
    """The backend's own arrays, one allocation per tensor, stepped in place."""
    hp = CASES[name][1]
    hosts, grads = make_problem(rng, [(40,), (6, 11), (2, 3, 4)], steps=4)
    expected, _ = reference.run(name, hosts, grads, hp)
    params = [to_backend_array(backend, h) for h in hosts]
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend))
    for step in grads:
        opt.step_gpu(params, [to_backend_array(backend, g) for g in step])
    assert_close([from_backend_array(p) for p in params], expected)


@pytest.mark.parametrize("name", list(CASES))
def test_resume_is_bit_identical(backend, name, rng):
    """state_dict after 15 steps, loaded into a new optimizer, continues exactly like the original."""
    hp = CASES[name][-1]
    params, grads = make_problem(rng)
    cfg = optirs.GpuOptimizerConfig(backend=backend)
    straight = [p.copy() for p in params]
    opt = OPTIMIZERS[name](hp, cfg)
    for g in grads:
        opt.step_gpu(straight, g)
    resumed = [p.copy() for p in params]
    first = OPTIMIZERS[name](hp, cfg)
    for g in grads[:15]:
        first.step_gpu(resumed, g)
    checkpoint = first.state_dict()
    second = OPTIMIZERS[name](config=cfg)
    second.load_state_dict(checkpoint)
    assert second.params == hp and second.step_count == 15
    for g in grads[15:]:
        second.step_gpu(resumed, g)
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- checkpoints and validation (host side)


def test_adafactor_state_dict_round_trips_in_torch_shapes(rng):
    params, grads = make_problem(rng, steps=3)
    opt = optirs.GpuAdafactor(config=optirs.GpuOptimizerConfig(backend="cpu"))
    for g in grads:
        opt.step_gpu(params, g)
    sd = opt.state_dict()
    for shape, entry in zip(MODEL_SHAPES, sd["state"]):
        if len(shape) >= 2:
            assert {k: v.shape for k, v in entry.items()} == {"row_var": shape[:-1] + (1,),
                                                              "col_var": shape[:-2] + (1,) + shape[-1:]}
        else:
            assert {k: v.shape for k, v in entry.items()} == {"variance": shape}
    other = optirs.GpuAdafactor(config=optirs.GpuOptimizerConfig(backend="cpu"))
    other.load_state_dict(sd)
    again = other.state_dict()
    assert again["step"] == 3 and again["shapes"] == sd["shapes"] and again["hyperparameters"] == sd["hyperparameters"]
    for a, b in zip(sd["state"], again["state"]):
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_adafactor_bad_checkpoint_changes_nothing(rng):
    params, grads = make_problem(rng, steps=2)
    opt = optirs.GpuAdafactor(config=optirs.GpuOptimizerConfig(backend="cpu"))
    for g in grads:
        opt.step_gpu(params, g)
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][1]["row_var"] = np.zeros((9, 17))  # the parameter's shape, not the row means'
    with pytest.raises(ShapeMismatchError, match=r"row_var.*expected \(9, 1\)"):
        opt.load_state_dict(bad)
    wrong_slots = opt.state_dict()
    wrong_slots["state"][0] = {"row_var": np.zeros((13, 1))}
    with pytest.raises(InvalidParameterError, match="expected \\['variance'\\]"):
        opt.load_state_dict(wrong_slots)
    after = opt.state_dict()
    assert after["step"] == before["step"]
    for a, b in zip(before["state"], after["state"]):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("make", [
    lambda: optirs.LionParams(lr=-1.0),
    lambda: optirs.LionParams(beta1=1.5),
    lambda: optirs.LionParams(beta2=-0.1),
    lambda: optirs.LionParams(weight_decay=-1e-3),
    lambda: optirs.LionParams(lr=float("nan")),
    lambda: optirs.AdafactorParams(lr=-1.0),
    lambda: optirs.AdafactorParams(beta2_decay=0.5),
    lambda: optirs.AdafactorParams(eps=(-1e-30, 1e-3)),
    lambda: optirs.AdafactorParams(eps=(None, -1.0)),
    lambda: optirs.AdafactorParams(eps=1e-3),
    lambda: optirs.AdafactorParams(eps=(None, 1e-3, 0.1)),
    lambda: optirs.AdafactorParams(d=0.5),
    lambda: optirs.AdafactorParams(weight_decay=-0.1),
    lambda: optirs.AdafactorParams(maximize=1),
], ids=lambda f: "")
def test_bad_hyperparameters_raise(make):
    with pytest.raises(InvalidParameterError):
        make()


def test_wrong_params_type_raises_and_public_names():
    with pytest.raises(InvalidParameterError, match="LionParams"):
        optirs.GpuLion(optirs.AdamParams())
    with pytest.raises(InvalidParameterError, match="AdafactorParams"):
        optirs.GpuAdafactor(optirs.LionParams())
    for name in ("GpuLion", "GpuAdafactor", "LionParams", "AdafactorParams"):
        assert name in optirs.__all__ and hasattr(optirs, name)
    assert optirs.AdafactorParams.from_dict({"eps": [None, 1e-3]}).eps == (None, 1e-3)


@pytest.mark.skipif(__import__("os").environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="compiles real PTX; the simulator has no compiler")
def test_cuda_kernels_compile_to_sm90_ptx(monkeypatch):
    """Lion's and Adafactor's CUDA kernels compile for the H200 (sm_90) without a GPU; Lion in float32 only
    (Adafactor's per-tensor sums are float64 by design, its per-element math float32)."""
    import types as pytypes

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, typeof

    from optirs.backends.cuda import _head_types
    from optirs.backends.cuda import adafactor_kernels, kernels
    from optirs.core import scalars

    # device functions called from a kernel ask the current device for its compute capability
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    lion_sc = scalars.lion_scalars(optirs.LionParams(), 3)
    ptx, _ = cuda.compile_ptx(kernels.STEP_FUNCTIONS["lion"], _head_types("step") + (typeof(lion_sc),), cc=(9, 0))
    assert ".target sm_90" in ptx and ".f64" not in ptx
    ada_sc = scalars.adafactor_scalars(optirs.AdafactorParams(), 3)
    ptx, _ = cuda.compile_ptx(adafactor_kernels.adafactor_step, adafactor_kernels.argument_types(ada_sc), cc=(9, 0))
    assert ".target sm_90" in ptx
