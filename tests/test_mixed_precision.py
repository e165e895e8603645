"""Mixed precision: half conversions (numpy, torch, struct), GradScaler semantics (torch), and
half/bfloat16 optimizer steps against reference.py applied to the float32 master weights."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import optirs
import optirs.core.arrays
from optirs.core import reference
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError, ShapeMismatchError
from optirs.backends.cpu.mixed_precision import decode_bits, encode_bits
from optirs.core.errors import UnsupportedOperationError
from optirs.optim.mixed_precision import (DynamicLossScaler, MixedPrecisionConfig, MixedPrecisionOptimizer, OverflowStats,
                                          f16_bits_to_f32, f32_to_f16_bits)
from optirs.optim.optimizers import OPTIMIZERS
from optirs.plugin.hookspecs import StepSupport, hookimpl

import conftest
from conftest import THIRD_PARTY_BACKEND, FakeHostBackend, from_backend_array

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}

# float32 bit patterns at every boundary the conversions have (signed zero, inf, NaNs of both
# kinds, the float16 overflow tie 65520, the normal/subnormal border, the underflow tie 2**-25, ...).
EDGE_BITS = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                      0xFF800001, 0x7FBFFFFF, 0x7F802000, 0x477FF000, 0x477FEFFF, 0x477FF001, 0x477FE000,
                      0x38800000, 0x387FFFFF, 0x38801000, 0x33000000, 0x33000001, 0x337FFFFF, 0x33800000,
                      0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF,
                      0x3F800001, 0x3F801000, 0x3F803000], dtype=np.uint32)


def float32_bit_samples(rng, n):
    """Random float32 patterns: uniform over all bits, dense near the float16 range, and the edges."""
    anywhere = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    near_half = rng.integers(0x32000000, 0x48000000, size=n).astype(np.uint32)
    return np.concatenate([anywhere, near_half, near_half | np.uint32(0x80000000), EDGE_BITS])


# ----------------------------------------------------------------------------- host conversions


def test_f32_to_f16_bits_matches_numpy_torch_and_struct(rng):
    bits = float32_bit_samples(rng, 100_000)
    values = bits.view(np.float32)
    got = f32_to_f16_bits(values)
    assert got.dtype == np.uint16 and got.shape == values.shape
    with np.errstate(all="ignore"):
        assert np.array_equal(got, values.astype(np.float16).view(np.uint16))
    # torch is an independent implementation: equal bits except NaN payloads, NaN where NaN.
    tbits = torch.from_numpy(values.copy()).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(got[~nan], tbits[~nan])
    assert np.all((got[nan] & 0x7C00) == 0x7C00) and np.all((got[nan] & 0x3FF) != 0)
    # Python's struct 'e' format (IEEE half, round half to even) for the finite edges.
    for v in EDGE_BITS.view(np.float32):
        if np.isfinite(v) and abs(float(v)) < 65520.0:
            assert int(f32_to_f16_bits(v)) == struct.unpack("<H", struct.pack("<e", float(v)))[0], float(v)


def test_f32_to_f16_bits_scalars_and_shapes():
    assert isinstance(f32_to_f16_bits(1.0), np.uint16)
    assert int(f32_to_f16_bits(1.0)) == 0x3C00
    assert f32_to_f16_bits([[1.0, -2.0], [0.5, 65504.0]]).shape == (2, 2)
    # A Python float is rounded to float32 first, as the name says.
    x = 1.0 + 2.0**-11 + 2.0**-30  # above the float16 tie, but its float32 is the tie itself
    assert int(f32_to_f16_bits(x)) == int(np.float32(x).astype(np.float16).view(np.uint16))
    with pytest.raises(InvalidParameterError, match="expected real numbers"):
        f32_to_f16_bits("one")


def test_f16_bits_to_f32_all_65536_values():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = f16_bits_to_f32(bits)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))
    ref = torch.from_numpy(bits.view(np.int16).copy()).view(torch.float16).float().numpy()
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    # Round trip: every half value comes back to its own bits.
    assert np.array_equal(f32_to_f16_bits(got), bits)


def test_f16_bits_to_f32_rejects_bad_bits():
    assert isinstance(f16_bits_to_f32(0x3C00), np.float32) and f16_bits_to_f32(0x3C00) == 1.0
    with pytest.raises(InvalidParameterError, match="0..65535"):
        f16_bits_to_f32([1, 70000])
    with pytest.raises(InvalidParameterError, match="0..65535"):
        f16_bits_to_f32(-1)
    with pytest.raises(InvalidParameterError, match="integer bit patterns"):
        f16_bits_to_f32(np.array([1.5]))


# ----------------------------------------------------------------------------- kernel conversions


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_kernel_rounding_matches_numpy_and_ml_dtypes_bit_for_bit(rng, name):
    """The integer rounding the kernels use, against numpy float16 / ml_dtypes bfloat16, NaN payloads included."""
    values = float32_bit_samples(rng, 200_000).view(np.float32)
    with np.errstate(all="ignore"):
        ref = values.astype(DTYPES[name]).view(np.uint16)
    assert np.array_equal(encode_bits(values, name), ref)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_kernel_decoding_all_65536_values(name):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ref = bits.view(DTYPES[name]).astype(np.float32)
    got = decode_bits(bits, name)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))


# ----------------------------------------------------------------------------- loss scaling


def torch_update_trace(found_infs, init, growth, backoff, interval):
    scale = torch.tensor([init], dtype=torch.float32)
    tracker = torch.zeros(1, dtype=torch.int32)
    trace = []
    for inf in found_infs:
        torch._amp_update_scale_(scale, tracker, torch.tensor([1.0 if inf else 0.0]), growth, backoff, interval)
        trace.append((float(scale[0]), int(tracker[0])))
    return trace


@pytest.mark.parametrize("init,growth,backoff,interval,p_inf", [
    (2.0**16, 2.0, 0.5, 3, 0.3),
    (2.0**16, 2.0, 0.5, 1, 0.5),
    (1000.0, 1.7, 0.37, 4, 0.2),  # factors that are not powers of two: float32 rounding must match
    (3.0e38, 2.0, 0.5, 2, 0.1),  # growth beyond float32 max is refused
    (1.0, 1.001, 0.999, 2, 0.4),
])
def test_scale_sequence_matches_torch_amp_update_scale(rng, init, growth, backoff, interval, p_inf):
    pattern = list(rng.random(300) < p_inf)
    scaler = DynamicLossScaler(init, growth, backoff, interval)
    ours = []
    for inf in pattern:
        assert scaler.update(inf) is (not inf)
        ours.append((scaler.scale, scaler.growth_tracker))
    assert ours == torch_update_trace(pattern, init, growth, backoff, interval)
    assert scaler.stats.skipped_steps == sum(pattern) and scaler.stats.steps == len(pattern)


def test_defaults_are_gradscalers():
    ref = torch.amp.GradScaler("cpu")
    ours = DynamicLossScaler()
    assert ours.scale == ref.get_scale() == 2.0**16
    assert (ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        ref.get_growth_factor(), ref.get_backoff_factor(), ref.get_growth_interval())


def test_against_torch_gradscaler_training_loop(rng):
    """A real torch.amp.GradScaler + SGD loop with injected overflows: same scales, same skipped steps."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    gs = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    ours = DynamicLossScaler(init_scale=256.0, growth_interval=3)
    for inf in rng.random(40) < 0.25:
        opt.zero_grad()
        loss = (w * torch.arange(4.0)).sum() * (float("inf") if inf else 1.0)
        gs.scale(loss).backward()
        before = w.detach().clone()
        gs.step(opt)
        gs.update()
        torch_skipped = bool(torch.equal(before, w.detach()))
        assert ours.update(inf) is (not torch_skipped)
        assert ours.scale == gs.get_scale()


def reference_scaler(found_infs, init, growth, backoff, interval, hysteresis, lo, hi):
    """Megatron-LM's DynamicGradScaler rule with a max, written out for the test."""
    scale, growth_tracker, hyst, out = init, 0, hysteresis, []
    for inf in found_infs:
        if inf:
            growth_tracker, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(float(np.float32(scale * backoff)), lo)
        else:
            growth_tracker += 1
            if growth_tracker == interval:
                growth_tracker, hyst = 0, hysteresis
                scale = min(float(np.float32(scale * growth)), hi)
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis,lo,hi", [(1, 2.0**10, 2.0**18), (3, 1.0, 2.0**20), (2, 2.0**14, 2.0**16)])
def test_hysteresis_min_max(rng, hysteresis, lo, hi):
    pattern = list(rng.random(400) < 0.35)
    scaler = DynamicLossScaler(2.0**16, 2.0, 0.5, 2, hysteresis=hysteresis, min_scale=lo, max_scale=hi)
    got = []
    for inf in pattern:
        applied = scaler.update(inf)
        assert applied is (not inf)  # hysteresis delays the backoff, never the skip
        got.append(scaler.scale)
    assert got == reference_scaler(pattern, 2.0**16, 2.0, 0.5, 2, hysteresis, lo, hi)
    assert min(got) >= lo and max(got) <= hi


def test_overflow_stats_and_static_scaling():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, dynamic=False)
    for inf in [False, True, True, False, False, False, True]:
        s.update(inf)
    assert s.scale == 8.0
    st = s.stats
    assert (st.steps, st.skipped_steps, st.applied_steps, st.max_consecutive_skipped, st.consecutive_skipped,
            st.last_overflow_step) == (7, 3, 4, 2, 1, 7)
    assert st.skip_rate == pytest.approx(3 / 7) and st.backoffs == 0 and st.growths == 0
    d = DynamicLossScaler(init_scale=8.0, growth_interval=1)
    d.update(False), d.update(True), d.update(True)
    assert (d.stats.growths, d.stats.backoffs, d.scale) == (1, 2, 4.0)
    assert OverflowStats().skip_rate == 0.0


def test_scaler_helpers_and_state_dict(rng):
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    grads = [rng.standard_normal(5).astype(np.float16) * np.float16(1024)]
    out, inf = s.unscale(grads)
    assert not inf and out[0].dtype == np.float32
    np.testing.assert_array_equal(out[0], grads[0].astype(np.float32) * np.float32(1 / 1024))
    assert s.unscale([np.array([np.inf], np.float16)])[1]
    assert s.scale_loss(np.float32(0.5)) == 512.0
    s.update(False)
    t = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    t.load_state_dict(s.state_dict())
    for inf in [False, True, False, False]:
        assert s.update(inf) == t.update(inf)
        assert s.scale == t.scale
    with pytest.raises(InvalidParameterError, match="growth_tracker=5"):
        t.load_state_dict({**s.state_dict(), "growth_tracker": 5})


@pytest.mark.parametrize("kwargs,match", [
    ({"init_scale": 0.0}, "init_scale=0.0"), ({"init_scale": float("inf")}, "init_scale=inf"),
    ({"growth_factor": 1.0}, "growth_factor=1.0, expected growth_factor > 1"),
    ({"backoff_factor": 1.0}, "backoff_factor=1.0"), ({"growth_interval": 0}, "growth_interval=0"),
    ({"hysteresis": 0}, "hysteresis=0"), ({"min_scale": 2.0**20}, "min_scale="),
    ({"max_scale": 1.0}, "max_scale=1.0"), ({"growth_interval": 2.5}, "growth_interval=2.5"),
    ({"dynamic": 1}, "dynamic=1"),
])
def test_bad_scaler_arguments(kwargs, match):
    with pytest.raises(InvalidParameterError, match=re.escape(match)):
        DynamicLossScaler(**kwargs)
    with pytest.raises(InvalidParameterError, match=re.escape(match)):
        MixedPrecisionConfig(**kwargs)


def test_config_dtypes():
    assert MixedPrecisionConfig("bfloat16").param_dtype == BF16
    assert MixedPrecisionConfig(ml_dtypes.bfloat16).is_bfloat16
    assert MixedPrecisionConfig(np.float16).param_dtype == np.float16
    with pytest.raises(InvalidParameterError, match="param_dtype='float32'"):
        MixedPrecisionConfig("float32")


# ----------------------------------------------------------------------------- optimizer steps

SHAPES = [(9, 7), (130,), (1,), (2, 3, 4)]
CASES = [
    ("adam", optirs.AdamParams(lr=1e-2, weight_decay=0.01)),
    ("adamw", optirs.AdamParams(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("sgd", optirs.SgdParams(lr=0.05, momentum=0.9, nesterov=True)),
    ("rmsprop", optirs.RmspropParams(lr=1e-2, momentum=0.5, centered=True)),
    ("adagrad", optirs.AdagradParams(lr=0.1)),
    ("lamb", optirs.LambParams(lr=1e-2, max_grad_norm=1.0)),
]


def to_backend_array(backend, host):
    """The backend's own array kind holding ``host``; the numpy example backend takes numpy arrays."""
    return host.copy() if backend == THIRD_PARTY_BACKEND else conftest.to_backend_array(backend, host)


def require_in_place(backend):
    """The master weights are the backend's device arrays, handed to the inner optimizer in place."""
    if not optirs.get_backend(backend).supports("mixed_precision"):
        pytest.skip(f"the {backend} backend has no mixed_precision capability (test_backend_without_the_hooks_is_refused)")
    try:
        optirs.core.arrays.describe(to_backend_array(backend, np.zeros(1, np.float32)))
    except InvalidParameterError as exc:
        pytest.skip(f"optirs.core.arrays.describe does not accept this backend's device arrays yet: {exc}")


@pytest.fixture
def simulator_arrays(monkeypatch):
    """Under the CUDA simulator, let the optimizers' validation describe the simulator's device
    arrays (optirs.core.arrays.describe does not know them yet: a core change is requested), so the
    whole cuda path runs here."""
    if not (os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"):
        return
    import optirs.optim.optimizers as optimizers_module

    original = optimizers_module.describe

    def describe(array, what="array"):
        if type(array).__name__ == "FakeCUDAArray":
            host = array._ary
            return optirs.core.arrays.ArrayMeta("cuda", host.shape, host.dtype, bool(host.flags.c_contiguous), True,
                                           host.__array_interface__["data"][0])
        return original(array, what)

    monkeypatch.setattr(optimizers_module, "describe", describe)
    monkeypatch.setattr(optirs.core.arrays, "describe", describe)


def make_opt(backend, name, hp, dtype, **cfg):
    require_in_place(backend)
    inner = OPTIMIZERS[name](hp, config=optirs.GpuOptimizerConfig(backend=backend))
    return MixedPrecisionOptimizer(inner, MixedPrecisionConfig(dtype, **cfg))


def half_problem(rng, dtype, steps, scale_hint=64.0):
    params = [rng.standard_normal(s).astype(DTYPES[dtype]) for s in SHAPES]
    grads = [[(rng.standard_normal(s) * scale_hint).astype(DTYPES[dtype]) for s in SHAPES] for _ in range(steps)]
    return params, grads


def expected_half(master, dtype):
    return [m.astype(DTYPES[dtype]).view(np.uint16) for m in master]


# The optimizers the third-party numpy example implements run on it too (feature_backend).
FEATURE_CASES = [c for c in CASES if c[0] in ("adam", "sgd")]
BACKEND_CASES = [c for c in CASES if c not in FEATURE_CASES]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,hp", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_half_steps_follow_reference_on_master_weights(feature_backend, rng, dtype, name, hp, simulator_arrays):
    check_half_steps(feature_backend, rng, dtype, name, hp)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,hp", BACKEND_CASES, ids=[c[0] for c in BACKEND_CASES])
def test_half_steps_of_other_optimizers_follow_reference(backend, rng, dtype, name, hp, simulator_arrays):
    check_half_steps(backend, rng, dtype, name, hp)


def check_half_steps(backend, rng, dtype, name, hp):
    steps = 4
    params, grads = half_problem(rng, dtype, steps)
    opt = make_opt(backend, name, hp, dtype, init_scale=64.0, growth_interval=2, growth_factor=1.5)
    dev = [to_backend_array(backend, p) for p in params]
    master = [p.astype(np.float64) for p in params]  # widening half -> float32 is exact
    state = [{} for _ in params]
    for k in range(steps):
        inv = opt.scaler.inv_scale  # the scale changes after step 2: unscaling must follow it
        unscaled = [g.astype(np.float32) * inv for g in grads[k]]
        assert opt.step_gpu(dev, [to_backend_array(backend, g) for g in grads[k]]) is True
        master, state = DEFINITIONS[name].reference(master, unscaled, state, hp, k + 1)
        got = opt.master_weights()
        for g, r in zip(got, master):
            np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6)
        # The parameters are the master weights rounded to nearest even, bit for bit.
        for p, e in zip(dev, expected_half(got, dtype)):
            assert np.array_equal(from_backend_array(p).view(np.uint16), e)
    assert opt.step_count == steps and opt.scaler.scale == 64.0 * 1.5**2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_overflow_skips_everything(feature_backend, rng, dtype, bad, simulator_arrays):
    backend = feature_backend
    params, grads = half_problem(rng, dtype, 3)
    opt = make_opt(backend, "adam", optirs.AdamParams(lr=1e-2), dtype, init_scale=1024.0)
    dev = [to_backend_array(backend, p) for p in params]
    assert opt.step_gpu(dev, [to_backend_array(backend, g) for g in grads[0]])
    before_p = [from_backend_array(p) for p in dev]
    before_master = opt.master_weights()
    before_state = opt.inner.state_dict()
    poisoned = [g.copy() for g in grads[1]]
    poisoned[-1].reshape(-1)[5] = bad
    assert opt.step_gpu(dev, [to_backend_array(backend, g) for g in poisoned]) is False
    for p, b in zip(dev, before_p):
        assert np.array_equal(from_backend_array(p).view(np.uint16), b.view(np.uint16))
    for m, b in zip(opt.master_weights(), before_master):
        assert np.array_equal(m, b)
    after_state = opt.inner.state_dict()
    assert after_state["step"] == before_state["step"] == 1 and opt.step_count == 1
    for a, b in zip(after_state["state"], before_state["state"]):
        for k in a:
            assert np.array_equal(a[k], b[k])
    assert opt.scaler.scale == 512.0 and opt.scaler.stats.skipped_steps == 1
    # The next clean step is step 2 of the reference, unscaled by the backed-off scale.
    inv = opt.scaler.inv_scale
    assert opt.step_gpu(dev, [to_backend_array(backend, g) for g in grads[2]])
    hp = optirs.AdamParams(lr=1e-2)
    ref, _ = reference.run("adam", [p.astype(np.float32) for p in params],
                           [[g.astype(np.float32) * np.float32(1 / 1024) for g in grads[0]],
                            [g.astype(np.float32) * inv for g in grads[2]]], hp)
    for g, r in zip(opt.master_weights(), ref):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6)


def test_overflow_from_scaling_itself(rng):
    """A finite half gradient whose unscaled value overflows float32 is caught too (scale < 1)."""
    opt = make_opt("cpu", "sgd", optirs.SgdParams(lr=0.1), "float16", init_scale=1e-38, dynamic=False)
    p = np.ones(4, np.float16)
    assert opt.step_gpu(p, np.full(4, 60000.0, np.float16)) is False
    assert np.array_equal(p, np.ones(4, np.float16))


def test_bad_inputs_change_nothing(rng):
    params, grads = half_problem(rng, "float16", 2)
    opt = make_opt("cpu", "adam", optirs.AdamParams(), "float16")
    assert opt.step_gpu(params, grads[0])
    snapshot = [p.copy() for p in params], opt.master_weights(), opt.scaler.state_dict()
    bad_cases = [
        (params, [g.astype(np.float32) for g in grads[1]], ShapeMismatchError, "dtype float32, expected float16"),
        ([p.astype(BF16) for p in params], grads[1], ShapeMismatchError, "dtype bfloat16"),
        (params, grads[1][:-1], ShapeMismatchError, "4 params and 3 grads"),
        (params[:-1], grads[1][:-1], ShapeMismatchError, "the parameter list changed"),
        (params, [grads[1][1], grads[1][0], *grads[1][2:]], ShapeMismatchError, "grads[0] has shape"),
        ([params[0], params[0], *params[2:]], grads[1], ShapeMismatchError, "grads[1] has shape"),
        (params, [g.tolist() for g in grads[1]], InvalidParameterError, "expected a numpy array"),
    ]
    for ps, gs, err, match in bad_cases:
        with pytest.raises(err, match=re.escape(match)):
            opt.step_gpu(ps, gs)
    ro = [p.copy() for p in params]
    ro[2].flags.writeable = False
    with pytest.raises(ShapeMismatchError, match="read-only"):
        opt.step_gpu(ro, grads[1])
    assert all(np.array_equal(a, b) for a, b in zip(params, snapshot[0]))
    assert all(np.array_equal(a, b) for a, b in zip(opt.master_weights(), snapshot[1]))
    assert opt.scaler.state_dict() == snapshot[2] and opt.step_count == 1


def test_wrapper_arguments():
    with pytest.raises(InvalidParameterError, match="expected an optirs optimizer"):
        MixedPrecisionOptimizer(object())
    inner = optirs.GpuAdam(config=optirs.GpuOptimizerConfig("cpu"))
    inner.step_gpu(np.ones(3, np.float32), np.ones(3, np.float32))
    with pytest.raises(InvalidParameterError, match="expected a fresh optimizer"):
        MixedPrecisionOptimizer(inner)
    with pytest.raises(InvalidParameterError, match="expected a MixedPrecisionConfig"):
        MixedPrecisionOptimizer(optirs.GpuAdam(), config={"param_dtype": "float16"})


def test_state_dict_round_trip(rng):
    params, grads = half_problem(rng, "bfloat16", 5)
    a = make_opt("cpu", "adam", optirs.AdamParams(lr=1e-2), "bfloat16", init_scale=64.0, growth_interval=2)
    pa = [p.copy() for p in params]
    for g in grads[:2]:
        a.step_gpu(pa, g)
    sd = a.state_dict()
    b = make_opt("cpu", "adam", optirs.AdamParams(lr=1e-2), "bfloat16", init_scale=64.0, growth_interval=2)
    b.load_state_dict(sd)
    pb = [p.copy() for p in pa]
    for g in grads[2:]:
        assert a.step_gpu(pa, g) == b.step_gpu(pb, g)
    assert all(np.array_equal(x.view(np.uint16), y.view(np.uint16)) for x, y in zip(pa, pb))
    assert a.scaler.state_dict() == b.scaler.state_dict()
    with pytest.raises(InvalidParameterError, match="expected 'bfloat16'"):
        b.load_state_dict({**sd, "param_dtype": "float16"})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_capability_hooks_bit_for_bit(feature_backend, rng, dtype, simulator_arrays):
    """The two passes called through Backend.hook on several tensors at their layout offsets,
    against numpy float16 / ml_dtypes bfloat16."""
    from optirs.core.layout import TensorLayout

    require_in_place(feature_backend)
    backend = optirs.get_backend(feature_backend)
    unscale = backend.hook("mixed_precision", "optirs_mixed_precision_unscale")
    narrow = backend.hook("mixed_precision", "optirs_mixed_precision_narrow")
    describe = backend.hook("mixed_precision", "optirs_mixed_precision_describe")
    bf16, half = dtype == "bfloat16", DTYPES[dtype]
    inv = np.float32(1 / 64)
    bits = rng.integers(0, 65536, 4000).astype(np.uint16)
    finite = bits[np.isfinite(bits.view(half).astype(np.float32))][:1500]
    shapes = [(20, 25), (7,), (finite.size - 507,)]
    layout = TensorLayout(shapes)
    grads = [to_backend_array(feature_backend, g.view(half).reshape(s)) for g, s in zip(np.split(finite, [500, 507]), shapes)]
    meta = describe(backend.ctx, grads[0], "grads[0]", half)
    assert meta.dtype == half and tuple(meta.shape) == shapes[0] and meta.contiguous
    out = backend.alloc(backend.ctx, layout.total, np.float32, 0.0)
    assert unscale(backend.ctx, grads, out, layout, inv, bf16) is False
    ref = finite.view(half).astype(np.float32) * inv
    got = np.asarray(backend.to_host(backend.ctx, out))
    assert np.array_equal(np.concatenate([v.reshape(-1) for v in layout.views(got)]).view(np.uint32),
                          ref.view(np.uint32))
    poisoned = finite.copy()
    poisoned[503] = 0x7F80 if bf16 else 0x7C00  # +inf, in the middle tensor
    grads = [to_backend_array(feature_backend, g.view(half).reshape(s)) for g, s in zip(np.split(poisoned, [500, 507]), shapes)]
    assert unscale(backend.ctx, grads, out, layout, inv, bf16) is True
    masters = float32_bit_samples(rng, 600).view(np.float32)[-layout.total :]  # the edges are last
    params = [to_backend_array(feature_backend, np.zeros(s, half)) for s in shapes]
    narrow(backend.ctx, backend.to_device(backend.ctx, masters), params, layout, bf16)
    with np.errstate(all="ignore"):
        expected = np.concatenate([v.reshape(-1) for v in layout.views(masters)]).astype(half).view(np.uint16)
    got = np.concatenate([from_backend_array(p).reshape(-1).view(np.uint16) for p in params])
    assert np.array_equal(got, expected)
    with pytest.raises(InvalidParameterError, match=r"params\[1\] is a list"):
        describe(backend.ctx, [1.0], "params[1]", half)


class HostBackendWithSteps(FakeHostBackend):
    """A backend with every step a GpuAdam needs, but without the mixed_precision hooks."""

    @hookimpl
    def optirs_step_support(self):
        return StepSupport(optimizers=("adam",))

    @hookimpl
    def optirs_step(self, ctx, request):
        raise AssertionError("a refused mixed-precision step must not reach the optimizer")


def test_backend_without_the_hooks_is_refused(fresh_registry):
    """A backend that lacks the capability refuses the first step, naming itself and the capability."""
    optirs.register_plugin(HostBackendWithSteps(), "elsewhere")
    backend = optirs.get_backend("elsewhere")
    assert not backend.supports("mixed_precision") and optirs.get_backend("cpu").supports("mixed_precision")
    opt = MixedPrecisionOptimizer(optirs.GpuAdam(config=optirs.GpuOptimizerConfig("elsewhere")))
    p = np.ones(2, np.float16)
    with pytest.raises(UnsupportedOperationError, match=r"backend 'elsewhere' .*'mixed_precision'"):
        opt.step_gpu(p, np.ones(2, np.float16))
    assert np.array_equal(p, np.ones(2, np.float16))
    assert opt.master_weights() == [] and opt.step_count == 0 and opt.scaler.stats.steps == 0


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="CUDA kernels run here only in numba's simulator")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_kernels_in_simulator(rng, dtype):
    """The numba.cuda passes (unscale + flag, narrow) against numpy/ml_dtypes, in the simulator."""
    from numba import cuda

    from optirs.backends.cuda.mixed_precision import cuda_kernels

    k = cuda_kernels()
    g = (rng.standard_normal(300) * 100).astype(DTYPES[dtype])
    out = cuda.to_device(np.zeros(310, np.float32))
    found = cuda.to_device(np.zeros(1, np.int32))
    inv = np.float32(1 / 64)
    k.unscale[2, 256](cuda.to_device(g.view(np.uint16)), out, 10, inv, dtype == "bfloat16", found)
    host = out.copy_to_host()
    assert np.array_equal(host[10:], g.astype(np.float32) * inv) and found.copy_to_host()[0] == 0
    g[7] = np.nan
    k.unscale[2, 256](cuda.to_device(g.view(np.uint16)), out, 10, inv, dtype == "bfloat16", found)
    assert found.copy_to_host()[0] == 1
    master = np.concatenate([np.zeros(5, np.float32), float32_bit_samples(rng, 40).view(np.float32)])
    p = cuda.to_device(np.zeros(master.size - 5, np.uint16))
    k.narrow[1, 256](cuda.to_device(master.view(np.uint32)), p, 5, dtype == "bfloat16")
    with np.errstate(all="ignore"):
        assert np.array_equal(p.copy_to_host(), master[5:].astype(DTYPES[dtype]).view(np.uint16))


@pytest.mark.opencl
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_opencl_kernels_bit_for_bit(rng, dtype):
    """The OpenCL passes on every half pattern and on float32 edges/NaNs, against numpy/ml_dtypes."""
    status = {s.name: s for s in optirs.list_backends()}.get("opencl")
    if status is None or not status.available:
        pytest.skip("the opencl backend does not open here")
    import pyopencl as cl
    import pyopencl.array as cla

    from optirs.backends.opencl.mixed_precision import opencl_kernels

    ctx = optirs.get_backend("opencl").ctx
    k = opencl_kernels(ctx)
    bf16 = np.int32(dtype == "bfloat16")
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    g = cla.to_device(ctx.queue, bits)
    out = cla.zeros(ctx.queue, 65536 + 3, np.float32)
    inv = np.float32(1 / 8)
    cl.enqueue_fill_buffer(ctx.queue, k["found"], np.zeros(1, np.int32), 0, 4)
    k["unscale"](ctx.queue, (65536,), None, g.data, np.uint64(0), out.data, np.uint64(3), np.uint32(65536), inv,
                 bf16, k["found"])
    ref = bits.view(DTYPES[dtype]).astype(np.float32) * inv
    got = out.get()[3:]
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    found = np.zeros(1, np.int32)
    cl.enqueue_copy(ctx.queue, found, k["found"])
    assert found[0] == 1  # the inf and NaN patterns
    master = float32_bit_samples(rng, 20_000).view(np.float32)
    p = cla.zeros(ctx.queue, master.size, np.uint16)
    k["narrow"](ctx.queue, (master.size,), None, cla.to_device(ctx.queue, master.view(np.uint32)).data, np.uint64(0),
                p.data, np.uint64(0), np.uint32(master.size), bf16)
    with np.errstate(all="ignore"):
        assert np.array_equal(p.get(), master.astype(DTYPES[dtype]).view(np.uint16))


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="the simulator has no compiler")
def test_cuda_passes_compile_to_ptx_for_sm90(monkeypatch):
    """Both CUDA passes compile for the H200, in float32 and integer arithmetic only."""
    import types as pytypes

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, types

    from optirs.backends.cuda.mixed_precision import cuda_kernels

    if not cuda.is_available():  # device functions are compiled for the current device: name it
        monkeypatch.setattr(dispatcher, "get_current_device", lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    k = cuda_kernels()
    sigs = [(k.unscale, (types.uint16[::1], types.float32[::1], types.int64, types.float32, types.boolean, types.int32[::1])),
            (k.narrow, (types.uint32[::1], types.uint16[::1], types.int64, types.boolean))]
    for kernel, sig in sigs:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        assert ".target sm_90" in ptx and ".f64" not in ptx


def test_first_step_overflow_changes_nothing(feature_backend, rng):
    """An overflow on the very first step: no master weights are stepped, parameters untouched.
    (The inner optimizer is never called, so this runs the device passes in the simulator too.)"""
    backend = feature_backend
    params, grads = half_problem(rng, "float16", 1)
    inner = OPTIMIZERS["adam"](optirs.AdamParams(), config=optirs.GpuOptimizerConfig(backend=backend))
    opt = MixedPrecisionOptimizer(inner, MixedPrecisionConfig("float16", init_scale=8.0))
    dev = [to_backend_array(backend, p) for p in params]
    grads[0][0][0, 0] = np.inf
    assert opt.step_gpu(dev, [to_backend_array(backend, g) for g in grads[0]]) is False
    for p, h in zip(dev, params):
        assert np.array_equal(from_backend_array(p).view(np.uint16), h.view(np.uint16))
    for m, h in zip(opt.master_weights(), params):
        assert np.array_equal(m, h.astype(np.float32))
    assert opt.step_count == 0 and inner.state_dict()["state"] == [] and opt.scaler.scale == 4.0


def test_docs_examples_run():
    """Every python block of docs/mixed_precision.md runs."""
    text = (Path(__file__).parents[1] / "docs" / "mixed_precision.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/mixed_precision.md", "exec"), {})
