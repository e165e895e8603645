"""The seed API's ``precision=`` option (docs/formats.md): formats stepped through the
optimizer classes, against the float64 reference of the format (optirs.core.reference),
the transaction (nothing changed on error), checkpoints of the compact state (bit-exact resume,
their size) and backends without the ``formats`` capability."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import optirs
from optirs import AdamParams, GpuOptimizerConfig, LionParams, Precision, SgdParams
from optirs.core import params as P
from optirs.core import reference as R
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.formats import FormatState, format_slots, resolve_format
from optirs.core.layout import TensorLayout
from optirs.optim import formats as fm

BF16 = ml_dtypes.bfloat16
# One tensor above the int8 threshold (4096 elements: blocks of 256, the last one short) and one
# below it (float32 state), so every buffer kind is exercised.
SHAPES = [(70, 61), (33,)]


def _arrays(rng, dtype, scale=1.0):
    return [(rng.standard_normal(s) * scale).astype(np.float32).astype(dtype) for s in SHAPES]


def _opt(name, hp, backend, precision):
    return optirs.OPTIMIZERS[name](hp, GpuOptimizerConfig(backend), precision=precision)


def _words(a):
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _flat(opt):
    """The optimizer's flat buffers as its public checkpoint holds them."""
    sd = opt.state_dict()
    fmt = resolve_format(opt.precision, **{k: sd["format"][k] for k in ("param_dtype", "grad_dtype")},
                         family=opt.definition.kernel)
    fs = FormatState(TensorLayout(sd["shapes"]), format_slots(opt.definition, opt.params), fmt)
    return fs, fm.restore_state(fs, sd["state"], opt.definition.state_slots(opt.params))


CASES = [
    ("adamw", AdamParams(lr=1e-2, weight_decay=0.1), BF16, BF16, Precision()),
    ("adamw", AdamParams(lr=1e-2, weight_decay=0.1), BF16, np.float32, Precision(master_weights="float32")),
    ("adamw", AdamParams(lr=1e-2), BF16, BF16, Precision(master_weights="remainder16", state_dtype="bfloat16")),
    ("adamw", AdamParams(lr=1e-2, amsgrad=True), BF16, BF16, Precision(master_weights="remainder8", state_dtype="int8")),
    ("adam", AdamParams(lr=1e-2), np.float32, np.float32, Precision(state_dtype="int8")),
    ("adamw", AdamParams(lr=1e-2), BF16, BF16, Precision(stochastic_rounding=True, seed=7)),
    # the rest of torch.optim's elementwise optimizers run every format through the same kernels
    ("nadam", P.NadamParams(lr=1e-2, weight_decay=0.1), BF16, BF16, Precision(master_weights="float32", state_dtype="int8")),
    ("radam", P.RadamParams(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), BF16, BF16,
     Precision(master_weights="remainder16", state_dtype="bfloat16")),
    ("adamax", P.AdamaxParams(lr=1e-2), BF16, BF16, Precision(state_dtype="int8")),
    ("adadelta", P.AdadeltaParams(), np.float32, np.float32, Precision(state_dtype="bfloat16", seed=5)),
    ("asgd", P.AsgdParams(lr=1e-2, t0=1.0), BF16, BF16, Precision(master_weights="remainder8", state_dtype="int8")),
    ("rprop", P.RpropParams(lr=1e-2), BF16, np.float32, Precision(master_weights="float32", state_dtype="bfloat16")),
    ("sgd", SgdParams(lr=0.1, momentum=0.9), np.float16, np.float16, Precision(master_weights="float32")),
    ("lion", LionParams(lr=1e-3), BF16, BF16, Precision(state_dtype="bfloat16", seed=3)),
]


@pytest.mark.parametrize("name,hp,pdt,gdt,precision", CASES,
                         ids=[f"{c[0]}-{np.dtype(c[2]).name}-{c[4].master_weights}-{c[4].state_dtype}"
                              f"{'-sr' if c[4].stochastic_rounding else ''}" for c in CASES])
def test_format_steps_match_the_reference(name, hp, pdt, gdt, precision, feature_backend, rng):
    """Every step from the optimizer's own state: its parameters and buffers as the reference of
    the format computes them from the same inputs (parameters within one 16-bit step, int8 codes
    within one code: the float32 step's own rounding; everything else to float32 rounding)."""
    definition = DEFINITIONS[name]
    opt = _opt(name, hp, feature_backend, precision)
    params = _arrays(rng, pdt)
    if not opt.backend.supports("formats"):
        before = [p.copy() for p in params]
        with pytest.raises(UnsupportedOperationError, match=f"{feature_backend}.*formats.*state_dtype"):
            opt.step_gpu(params, _arrays(rng, gdt))
        assert all(np.array_equal(_words(a), _words(b)) for a, b in zip(params, before)) and opt.step_count == 0
        return
    fmt = resolve_format(precision, pdt, gdt, definition.kernel)
    fs = FormatState(TensorLayout(SHAPES), format_slots(definition, hp), fmt)
    buffers = R.fresh_buffers(fs, definition, hp)
    for step in range(1, 5):
        grads = _arrays(rng, gdt, 0.1)
        if step > 1:
            fs, buffers = _flat(opt)
        want_p, want_b = R.format_step(definition, hp, fs, [_words(p) for p in params], [_words(g) for g in grads], buffers,
                                precision.seed, step)
        opt.step_gpu(params, grads)
        assert opt.step_count == step
        for got, want in zip(params, want_p):
            if pdt == np.float32:
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
            else:
                diff = np.abs(_words(got).astype(np.int32) - want.astype(np.int32))
                assert diff.max() <= 1, f"step {step}: parameters off by {diff.max()} 16-bit steps"
        _, got_b = _flat(opt)
        for k, want in want_b.items():
            got = got_b[k]
            if k.endswith(".codes"):
                assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1, (step, k)
            elif got.dtype == np.float32:
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7, err_msg=f"step {step} {k}")
            elif k != "master_remainder":  # bfloat16 state: within one bfloat16 step
                g32, w32 = (x.view(BF16).astype(np.float32) for x in (got, want))
                np.testing.assert_allclose(g32, w32, rtol=2**-7, atol=1e-6 * float(np.abs(w32).max()), err_msg=f"step {step} {k}")
        if "master_remainder" in want_b:  # the joined masters within one step of their precision
            got_m = R.decode_master(fs, [_words(p) for p in params], got_b)
            want_m = R.decode_master(fs, want_p, want_b)
            rtol = 2.0**-15 if fmt.master == "remainder8" else 2.0**-22  # 24-bit or float32 masters
            for a, b in zip(got_m, want_m):
                np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7)


def _cpu_or_skip():
    status = {s.name: s for s in optirs.list_backends()}
    if not status["cpu"].available:
        pytest.skip("cpu backend unavailable")


@pytest.mark.parametrize("master", ["remainder16", "remainder8"])
def test_a_nan_master_of_any_payload_leaves_a_nan_parameter(master, feature_backend, rng):
    """float32 gradients whose NaNs carry full payloads (NVIDIA's NaN is 0x7FFFFFFF) make NaN masters
    with those payloads: each leaves the bfloat16 quiet NaN as its parameter and a remainder of 0 (split
    as a word, the payload rounded the parameter up through the sign bit to a zero, 0x8000 or 0x0000);
    every other element steps as it does with those gradients zeroed."""
    hp = AdamParams(lr=1e-2)
    opts = [_opt("adamw", hp, feature_backend, Precision(master_weights=master)) for _ in range(2)]
    if not opts[0].backend.supports("formats"):
        pytest.skip(f"{feature_backend} runs no step formats")
    params = _arrays(rng, BF16)
    twins = [p.copy() for p in params]
    grads = _arrays(rng, np.float32, 0.1)
    where = [5, 9, 17, 30]
    grads[0].reshape(-1).view(np.uint32)[where] = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFC00000]
    zeroed = [g.copy() for g in grads]
    zeroed[0].reshape(-1)[where] = 0
    opts[0].step_gpu(params, grads)
    opts[1].step_gpu(twins, zeroed)
    got, other = _words(params[0]).reshape(-1), _words(twins[0]).reshape(-1)
    assert np.all((got[where] & 0x7FFF) == 0x7FC0), [hex(w) for w in got[where]]
    rem = _flat(opts[0])[1]["master_remainder"]
    assert not rem[where].any()
    keep = np.ones(got.size, bool)
    keep[where] = False
    assert np.array_equal(got[keep], other[keep]) and np.array_equal(_words(params[1]), _words(twins[1]))
    assert np.array_equal(np.delete(rem, where), np.delete(_flat(opts[1])[1]["master_remainder"], where))


def test_float32_state_keeps_the_ordinary_step(rng):
    """float32 parameters with float32 state: the checkpoint is the float32 one (no format entry)."""
    opt = _opt("adam", AdamParams(), "cpu", Precision(master_weights="remainder8"))
    opt.step_gpu(_arrays(rng, np.float32), _arrays(rng, np.float32))
    assert "format" not in opt.state_dict()


@pytest.mark.parametrize("precision", [Precision(master_weights="remainder8", state_dtype="int8"),
                                       Precision(state_dtype="bfloat16", stochastic_rounding=True, seed=11),
                                       Precision(master_weights="remainder16")])
def test_resume_is_bit_exact(precision, rng):
    hp = AdamParams(lr=3e-3, weight_decay=0.01)
    grads = [_arrays(rng, BF16, 0.1) for _ in range(6)]
    start = _arrays(rng, BF16)
    a = _opt("adamw", hp, "cpu", precision)
    pa = [p.copy() for p in start]
    for g in grads:
        a.step_gpu(pa, g)
    b = _opt("adamw", hp, "cpu", precision)
    pb = [p.copy() for p in start]
    for g in grads[:3]:
        b.step_gpu(pb, g)
    ckpt = b.state_dict()
    c = _opt("adamw", hp, "cpu", precision)
    c.load_state_dict(ckpt)
    for g in grads[3:]:
        c.step_gpu(pb, g)
    assert c.step_count == 6
    for x, y in zip(pa, pb):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16))
    for sa, sc in zip(a.state_dict()["state"], c.state_dict()["state"]):
        assert sa.keys() == sc.keys()
        for k in sa:
            assert sa[k].dtype == sc[k].dtype and np.array_equal(sa[k].view(np.uint8), sc[k].view(np.uint8)), k


def test_portable_checkpoint_round_trips_bfloat16_state(rng):
    torch = pytest.importorskip("torch")
    from optirs.torch.interop import portable_state_dict

    precision = Precision(state_dtype="bfloat16")
    a = _opt("adamw", AdamParams(), "cpu", precision)
    p = _arrays(rng, BF16)
    a.step_gpu(p, _arrays(rng, BF16))
    portable = portable_state_dict(a.state_dict())
    assert portable["state"][0]["exp_avg"].dtype == torch.bfloat16
    b = _opt("adamw", AdamParams(), "cpu", precision)
    b.load_state_dict(portable)
    for x, y in zip(a.state_dict()["state"], b.state_dict()["state"]):
        for k in x:
            assert np.array_equal(x[k].view(np.uint8), y[k].view(np.uint8))


def _nbytes(sd):
    return sum(v.nbytes for entry in sd["state"] for v in entry.values())


def test_int8_checkpoint_is_about_a_quarter_of_float32(rng):
    shapes = [(256, 512), (512,)]
    params32 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads32 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    f32 = _opt("adam", AdamParams(), "cpu", Precision())
    f32.step_gpu([p.copy() for p in params32], grads32)
    i8 = _opt("adam", AdamParams(), "cpu", Precision(state_dtype="int8"))
    i8.step_gpu([p.copy() for p in params32], grads32)
    n32, n8 = _nbytes(f32.state_dict()), _nbytes(i8.state_dict())
    # codes 1 byte + a 4-byte scale per 256 elements, the 512-element tensor in float32
    large, small = 256 * 512, 512
    assert n32 == 2 * 4 * (large + small)
    assert n8 == 2 * (large + 4 * (large // 256) + 4 * small)
    assert 0.25 <= n8 / n32 < 0.26


def test_bad_checkpoints_change_nothing(rng):
    precision = Precision(state_dtype="int8")
    a = _opt("adam", AdamParams(), "cpu", precision)
    params = _arrays(rng, np.float32)
    a.step_gpu(params, _arrays(rng, np.float32))
    sd = a.state_dict()
    before = a.state_dict()
    bad = dict(sd, state=[dict(sd["state"][0]), sd["state"][1]])
    bad["state"][0]["exp_avg.codes"] = bad["state"][0]["exp_avg.codes"].astype(np.float32)
    with pytest.raises(InvalidParameterError, match="uint8"):
        a.load_state_dict(bad)
    bad["state"][0]["exp_avg.codes"] = sd["state"][0]["exp_avg.codes"][:-1]
    with pytest.raises(ShapeMismatchError, match="shape"):
        a.load_state_dict(bad)
    with pytest.raises(InvalidParameterError, match="same precision"):
        _opt("adam", AdamParams(), "cpu", Precision(state_dtype="bfloat16")).load_state_dict(sd)
    with pytest.raises(InvalidParameterError, match="slots"):  # without its format entry: read as float32 state
        _opt("adam", AdamParams(), "cpu", precision).load_state_dict({k: v for k, v in sd.items() if k != "format"})
    after = a.state_dict()
    assert after["step"] == before["step"]
    for x, y in zip(before["state"], after["state"]):
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_bad_steps_change_nothing(rng):
    opt = _opt("adamw", AdamParams(), "cpu", Precision(master_weights="remainder8", state_dtype="int8"))
    params = _arrays(rng, BF16)
    opt.step_gpu(params, _arrays(rng, BF16))
    before, sd = [p.copy() for p in params], opt.state_dict()
    with pytest.raises(ShapeMismatchError, match="float16"):
        opt.step_gpu(params, _arrays(rng, np.float16))
    with pytest.raises(ShapeMismatchError, match="format"):  # the state is bf16 + remainder8: float32 params refused
        opt.step_gpu(_arrays(rng, np.float32), _arrays(rng, np.float32))
    with pytest.raises(ShapeMismatchError, match="like params\\[0\\]"):
        opt.step_gpu([params[0], params[1].astype(np.float16)], _arrays(rng, BF16))
    assert opt.step_count == 1
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(params, before))
    after = opt.state_dict()
    for x, y in zip(sd["state"], after["state"]):
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_format_rules_raise_before_anything(rng):
    params = _arrays(rng, np.float16)
    with pytest.raises(InvalidParameterError, match="remainder8.*float16"):
        _opt("adam", AdamParams(), "cpu", Precision(master_weights="remainder8")).step_gpu(params, _arrays(rng, np.float16))
    with pytest.raises(UnsupportedOperationError, match="adafactor"):
        optirs.GpuAdafactor(config=GpuOptimizerConfig("cpu"), precision=Precision(state_dtype="int8")).step_gpu(
            _arrays(rng, np.float32), _arrays(rng, np.float32))
    with pytest.raises(InvalidParameterError, match="Precision"):
        optirs.GpuAdam(precision="int8")


def test_found_inf_skips_a_format_step(rng):
    opt = _opt("adamw", AdamParams(), "cpu", Precision(master_weights="remainder16"))
    params = _arrays(rng, BF16)
    before = [p.copy() for p in params]
    opt.step_gpu(params, _arrays(rng, BF16), found_inf=np.ones(1, np.int32))
    assert opt.step_count == 0 and all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(params, before))
    opt.step_gpu(params, _arrays(rng, BF16))
    assert opt.step_count == 1


def test_mixed_precision_runs_the_fused_format_step(rng):
    """MixedPrecisionOptimizer on a backend with the formats capability: float32 masters of the
    inner optimizer's format state, the non-finite check skipping the launch on its device flag."""
    from optirs.core import reference
    from optirs.optim.mixed_precision import MixedPrecisionConfig, MixedPrecisionOptimizer

    hp = AdamParams(lr=1e-2)
    opt = MixedPrecisionOptimizer(optirs.GpuAdam(hp, GpuOptimizerConfig("cpu")),
                                  MixedPrecisionConfig("bfloat16", init_scale=1.0, dynamic=False))
    params = _arrays(rng, BF16)
    start = [p.astype(np.float32) for p in params]
    grads = [_arrays(rng, BF16, 0.1) for _ in range(3)]
    poisoned = [g.copy() for g in grads[1]]
    poisoned[0].reshape(-1)[7] = np.inf
    assert opt.step_gpu(params, poisoned) is False  # a skipped first step leaves everything fresh
    assert opt.step_count == 0 and opt.inner.state_dict()["state"] == []
    assert all(np.array_equal(p.astype(np.float32), s) for p, s in zip(params, start))
    for g in grads:
        assert opt.step_gpu(params, g) is True
    assert opt.inner.state_dict()["format"]["master"] == "float32"
    ref, _ = reference.run("adam", start, [[x.astype(np.float32) for x in g] for g in grads], hp)
    for m, r, p in zip(opt.master_weights(), ref, params):
        np.testing.assert_allclose(m, r, rtol=2e-5, atol=2e-6)
        assert np.array_equal(p.view(np.uint16), m.astype(BF16).view(np.uint16))
    before = [p.copy() for p in params]
    assert opt.step_gpu(params, poisoned) is False and opt.step_count == 3
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(params, before))


# ---------------------------------------------------------------- describe() of torch CUDA bfloat16 tensors


def _fake_torch_cuda_bf16(shape, pointer):
    """An object with a torch CUDA bfloat16 tensor's interface: its __cuda_array_interface__ raises
    TypeError as torch's does for bfloat16; its int16 view exports the same memory."""
    torch = pytest.importorskip("torch")

    class View:
        def __init__(self, dtype):
            assert dtype is torch.int16
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (pointer, False),
                                             "strides": None, "version": 3}

    class Tensor:
        dtype = torch.bfloat16
        is_cuda = True

        @property
        def __cuda_array_interface__(self):
            raise TypeError("Got unsupported ScalarType BFloat16")

        def view(self, dtype):
            return View(dtype)

    Tensor.__module__ = "torch"
    return Tensor()


def test_describe_takes_torch_cuda_bfloat16_through_its_int16_view():
    from optirs.core.arrays import describe

    meta = describe(_fake_torch_cuda_bf16((3, 5), 0x10000), "params[0]")
    assert meta.kind == "cuda" and meta.shape == (3, 5) and meta.contiguous and meta.writeable
    assert meta.dtype == np.dtype(ml_dtypes.bfloat16)  # the meta keeps bfloat16, not the view's int16
    assert meta.address == 0x10000 and meta.memory == ("cuda", 0x10000, 0x10000 + 30)
    from optirs.core.formats import dtype_name

    assert dtype_name(meta.dtype) == "bfloat16"


def test_describe_refuses_an_exporter_that_raises_with_optirs_error():
    from optirs.core.arrays import describe

    class Refuses:
        @property
        def __cuda_array_interface__(self):
            raise TypeError("no typestr for this dtype")

    with pytest.raises(InvalidParameterError, match="refuses __cuda_array_interface__"):
        describe(Refuses(), "params[0]")
