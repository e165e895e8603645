"""Step formats (issue 13, docs/formats.md): the records, the 8-bit map, the shared encodings and
every format x family on every backend with the ``formats`` capability, against the float64
reference of the format (optirs.core.formats_reference)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from optirs.core import formats as F
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.core.layout import TensorLayout

BF16 = ml_dtypes.bfloat16


# ---------------------------------------------------------------- options and their rules


@pytest.mark.parametrize("kwargs", [dict(master_weights="fp32"), dict(state_dtype="int4"), dict(state_dtype=None),
                                    dict(stochastic_rounding=1), dict(seed=1.5), dict(seed=True),
                                    dict(stochastic_rounding=True, master_weights="float32")])
def test_bad_precision_raises(kwargs):
    with pytest.raises(InvalidParameterError) as e:
        F.Precision(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(e.value)


def test_seed_is_taken_mod_2_32():
    assert F.Precision(seed=-1).seed == 2**32 - 1
    assert F.Precision(seed=2**32 + 5).seed == 5


def test_resolve_rules():
    P = F.Precision
    fmt = F.resolve_format(P(master_weights="remainder16"), np.float32, np.float32, "adam")
    assert fmt.master is None and fmt.plain  # float32 parameters are their own master
    fmt = F.resolve_format(P(master_weights="remainder8", state_dtype="int8"), BF16, np.float32, "adam")
    assert (fmt.param_dtype, fmt.grad_dtype, fmt.master, fmt.state_dtype) == ("bfloat16", "float32", "remainder8", "int8")
    assert fmt.codes == F.FormatCodes(F.BF16, F.F32, F.MASTER_R8, F.STATE_INT8, False)
    with pytest.raises(InvalidParameterError, match="remainder16.*float16"):
        F.resolve_format(P(master_weights="remainder16"), np.float16, np.float16, "adam")
    with pytest.raises(UnsupportedOperationError, match="float16"):
        F.resolve_format(P(stochastic_rounding=True), np.float16, np.float16, "sgd")
    with pytest.raises(InvalidParameterError, match="gradient dtype"):
        F.resolve_format(P(), BF16, np.float16, "adam")
    with pytest.raises(InvalidParameterError, match="float64"):
        F.resolve_format(P(), np.float64, np.float64, "adam")
    with pytest.raises(UnsupportedOperationError, match="adafactor"):
        F.resolve_format(P(state_dtype="bfloat16"), np.float32, np.float32, "adafactor")
    assert F.resolve_format(P(), np.float32, np.float32, "adafactor").plain
    with pytest.raises(InvalidParameterError, match="Precision"):
        F.resolve_format("int8", np.float32, np.float32, "adam")


def test_slot_signs_follow_the_contract():
    signed = {s.name: s.signed for d in DEFINITIONS.values() for s in d.slots}
    for name in ("exp_avg", "momentum_buffer", "grad_avg"):
        assert signed[name]
    for name in ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"):
        assert not signed[name]


# ---------------------------------------------------------------- the dynamic map


def _torchao_map(signed):
    qu = pytest.importorskip("torchao.optim.quant_utils", reason="torchao is not importable here")
    return np.array(qu.create_dynamic_map(signed), dtype=np.float32)


def _bnb_map(signed):
    try:
        from bitsandbytes.functional import create_dynamic_map
    except Exception as exc:  # bitsandbytes may fail to import without its native library
        pytest.skip(f"bitsandbytes is not importable here: {exc}")
    return create_dynamic_map(signed, 7, 8).numpy().astype(np.float32)


def _ulps(a, b):
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("peer", [_torchao_map, _bnb_map], ids=["torchao", "bitsandbytes"])
def test_dynamic_map_is_the_peers_map(signed, peer):
    """The same 256 codes as bitsandbytes' and torchao's create_dynamic_map, each within 2 float32
    ulps: theirs come from torch.linspace, whose rounding depends on the machine's vector width;
    ours is exact, rounded once (the contract's table, the same on every machine)."""
    ours, theirs = F.dynamic_map(signed), peer(signed)
    assert ours.shape == theirs.shape == (256,)
    assert np.all(np.diff(ours) > 0)
    assert np.sign(ours).tolist() == np.sign(theirs).tolist()
    assert _ulps(ours, theirs).max() <= 2
    assert ours[-1] == 1.0 and 0.0 in ours and (ours[0] == 0.0) != signed


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_exact(signed):
    """Each code is the correctly rounded float32 of the exact mean (checked in float64 here)."""
    q = F.dynamic_map(signed).astype(np.float64)
    exact = []
    for i in range(7):
        n = 2**i + 1 if signed else 2 ** (i + 1) + 1
        b = 0.1 + 0.9 * np.arange(n) / (n - 1)
        means = (b[:-1] + b[1:]) / 2 * 10.0 ** (i - 6)
        exact += list(means) + (list(-means) if signed else [])
    exact = np.sort(np.array(exact + [0.0, 1.0]))
    assert np.allclose(q, exact, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("signed", [True, False])
def test_block_quantization_matches_torchao(signed, rng):
    """Block absmax and codes as torchao's scale_tensor + quantize_8bit_with_qmap on CPU tensors
    (torchao rounds ties up where the contract rounds them down: a tie is a value exactly on a
    float32 midpoint, which random data does not hit)."""
    torch = pytest.importorskip("torch")
    qu = pytest.importorskip("torchao.optim.quant_utils", reason="torchao is not importable here")
    x = rng.standard_normal(64 * F.BLOCK).astype(np.float32) * np.float32(1e-3)
    if not signed:
        x = x * x
    blocks = x.reshape(-1, F.BLOCK)
    scale = np.abs(blocks).max(axis=1)
    ours = np.concatenate([F.quantize_host(b, s, signed) for b, s in zip(blocks, scale)])
    scaled, their_scale = qu.scale_tensor(torch.from_numpy(x), F.BLOCK)
    theirs = qu.quantize_8bit_with_qmap(scaled, torch.from_numpy(F.dynamic_map(signed).copy())).numpy()
    assert np.array_equal(their_scale.numpy(), scale)
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code_ties_down(signed):
    q, mid = F.dynamic_map(signed), F.map_midpoints(signed)
    codes = F.quantize_host(mid, np.float32(1), signed)  # exactly on a midpoint: the lower code
    assert codes.tolist() == list(range(255))
    above = np.nextafter(mid, np.float32(np.inf))
    assert F.quantize_host(above, np.float32(1), signed).tolist() == list(range(1, 256))
    assert F.quantize_host(q, np.float32(1), signed).tolist() == list(range(256))
    assert F.quantize_host(np.ones(3, np.float32), np.float32(0), signed).tolist() == [int(np.argmin(np.abs(q)))] * 3


# ---------------------------------------------------------------- the state layout


def _adam_slots(amsgrad=False):
    d = DEFINITIONS["adam"]
    return [s for s in d.slots if s.needed(type("hp", (), {"amsgrad": amsgrad})())]


def test_int8_layout_blocks_small_tensors_and_table():
    layout = TensorLayout([(4096,), (10,), (3, 2000), (4095,), (1, 1)])
    fmt = F.StepFormat("bfloat16", "bfloat16", "remainder8", "int8", False)
    st = F.FormatState(layout, _adam_slots(), fmt)
    blocks = [16, 0, 24, 0, 0]  # ceil(n / 256) for tensors of 4096 elements and more
    small = [0, 10, 0, 4095, 1]
    assert st.buffer_sizes() == {"exp_avg.codes": layout.total, "exp_avg.scales": 40, "exp_avg.small": 4106,
                                 "exp_avg_sq.codes": layout.total, "exp_avg_sq.scales": 40,
                                 "exp_avg_sq.small": 4106, "master_remainder": layout.total}
    assert st.buffer_dtypes()["exp_avg.codes"] == np.uint8 and st.buffer_dtypes()["master_remainder"] == np.int8
    table = st.tensor_table()
    assert table[:, 0].tolist() == layout.offsets.tolist()
    assert table[:, 1].tolist() == [0, -1, 16, -1, -1]
    assert table[:, 2].tolist() == [-1, 0, -1, 10, 4105]
    assert [st.is_small(t) for t in range(5)] == [b == 0 for b in blocks]
    assert st.state_shapes(2) == {"exp_avg.codes": (3, 2000), "exp_avg.scales": (24,), "exp_avg_sq.codes": (3, 2000),
                                  "exp_avg_sq.scales": (24,), "master_remainder": (3, 2000)}
    assert st.state_shapes(1) == {"exp_avg": (10,), "exp_avg_sq": (10,), "master_remainder": (10,)}
    host = {k: np.arange(n).astype(st.buffer_dtypes()[k]) for k, n in st.buffer_sizes().items()}
    v = st.tensor_views(3, host)
    assert v["exp_avg"].tolist() == list(range(10, 4105))
    assert st.tensor_views(2, host)["exp_avg.scales"].tolist() == list(range(16, 40))
    assert sum(small) == st.total_small


def test_float_layouts_and_fills():
    layout = TensorLayout([(5000,), (7,)])
    d = DEFINITIONS["adagrad"]
    hp = d.params_type(initial_accumulator_value=0.25)
    for state_dtype, dtype in (("float32", np.float32), ("bfloat16", np.uint16)):
        st = F.FormatState(layout, d.slots, F.StepFormat("float16", "float16", "float32", state_dtype, False))
        assert st.buffer_dtypes() == {"sum": dtype, "master": np.float32}
        fills = st.buffer_fills(d.state_slots(hp))
        assert np.array([fills["sum"]]).astype(dtype).view(dtype)[0] == np.array([0.25], np.float32).astype(
            BF16 if dtype == np.uint16 else np.float32).view(dtype)[0]
        assert fills["master"] == 0.0
    st = F.FormatState(layout, d.slots, F.StepFormat("bfloat16", "bfloat16", None, "int8", True))
    fills = st.buffer_fills(d.state_slots(hp))
    q = F.dynamic_map(False)
    assert q[int(fills["sum.codes"])] * np.float32(fills["sum.scales"]) == np.float32(0.25)
    assert fills["sum.small"] == 0.25 and st.master_buffer() is None


def test_bad_format_state_raises():
    with pytest.raises(InvalidParameterError, match="StepFormat"):
        F.FormatState(TensorLayout([(3,)]), _adam_slots(), "int8")


# ---------------------------------------------------------------- the encodings: numba element code vs the numpy reference

from optirs.core import formats_reference as R  # noqa: E402


def _special_floats(rng, n=4000):
    """Random float32 bit patterns plus the edges: zeros, subnormals, the largest, inf, NaN, ties."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                      0x3F808000, 0x3F818000, 0x3F800080, 0x3F800180, 0x3F7FFF80, 0x7F7F8000, 0x477FF000,
                      0x38800000, 0x33000000, 0x33000001], dtype=np.uint32)
    return np.concatenate([u, edges]).view(np.float32)


@pytest.fixture(scope="module")
def nb():
    from numba import njit, prange  # noqa: F401

    from optirs.backends.common import formats as E

    @njit(cache=True)
    def encode_all(x, r, key, out):
        for i in range(x.shape[0]):
            out[0, i] = E.bf16_nearest(x[i])
            out[1, i] = E.f16_nearest(x[i])
            out[2, i] = E.bf16_stochastic(x[i], r[i])
            hi, rem = E.remainder16_split(x[i])
            out[3, i] = hi
            out[4, i] = np.uint32(np.int64(rem) & 0xFFFFFFFF)
            out[5, i] = E.f32_bits(E.remainder16_join(hi, rem))
            y = E.round24(x[i])
            out[6, i] = E.f32_bits(y)
            hi, rem = E.remainder8_split(y)
            out[7, i] = hi
            out[8, i] = np.uint32(np.int64(rem) & 0xFFFFFFFF)
            out[9, i] = E.f32_bits(E.remainder8_join(hi, rem))
            out[10, i] = E.rand32(key, i)
            out[11, i] = E.f32_bits(E.decode16(np.uint32(out[0, i]), 1))

    return E, encode_all


def test_numba_encodings_match_the_reference(nb, rng):
    E, encode_all = nb
    x = _special_floats(rng)
    r = rng.integers(0, 2**32, x.size, dtype=np.uint64).astype(np.uint32)
    key = R.stream_key(12345, 7, 2)
    assert int(E.stream_key(12345, 7, 2)) == int(key)
    out = np.zeros((12, x.size), np.uint32)
    encode_all(x, r, np.uint64(key), out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out[0], x.astype(BF16).view(np.uint16))  # ml_dtypes
        assert np.array_equal(out[1], x.astype(np.float16).view(np.uint16))  # numpy
    assert np.array_equal(out[2], R.bf16_stochastic(x, r))
    hi, rem = R.remainder16_split(x)
    assert np.array_equal(out[3], hi) and np.array_equal(out[4].astype(np.int64), rem.astype(np.int64) & 0xFFFFFFFF)
    assert np.array_equal(out[5], x.view(np.uint32))  # remainder16 is exact, NaN payloads included
    y = R.round24(x)
    assert np.array_equal(out[6], y.view(np.uint32))
    hi, rem = R.remainder8_split(y)
    assert np.array_equal(out[7], hi) and np.array_equal(out[8].astype(np.int64), rem.astype(np.int64) & 0xFFFFFFFF)
    finite = np.isfinite(x)
    assert np.array_equal(out[9][finite], y.view(np.uint32)[finite])  # the 24-bit master round-trips
    assert np.array_equal(out[10], R.rand_bits(key, np.arange(x.size)))
    assert np.array_equal(out[11].view(np.float32)[finite], x.astype(BF16).astype(np.float32)[finite])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_reference_encodings_follow_the_contract(rng):
    x = _special_floats(rng)
    finite = np.isfinite(x)
    # remainder16: the parameter is the master rounded to nearest, ties away from zero
    hi, rem = R.remainder16_split(x)
    u = x.view(np.uint32).astype(np.int64)
    lo = u & 0xFFFF
    assert np.array_equal(hi[finite], (((u >> 16) + (lo >= 0x8000)) & 0xFFFF)[finite])
    assert np.array_equal(R.remainder16_join(hi, rem).view(np.uint32), x.view(np.uint32))
    # round24 is nearest even on the low 8 bits: the nearer of the two 24-bit neighbours
    y = R.round24(x)
    down = (u & ~0xFF).astype(np.uint32).view(np.float32).astype(np.float64)
    up = ((u & ~0xFF) + 0x100).astype(np.uint32).view(np.float32).astype(np.float64)
    ok = finite & np.isfinite(up) & np.isfinite(y)
    xd = x.astype(np.float64)
    assert np.all(np.abs(y.astype(np.float64) - xd)[ok] <= np.minimum(np.abs(xd - down), np.abs(up - xd))[ok])
    assert np.all(y.view(np.uint32)[finite] & 0xFF == 0)
    # the random bits: the published finalizer on known values (MurmurHash3's fmix32)
    assert int(R.fmix32(np.uint32(0))) == 0 and int(R.fmix32(np.uint32(1))) == 0x514E28B7
