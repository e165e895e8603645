"""Bad input that used to escape as foreign errors (OverflowError, TypeError, numba typing errors)
or be silently accepted; memory identity of parameters and gradients. Each case: an error of
optirs' own types naming the field, and nothing changed (compared with an untouched twin)."""

from __future__ import annotations

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.errors import GpuOptimError, InvalidParameterError, PluginError, ShapeMismatchError
from optirs.optim.mixed_precision import DynamicLossScaler, MixedPrecisionConfig, MixedPrecisionOptimizer
from optirs.optim.sparse import CooGradient, SparseAdam, SparseAdamConfig, SparseSgd, SparseSgdConfig

from conftest import from_backend_array, to_backend_array

# ------------------------------------------------------------------ 1. hyperparameters beyond float32


@pytest.mark.parametrize("cls,kwargs,field", [
    (optirs.AdamParams, {"lr": 10**400}, "lr"),
    (optirs.SgdParams, {"lr": 1e39}, "lr"),
    (optirs.SgdParams, {"momentum": 1e39}, "momentum"),
    (optirs.RmspropParams, {"eps": 1e39}, "eps"),
    (optirs.AdagradParams, {"lr_decay": 10**400}, "lr_decay"),
    (optirs.LambParams, {"max_grad_norm": 1e39}, "max_grad_norm"),
    (optirs.LionParams, {"weight_decay": 1e39}, "weight_decay"),
    (optirs.AdafactorParams, {"eps": (None, 1e39)}, r"eps\[1\]"),
    (optirs.AdafactorParams, {"d": 10**400}, "d"),
    # derived scalars: the step size lr / (1 - beta1) at step 1, the decay factor 1 - lr * weight_decay
    (optirs.AdamParams, {"lr": 1e30, "beta1": 1 - 1e-12}, r"lr / \(1 - beta1\)"),
    (optirs.AdamParams, {"lr": 1e20, "weight_decay": 1e20}, r"lr \* weight_decay"),
    (optirs.LionParams, {"lr": 1e20, "weight_decay": 1e20}, r"lr \* weight_decay"),
    (optirs.AdafactorParams, {"lr": 1e20, "weight_decay": 1e20}, r"lr \* weight_decay"),
])
def test_hyperparameters_beyond_float32_are_refused(cls, kwargs, field):
    with pytest.raises(InvalidParameterError, match=field):
        cls(**kwargs)


def test_largest_float32_values_are_accepted():
    f32max = float(np.finfo(np.float32).max)
    assert optirs.SgdParams(lr=f32max).lr == f32max
    assert optirs.AdamParams(lr=1.0, beta1=1 - 1e-12).beta1 == 1 - 1e-12


def _forged(cls, **values):
    """A record with values its constructor refuses (as a subclass or pickle could make one)."""
    hp = cls()
    for k, v in values.items():
        object.__setattr__(hp, k, v)
    return hp


def test_step_refuses_scalars_that_overflow_float32_and_changes_nothing(backend, rng):
    p = rng.standard_normal(8).astype(np.float32)
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1, momentum=0.9), optirs.GpuOptimizerConfig(backend=backend))
    opt.step_gpu(p, np.ones_like(p))
    before_p, before = p.copy(), opt.state_dict()
    opt._params = _forged(optirs.SgdParams, lr=1e39, momentum=0.9)
    with pytest.raises(InvalidParameterError, match=r"SgdScalars.lr=inf at step 2"):
        opt.step_gpu(p, np.ones_like(p))
    np.testing.assert_array_equal(p, before_p)
    after = opt.state_dict()
    assert after["step"] == 1
    np.testing.assert_array_equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


# ------------------------------------------------------------------ 2. load_state_dict


def _adam(backend, rng):
    params = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(4)]
    opt = optirs.GpuAdam(optirs.AdamParams(lr=0.01, amsgrad=True), optirs.GpuOptimizerConfig(backend=backend))
    for g in grads[:2]:
        opt.step_gpu(params, g)
    return opt, params, grads


def _with_state(good, i, slot, value):
    state = [dict(e) for e in good["state"]]
    state[i][slot] = value
    return {**good, "state": state}


def _bad_state_dicts(good):
    hp = good["hyperparameters"]
    v = good["state"][1]["exp_avg"]
    lossy = v.astype(np.float64)
    lossy[0] += 1e-12
    return [
        ({**good, "hyperparameters": None}, r"hyperparameters=None"),
        ({**good, "hyperparameters": {}}, r"hyperparameters lack \['lr'"),
        ({**good, "hyperparameters": {k: x for k, x in hp.items() if k != "eps"}}, r"hyperparameters lack \['eps'\]"),
        ({**good, "hyperparameters": {**hp, "lr": 10**400}}, r"lr="),
        ({**good, "shapes": [["a"]]}, r"shapes\[0\]\[0\]='a'"),
        ({**good, "shapes": None}, r"shapes=None"),
        ({**good, "shapes": [[3, 4], [-5]]}, r"shapes\[1\]\[0\]=-5"),
        ({**good, "state": None}, r"state=None"),
        ({**good, "state": [None, None]}, r"state\[0\] has slots NoneType"),
        ({**good, "step": 10**400}, r"step="),
        ({**good, "step": 2**63 - 1}, r"step="),
        ({**good, "step": np.float64(2.0)}, r"step="),
        (_with_state(good, 1, "exp_avg", np.array([None] * 5, dtype=object)), r"state\[1\]\['exp_avg'\] has dtype object"),
        (_with_state(good, 1, "exp_avg", lossy), r"state\[1\]\['exp_avg'\] has dtype float64 .* not exactly a float32"),
        (_with_state(good, 1, "exp_avg", np.ones(5, np.int64)), r"state\[1\]\['exp_avg'\] has dtype int64"),
        (_with_state(good, 1, "exp_avg", v.astype(np.complex64)), r"state\[1\]\['exp_avg'\] has dtype complex64"),
        (_with_state(good, 1, "exp_avg", np.ma.masked_array(v, mask=[1, 0, 0, 0, 0])), r"MaskedArray"),
        (_with_state(good, 1, "exp_avg", v[:4]), r"state\[1\]\['exp_avg'\] has shape \(4,\), expected \(5,\)"),
    ]


@pytest.mark.parametrize("case", range(18))
def test_malformed_state_dict_is_refused_and_the_run_resumes_bit_exact(backend, rng, case):
    opt, params, grads = _adam(backend, rng)
    twin_params = [p.copy() for p in params]
    twin = optirs.GpuAdam(opt.params, optirs.GpuOptimizerConfig(backend=backend))
    twin.load_state_dict(opt.state_dict())
    bad, pattern = _bad_state_dicts(opt.state_dict())[case]
    with pytest.raises(GpuOptimError, match=pattern) as info:
        opt.load_state_dict(bad)
    assert isinstance(info.value, (InvalidParameterError, ShapeMismatchError))
    assert opt.step_count == 2
    for g in grads[2:]:
        opt.step_gpu(params, g)
        twin.step_gpu(twin_params, g)
    for a, b in zip(params, twin_params):
        np.testing.assert_array_equal(a, b)


def test_lossless_float64_state_resumes_bit_exact(rng):
    opt, params, grads = _adam("cpu", rng)
    good = opt.state_dict()
    wide = {**good, "state": [{k: x.astype(np.float64) for k, x in e.items()} for e in good["state"]]}
    twin, twin_params = optirs.GpuAdam(opt.params, optirs.GpuOptimizerConfig(backend="cpu")), [p.copy() for p in params]
    twin.load_state_dict(wide)
    for g in grads[2:]:
        opt.step_gpu(params, g)
        twin.step_gpu(twin_params, g)
    for a, b in zip(params, twin_params):
        np.testing.assert_array_equal(a, b)


def _mixed(rng):
    inner = optirs.GpuAdam(optirs.AdamParams(lr=0.01), optirs.GpuOptimizerConfig(backend="cpu"))
    opt = MixedPrecisionOptimizer(inner, MixedPrecisionConfig(np.float16))
    p = rng.standard_normal(6).astype(np.float16)
    opt.step_gpu([p], [(rng.standard_normal(6) * 1024).astype(np.float16)])
    return opt


@pytest.mark.parametrize("field,value,pattern", [
    ("master", [None], r"master'\]\[0\] has dtype object"),
    ("master", None, r"master'\]=None"),
    ("master", "lossy", r"not exactly a float32"),
    ("scale", 10**400, r"scale="),
    ("scale", 1e39, r"scale="),
    ("stats", "ab", r"stats="),
    ("stats", {"steps": None}, r"stats keys"),
    ("stats_steps", None, r"stats\['steps'\]=None"),
])
def test_mixed_precision_and_scaler_state_dicts(rng, field, value, pattern):
    opt = _mixed(rng)
    good = opt.state_dict()
    bad = {**good, "scaler": dict(good["scaler"])}
    if field == "master":
        bad["master"] = [good["master"][0].astype(np.float64) + 1e-12] if value == "lossy" else value
    elif field == "stats_steps":
        bad["scaler"]["stats"] = {**good["scaler"]["stats"], "steps": value}
    else:
        bad["scaler"][field] = value
    with pytest.raises(InvalidParameterError, match=pattern):
        opt.load_state_dict(bad)
    now = opt.state_dict()
    np.testing.assert_array_equal(now["master"][0], good["master"][0])
    assert now["scaler"] == good["scaler"] and now["inner"]["step"] == good["inner"]["step"]
    scaler = DynamicLossScaler()
    if field in ("scale", "stats", "stats_steps"):
        with pytest.raises(InvalidParameterError, match=pattern):
            scaler.load_state_dict(bad["scaler"])
        assert scaler.state_dict() == DynamicLossScaler().state_dict()


@pytest.mark.parametrize("cls,config,mutate,pattern", [
    (SparseAdam, SparseAdamConfig, lambda sd: {**sd, "hyperparameters": None}, r"hyperparameters=None"),
    (SparseAdam, SparseAdamConfig, lambda sd: {**sd, "tables": None}, r"tables=None"),
    (SparseAdam, SparseAdamConfig, lambda sd: {**sd, "tables": [None]}, r"tables\[0\]=None"),
    (SparseAdam, SparseAdamConfig, lambda sd: {**sd, "tables": [{**sd["tables"][0], "num_rows": "a"}]}, r"num_rows'\]='a'"),
    (SparseAdam, SparseAdamConfig, lambda sd: {**sd, "tables": [{**sd["tables"][0], "step": 10**400}]}, r"step'\]="),
    (SparseAdam, SparseAdamConfig, lambda sd: {**sd, "tables": [{**sd["tables"][0], "exp_avg": sd["tables"][0]["exp_avg"].astype(np.complex128)}]}, r"exp_avg'\]\ has dtype complex128"),
    (SparseSgd, lambda **k: SparseSgdConfig(momentum=0.9, **k), lambda sd: {**sd, "tables": [{**sd["tables"][0], "row_seen": np.full(6, 2, np.uint8)}]}, r"row_seen'\]\ holds values other than 0 and 1"),
    (SparseSgd, lambda **k: SparseSgdConfig(momentum=0.9, **k), lambda sd: {**sd, "tables": [{**sd["tables"][0], "momentum_buffer": np.full((6, 3), None)}]}, r"momentum_buffer'\]\ has dtype object"),
])
def test_sparse_state_dicts(rng, cls, config, mutate, pattern):
    opt = cls(config(backend="cpu"))
    table = rng.standard_normal((6, 3)).astype(np.float32)
    opt.step(table, CooGradient(np.array([0, 2]), rng.standard_normal((2, 3)).astype(np.float32)))
    good = opt.state_dict()
    with pytest.raises(InvalidParameterError, match=pattern):
        opt.load_state_dict(mutate(good))
    now = opt.state_dict()
    assert now["hyperparameters"] == good["hyperparameters"] and now["tables"][0]["step"] == 1
    for k, x in good["tables"][0].items():
        np.testing.assert_array_equal(now["tables"][0][k], x)


# ------------------------------------------------------------------ 3. ndarray subclasses


@pytest.mark.parametrize("make", [lambda a: np.ma.masked_array(a, mask=np.zeros(a.shape, bool)), np.asmatrix],
                         ids=["masked", "matrix"])
def test_ndarray_subclasses_are_refused_on_every_backend(backend, rng, make):
    host = rng.standard_normal((2, 3)).astype(np.float32)
    p, g = make(host.copy()), make(np.ones((2, 3), np.float32))
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend=backend))
    with pytest.raises(InvalidParameterError, match=rf"params\[0\] of type numpy.*{type(p).__name__}.*expected a plain numpy.ndarray"):
        opt.step_gpu(p, g)
    np.testing.assert_array_equal(np.asarray(p), host)
    assert opt.step_count == 0


# ------------------------------------------------------------------ 4. register_plugin


class _Hooked:
    @optirs.plugin.hookspecs.hookimpl
    def optirs_plugin_info(self):
        return {"summary": "ok"}


@pytest.mark.parametrize("plugin,name,pattern", [
    (None, "x", r"plugin 'x' is None"),
    (42, "y", r"plugin 'y' is 42 \(int\)"),
    ("optirs", "z", r"plugin 'z' is 'optirs' \(str\)"),
    (object(), "w", r"plugin 'w' .* implements no optirs hook"),
    (_Hooked(), None, r"plugin name None, expected a non-empty string"),
    (_Hooked(), "", r"plugin name '', expected a non-empty string"),
    (_Hooked(), "auto", r"plugin name 'auto'"),
])
def test_register_plugin_refuses_what_is_not_a_plugin(fresh_registry, plugin, name, pattern):
    before = [s.name for s in optirs.list_backends()]
    with pytest.raises(PluginError, match=pattern):
        optirs.register_plugin(plugin, name)
    assert [s.name for s in optirs.list_backends()] == before
    assert optirs.get_backend("cpu").name == "cpu"
    optirs.register_plugin(_Hooked(), "fine")  # a real plugin still registers


# ------------------------------------------------------------------ 5. memory identity


def _overlap_cases(backend, rng):
    base = to_backend_array(backend, rng.standard_normal(20).astype(np.float32))
    other = to_backend_array(backend, rng.standard_normal(10).astype(np.float32))
    g10 = to_backend_array(backend, np.ones(10, np.float32))
    return [
        (([base[0:10], base[5:15]], [g10, to_backend_array(backend, np.ones(10, np.float32))]),
         r"params\[1\] is the same memory as params\[0\] \(20 overlapping bytes\)"),
        (([other], [other]), r"grads\[0\] is the same memory as params\[0\] \(all its bytes\)"),
        (([base[0:10], other], [base[10:20], base[5:15]]), r"grads\[1\] is the same memory as params\[0\]"),
    ], [base, other]


@pytest.mark.parametrize("case", range(3))
def test_overlapping_memory_is_refused_on_every_backend(backend, rng, case):
    cases, arrays = _overlap_cases(backend, rng)
    before = [from_backend_array(a) for a in arrays]
    (params, grads), pattern = cases[case]
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend=backend))
    with pytest.raises(InvalidParameterError, match=pattern):
        opt.step_gpu(params, grads)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(from_backend_array(a), b)


def test_gradients_may_alias_each_other(backend, rng):
    """The step only reads gradients: one gradient buffer for several parameters is allowed (as torch)."""
    host = [rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)]
    shared = rng.standard_normal(12).astype(np.float32)
    params = [to_backend_array(backend, h) for h in host]
    g = to_backend_array(backend, shared)
    hp = optirs.SgdParams(lr=0.1, momentum=0.9)
    opt = optirs.GpuSgd(hp, optirs.GpuOptimizerConfig(backend=backend))
    opt.step_gpu(params, [g[0:6], g[3:9]])
    expected, _ = reference.run("sgd", host, [[shared[0:6], shared[3:9]]], hp)
    for a, e in zip(params, expected):
        np.testing.assert_allclose(from_backend_array(a), e, rtol=1e-6, atol=1e-7)


class _FakeBuffer:
    def __init__(self, handle):
        self.int_ptr = handle

    def get_info(self, what):
        return None


class _FakeClArray:
    """Stands in for pyopencl.array.Array (describe recognises the module name)."""
    __module__ = "pyopencl.array"

    def __init__(self, buffer, offset, n):
        self.base_data, self.offset, self.shape, self.dtype = buffer, offset, (n,), np.dtype(np.float32)
        self.strides = (4,)

        class _Flags:
            c_contiguous = True
        self.flags = _Flags()


def test_distinct_opencl_buffers_never_collide():
    """The old identity id(buffer) ^ offset made two distinct buffers 'the same memory'."""
    pytest.importorskip("pyopencl")
    from optirs.core.arrays import check_no_overlap, describe

    b1, b2 = _FakeBuffer(0x1000), _FakeBuffer(0x2000)
    a1 = _FakeClArray(b1, 0, 8)
    a2 = _FakeClArray(b2, id(b1) ^ id(b2), 8)  # id(b1) ^ 0 == id(b2) ^ offset
    m1, m2 = describe(a1), describe(a2)
    check_no_overlap([m1, m2])  # distinct cl_mem handles: no error
    assert m1.extent == (("opencl", 0x1000), 0, 32) and m1.nbytes == 32
    with pytest.raises(InvalidParameterError, match="is the same memory as"):
        check_no_overlap([m1, describe(_FakeClArray(b1, 16, 8))])
