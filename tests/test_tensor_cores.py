"""Tensor-core planning: the precision table (cross-checked with numba-cuda's own capability
properties), layout padding (hypothesis, and exact GEMMs with numpy), precision choice, AMP glue."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import optirs
from optirs.analysis import tensor_cores as tc
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.plugin.hookspecs import DeviceInfo
from optirs.optim.mixed_precision import MixedPrecisionOptimizer
from optirs.analysis.tensor_cores import Precision as P

KNOWN = [(7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]


def numba_device_property(name, cc):
    """numba-cuda's Device.supports_* property evaluated for a compute capability (no GPU needed)."""
    from numba.cuda.cudadrv.driver import Device

    return getattr(Device, name).fget(types.SimpleNamespace(compute_capability=cc))


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="numba's Device class is not part of the simulator; the normal pass checks it")
@pytest.mark.parametrize("cc", KNOWN + [(6, 1), (5, 2)])
def test_precision_table_agrees_with_numba_cuda(cc):
    precisions = tc.tensor_core_precisions(cc)
    assert (P.BF16 in precisions) == numba_device_property("supports_bfloat16", cc)
    assert (P.FP8_E4M3 in precisions) == (P.FP8_E5M2 in precisions) == numba_device_property("supports_fp8", cc)
    assert (P.FP16 in precisions) == (cc >= (7, 0))
    assert (P.TF32 in precisions) == (cc >= (8, 0))  # TF32 arrived with Ampere, like bf16
    assert P.FP32 not in precisions


def test_table_lookup_rules():
    assert tc.architecture((8, 7)) is tc.ARCHITECTURES[(8, 6)]  # an unlisted minor inherits the lower one
    assert tc.architecture((6, 1)) is tc.NO_TENSOR_CORES and not tc.tensor_core_precisions("6.1")
    assert tc.supports((9, 0), "fp64") and not tc.supports((8, 6), P.FP64)
    assert tc.supports((10, 0), "FP4") and not tc.supports((9, 0), "fp4")
    for cc in [(11, 0), (13, 0)]:
        with pytest.raises(InvalidParameterError, match=f"{cc[0]}.{cc[1]} is not in the tensor-core table"):
            tc.architecture(cc)
    with pytest.raises(InvalidParameterError, match="precision='fp12'"):
        tc.supports((9, 0), "fp12")


def test_compute_capability_inputs():
    assert tc.compute_capability((9, 0)) == tc.compute_capability("9.0") == (9, 0)
    assert tc.compute_capability(types.SimpleNamespace(compute_capability=(8, 6))) == (8, 6)
    assert tc.compute_capability(DeviceInfo("H200", "gpu", details={"compute_capability": (9, 0)})) == (9, 0)
    for bad in ["nine", (9,), (9, -1), 9.0, (True, 0)]:
        with pytest.raises(InvalidParameterError, match="expected \\(major, minor\\)"):
            tc.compute_capability(bad)


@pytest.mark.parametrize("cc", KNOWN)
def test_tile_multiples(cc):
    for p in tc.tensor_core_precisions(cc):
        aligned = tc.tile_multiples(p, cc, "aligned")
        inst = tc.tile_multiples(p, cc, "instruction")
        pref = tc.tile_multiples(p, cc, "preferred")
        # 16 bytes: the smallest element count whose bits fill whole 16-byte units
        # the fewest elements that fill whole 16-byte units
        assert aligned.k * p.bits % 128 == 0 and all((c * p.bits) % 128 for c in range(1, aligned.k))
        assert aligned.m == aligned.n == aligned.k
        for got, a, i in zip((pref.m, pref.n, pref.k), (aligned.m, aligned.n, aligned.k), (inst.m, inst.n, inst.k)):
            assert got % a == 0 and got % i == 0
        if cc >= (8, 0):
            assert pref.k * p.bits % 1024 == 0  # 128 bytes along K
    assert tc.tile_multiples("fp16", (8, 0), "aligned") == tc.TileMultiples(8, 8, 8)
    assert tc.tile_multiples("fp16", (7, 0), "instruction") == tc.TileMultiples(8, 8, 4)  # Volta's m8n8k4
    with pytest.raises(UnsupportedOperationError, match="bf16 has no tensor-core path on compute capability 7.5"):
        tc.tile_multiples("bf16", (7, 5))
    with pytest.raises(InvalidParameterError, match="mode='best'"):
        tc.tile_multiples("fp16", (8, 0), "best")


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 5000), n=st.integers(1, 5000), k=st.integers(1, 5000),
       cc=st.sampled_from(KNOWN), mode=st.sampled_from(tc.LAYOUT_MODES), pick=st.integers(0, 100))
def test_optimize_layout_pads_minimally(m, n, k, cc, mode, pick):
    precisions = sorted(tc.tensor_core_precisions(cc), key=lambda p: p.value)
    p = precisions[pick % len(precisions)]
    lay = tc.optimize_layout(m, n, k, p, cc, mode)
    t = lay.multiples
    for dim, padded, q in ((m, lay.padded_m, t.m), (n, lay.padded_n, t.n), (k, lay.padded_k, t.k)):
        assert padded % q == 0 and dim <= padded < dim + q
    assert lay.flop_overhead == pytest.approx(lay.padded_m * lay.padded_n * lay.padded_k / (m * n * k) - 1)
    assert lay.needs_padding == (lay.flop_overhead > 0)
    assert lay.memory_overhead >= 0


def test_padded_gemm_equals_the_original(rng):
    a = rng.integers(-50, 50, (37, 61)).astype(np.float64)  # integers: every sum is exact
    b = rng.integers(-50, 50, (61, 23)).astype(np.float64)
    ap, bp, lay = tc.pad_operands(a, b, "fp16", (9, 0))
    assert ap.shape == (lay.padded_m, lay.padded_k) and bp.shape == (lay.padded_k, lay.padded_n)
    assert lay.padded_k % 64 == 0 and lay.needs_padding
    np.testing.assert_array_equal((ap @ bp)[:37, :23], a @ b)
    assert not (ap @ bp)[37:].any() and not (ap @ bp)[:, 23:].any()
    with pytest.raises(InvalidParameterError, match="expected \\(m, k\\) and \\(k, n\\)"):
        tc.pad_operands(a, a, "fp16", (9, 0))
    with pytest.raises(InvalidParameterError, match="m=0"):
        tc.optimize_layout(0, 4, 4, "fp16", (9, 0))


@pytest.mark.parametrize("cc,purpose,expected,scaling", [
    ((7, 0), "training", P.FP16, True), ((7, 5), "training", P.FP16, True), ((8, 0), "training", P.BF16, False),
    ((9, 0), "training", P.BF16, False), ((6, 1), "training", P.FP32, False),
    ((9, 0), "inference", P.FP8_E4M3, False), ((8, 0), "inference", P.INT8, False),
    ((7, 0), "inference", P.FP16, True), ((12, 0), "inference", P.FP8_E4M3, False),
])
def test_select_precision(cc, purpose, expected, scaling):
    choice = tc.select_precision(cc, purpose)
    assert choice.precision is expected and choice.needs_loss_scaling is scaling
    assert expected.value in choice.reason
    assert choice.precision is P.FP32 or choice.precision in tc.tensor_core_precisions(cc)


def test_select_precision_with_preferences():
    c = tc.select_precision((8, 6), prefer=["fp8_e4m3", "tf32", "fp16"])
    assert c.precision is P.TF32 and "fp8_e4m3 not available" in c.reason
    assert tc.select_precision((7, 0), prefer=["bf16"]).precision is P.FP32
    with pytest.raises(InvalidParameterError, match="purpose='serving'"):
        tc.select_precision((9, 0), "serving")
    with pytest.raises(InvalidParameterError, match="prefer=\\[\\]"):
        tc.select_precision((9, 0), prefer=[])


def test_amp_plans():
    fp16 = tc.amp_plan((7, 0))
    ref = torch.amp.GradScaler("cpu")
    assert fp16.config.param_dtype == np.float16 and fp16.config.dynamic
    assert fp16.scaler.scale == ref.get_scale() and fp16.scaler.growth_interval == ref.get_growth_interval()
    bf16 = tc.amp_plan((9, 0))
    assert bf16.config.is_bfloat16 and bf16.scaler.scale == 1.0 and not bf16.config.dynamic
    assert tc.amp_plan((9, 0), growth_interval=10, dynamic=True).scaler.dynamic
    fp32 = tc.amp_plan((6, 1))
    assert fp32.config is None and fp32.scaler is None
    inner = optirs.GpuSgd(optirs.SgdParams(lr=0.1), config=optirs.GpuOptimizerConfig("cpu"))
    assert fp32.wrap(inner) is inner
    assert fp32.update(False) and not fp32.update(True)
    with pytest.raises(InvalidParameterError, match="needs no loss scaling"):
        tc.amp_plan((6, 1), init_scale=2.0)
    with pytest.raises(UnsupportedOperationError, match="fp8_e4m3 training"):
        tc.amp_plan((9, 0), prefer=["fp8_e4m3"])


def test_amp_plan_drives_a_mixed_precision_step(rng):
    """The fp16 plan's scaler is the wrapped optimizer's: scaling, skipping and backoff line up."""
    plan = tc.amp_plan((7, 5), init_scale=256.0)
    opt = plan.wrap(optirs.GpuSgd(optirs.SgdParams(lr=0.5), config=optirs.GpuOptimizerConfig("cpu")))
    assert isinstance(opt, MixedPrecisionOptimizer) and opt.scaler is plan.scaler
    p = np.ones(8, np.float16)
    true_grad = rng.standard_normal(8).astype(np.float32)
    scaled = (plan.scale_loss(np.float32(1.0)) * true_grad).astype(np.float16)  # grads of the scaled loss
    assert opt.step_gpu(p, scaled)
    expected = np.float32(1.0) - np.float32(0.5) * (scaled.astype(np.float32) * plan.scaler.inv_scale)
    np.testing.assert_array_equal(p, expected.astype(np.float16))
    scaled[3] = np.inf
    assert not opt.step_gpu(p, scaled) and plan.scaler.scale == 128.0
    grads32, found = plan.unscale([scaled])
    assert found and grads32[0].dtype == np.float32


def test_device_entry_points_say_why():
    import numba.cuda

    assert not any("mma" in name.lower() for name in dir(numba.cuda))  # the reason still holds
    with pytest.raises(UnsupportedOperationError, match="no wmma/mma"):
        tc.tensor_core_gemm(np.ones((16, 16)), np.ones((16, 16)))
    with pytest.raises(UnsupportedOperationError, match="memory-bound"):
        tc.fused_adam_tensor_core()
