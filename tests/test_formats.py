"""Step formats (docs/formats.md): the records, the 8-bit map, the shared encodings and
every format x family on every backend with the ``formats`` capability, against the float64
reference of the format (optirs.core.reference)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from optirs.core import formats as F
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.core.layout import ALIGN, TensorLayout, aligned_offsets

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


# ---------------------------------------------------------------- the square-root codes


def _sqrt_code_exact(x, scale, signed):
    """The square-root code by float64 arithmetic: the integer nearest n * sqrt(|x| / scale)."""
    n = F.sqrt_levels(signed)
    r = n * np.sqrt(np.abs(x.astype(np.float64)) / np.float64(scale))
    c = np.floor(r + 0.5)
    return np.where(signed & (x < 0), -c, c), r


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("scale", [1.0, 3.7e-5, 2.0**-100, 1e-40, 3e38])
def test_sqrt_codes_are_the_nearest_code_of_the_root(signed, scale, rng):
    """Each code is the integer nearest n * sqrt(|x| / scale) (float64), up to the float32 rounding
    of the scaled value; it decodes to (c * |c|) * (scale / n**2); the largest magnitude to code n."""
    scale = np.float32(scale)
    x = (rng.uniform(-1 if signed else 0, 1, 50000) * scale).astype(np.float32)
    x[:2] = [scale, -scale if signed else np.float32(0)]
    codes = F.sqrt_quantize(x, scale, signed)
    got = codes.view(np.int8).astype(np.float64) if signed else codes.astype(np.float64)
    want, r = _sqrt_code_exact(x, scale, signed)
    near_half = np.abs(r - np.floor(r) - 0.5) < 1e-4 * np.maximum(r, 1)
    if scale >= np.float32(2.0**-126):  # a subnormal scale's values carry few bits
        assert np.array_equal(got[~near_half], want[~near_half])
        assert np.all(np.abs(got - want) <= 1)
    assert got[0] == F.sqrt_levels(signed)
    values = F.sqrt_dequantize(codes, scale, signed)
    w = np.float32(scale / np.float32(F.sqrt_levels(signed) ** 2))
    assert np.array_equal(values, ((got * np.abs(got)).astype(np.float32) * w).astype(np.float32))


@pytest.mark.parametrize("signed", [True, False])
def test_sqrt_codes_tie_to_even_and_carry_nan_as_zero(signed):
    n = F.sqrt_levels(signed)
    k = np.arange(1, n + 1)
    bounds = ((k - 0.5) ** 2).astype(np.float32)  # |x| whose root lies halfway (exact in float32)
    scale = np.float32(n * n)  # then u = |x| exactly
    assert F.sqrt_quantize(bounds, scale, signed).tolist() == [int(c) for c in k - (k % 2)]  # ties to even
    # one float32 step off a halfway value: its root rounds onto the half, or just past it
    above = F.sqrt_quantize(np.nextafter(bounds, np.float32(np.inf)), scale, signed).astype(np.int64)
    below = F.sqrt_quantize(np.nextafter(bounds, np.float32(0)), scale, signed).astype(np.int64)
    assert np.all((above >= k - (k % 2)) & (above <= k)) and np.all((below >= k - 1) & (below <= k - (k % 2)))
    nan = np.full(3, np.nan, np.float32)
    assert F.sqrt_quantize(nan, np.float32(np.nan), signed).tolist() == [0, 0, 0]
    assert np.isnan(F.sqrt_dequantize(np.zeros(3, np.uint8), np.float32(np.nan), signed)).all()
    assert F.sqrt_quantize(np.ones(3, np.float32), np.float32(0), signed).tolist() == [0, 0, 0]


def test_numba_sqrt_codes_match_the_reference(rng):
    """The shared numba codec (the cpu and cuda kernels' codes, values and factors) against
    the numpy one, bit for bit, on random values, every tie and its neighbours, tiny, huge, zero, inf
    and NaN scales."""
    from optirs.backends.common import formats as B

    f32 = np.float32
    for signed in (True, False):
        n = F.sqrt_levels(signed)
        n2 = f32(n * n)
        cases = [(f32(s), (rng.uniform(-1 if signed else 0, 1, 4000) * f32(s)).astype(np.float32))
                 for s in (1.0, 3.7e-5, 1e-40, 2.0**-100, 2.0**-96, 2.0**-80, 2.0**-79, 2.0**97, 1e30, 3e38)]
        ties = ((np.arange(1, n + 1) - 0.5) ** 2).astype(np.float32)
        cases.append((n2, np.concatenate([np.nextafter(ties, f32(0)), ties, np.nextafter(ties, f32(np.inf))])))
        cases += [(f32(0), np.zeros(4, np.float32)), (f32(np.nan), rng.standard_normal(8).astype(np.float32)),
                  (f32(np.inf), np.array([1, -2, np.inf, 0], np.float32))]
        for scale, x in cases:
            extra = np.array([0, -0.0, 1e-38, -1e-38, 2.0**-101, -(2.0**-99)], np.float32)
            x = np.concatenate([x, extra[~(np.abs(extra) > scale)]])  # a block's values: |x| <= scale
            k, w = (f32(v) for v in B.sqrt_factors(scale, f32(n)))
            want = F.sqrt_quantize(x, scale, signed)
            codes = np.array([B.sqrt_code(v, k, signed) & 0xFF for v in x], np.uint8)
            assert np.array_equal(codes, want), (signed, scale)
            # the GPU kernels' factor (by the fast paths' windows) and, in those windows, codes: the same
            fast, kf = B.sqrt_encode_factor(scale, f32(n))
            assert f32(kf).view(np.uint32) == k.view(np.uint32), (signed, scale)
            assert bool(fast) == bool(f32(2.0**-80) <= scale < f32(2.0**98)), scale
            if fast:
                by_fast = np.array([B.sqrt_code_fast(v, k, signed) & 0xFF for v in x], np.uint8)
                assert np.array_equal(by_fast, want), (signed, scale)
            assert f32(B.sqrt_decode_factor(scale, n2)).view(np.uint32) == w.view(np.uint32)
            ints = want.view(np.int8) if signed else want
            values = np.array([B.sqrt_value(np.int32(c), w) for c in ints], np.float32)
            want_values = F.sqrt_dequantize(want, scale, signed).view(np.uint32)
            assert np.array_equal(values.view(np.uint32), want_values)
            by_bits = np.array([B.sqrt_value_byte(np.uint32(c), signed, w) for c in want], np.float32)
            assert np.array_equal(by_bits.view(np.uint32), want_values)
        every = np.arange(256, dtype=np.uint8)  # every byte's value by its bits and by the fma form
        for scale in (f32(3), f32(2.0**-72), np.nextafter(f32(2.0**72), f32(0)), f32(1.7e-9)):
            w = f32(B.sqrt_factors(scale, f32(n))[1])
            want = F.sqrt_dequantize(every, scale, signed).view(np.uint32)
            by_bits = np.array([B.sqrt_value_byte(np.uint32(c), signed, w) for c in every], np.float32)
            fused = np.array([B.sqrt_value_fma(np.uint32(c), signed, w, f32(w * B.SQRT_FMA_BASE)) for c in every],
                             np.float32)
            assert np.array_equal(by_bits.view(np.uint32), want) and np.array_equal(fused.view(np.uint32), want)


# ---------------------------------------------------------------- the float8 state


def _fp8_words(rng):
    """float32 words around every float8 rounding point (each exponent and kept mantissa, the dropped
    20 bits at 0, 1, just below, at and just above the half, and all set), random words; both signs."""
    e = np.arange(256, dtype=np.uint32) << np.uint32(23)
    m = np.arange(8, dtype=np.uint32) << np.uint32(20)
    low = np.array([0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF], np.uint32)
    words = (e[:, None, None] | m[None, :, None] | low[None, None, :]).reshape(-1)
    words = np.concatenate([words, rng.integers(0, 2**31, 100000, dtype=np.uint64).astype(np.uint32)])
    return np.concatenate([words, words | np.uint32(0x80000000)])


def test_float8_codes_are_ml_dtypes_float8_e4m3fn(rng):
    """The contract's float8 code of a float32 value: ml_dtypes' float8_e4m3fn (nearest even,
    subnormals) up to 448, 448 of the value's sign above it (saturated: ml_dtypes makes those NaN),
    0x7F for any NaN; a code's value: ml_dtypes' value of the byte."""
    y = _fp8_words(rng).view(np.float32)
    codes = F.fp8_encode(y)
    nan = np.isnan(y)
    finite = ~nan & (np.abs(y) <= np.float32(448))
    assert np.array_equal(codes[finite], y[finite].astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    big = ~nan & ~finite
    assert big.any() and np.array_equal(codes[big], np.where(y[big] < 0, 0xFE, 0x7E).astype(np.uint8))
    assert nan.any() and np.all(codes[nan] == 0x7F)
    assert F.fp8_encode(np.float32([464, 464.00003, -480, 2.0**-10, 3 * 2.0**-11, -0.0])).tolist() == \
        [0x7E, 0x7E, 0xFE, 0, 1, 0x80]  # a tie to even, saturation, a subnormal tie and round, -0
    every = np.arange(256, dtype=np.uint8)
    want = every.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = F.fp8_decode(every)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert np.flatnonzero(np.isnan(got)).tolist() == [0x7F, 0xFF]


def test_float8_blocks_code_their_absmax_as_448_and_decode_within_a_step(rng):
    """(x * pre) * k and (v * w) * post: a block's absmax codes as +-448 at every scale, tiny ones
    (pre = 2**64) included; each value decodes within half a float8 step of itself (relative 2**-4 in
    the normal range, 2**-9 of the scale's 448th part below it); a zero scale codes zeros."""
    f32 = np.float32
    for scale in (f32(1), f32(3.7e-5), f32(2.0**-64), np.nextafter(f32(2.0**-64), f32(0)), f32(1e-40), f32(3e38)):
        x = (rng.uniform(-1, 1, 20000) * scale).astype(np.float32)
        x[:2] = [scale, -scale]
        codes = F.fp8_quantize(x, scale)
        assert codes[0] == 0x7E and codes[1] == 0xFE and np.all((codes & 0x7F) <= 0x7E), scale
        back = F.fp8_dequantize(codes, scale)
        unit = np.float64(scale) / 448  # the block's value of a float8 1
        tol = np.maximum(np.abs(x.astype(np.float64)) * 2.0**-4, unit * 2.0**-9) * 1.0001 + 1.4e-45
        assert np.all(np.abs(back.astype(np.float64) - x) <= tol), scale
    assert F.fp8_quantize(np.zeros(4, np.float32), f32(0)).tolist() == [0] * 4
    assert np.all(F.fp8_quantize(np.float32([1, np.inf]), f32(np.inf)) == [0, 0x7F])
    assert np.isnan(F.fp8_dequantize(np.zeros(2, np.uint8), f32(np.nan))).all()


def test_numba_float8_codes_match_the_reference(rng):
    """The shared numba codec (the cpu and cuda kernels' codes, values and factors) against the
    numpy one, bit for bit: codes of the rounding points' words, every byte's value, and each
    block's factors at usual, tiny, boundary, huge, zero, inf and NaN scales."""
    import numba

    from optirs.backends.common import formats as B

    @numba.njit(error_model="numpy")
    def codes_of(words, out):
        for i in range(words.shape[0]):
            out[i] = np.uint8(B.fp8_code(B.bits_f32(np.uint32(words[i]))) & 0xFF)

    @numba.njit(error_model="numpy")
    def values_of(codes, out):
        for i in range(codes.shape[0]):
            out[i] = B.fp8_value(np.uint32(codes[i]))

    words = _fp8_words(rng)
    got = np.empty(words.size, np.uint8)
    codes_of(words, got)
    assert np.array_equal(got, F.fp8_encode(words.view(np.float32)))
    every = np.arange(256, dtype=np.uint8)
    values = np.empty(256, np.float32)
    values_of(every, values)
    want = F.fp8_decode(every)
    assert np.array_equal(np.isnan(values), np.isnan(want))
    assert np.array_equal(values.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    f32 = np.float32
    for scale in (f32(1), f32(3.7e-5), f32(2.0**-64), np.nextafter(f32(2.0**-64), f32(0)), f32(1e-40), f32(0),
                  f32(3e38), f32(np.inf), f32(np.nan)):
        got_f = [f32(v) for v in B.fp8_factors(scale)]
        want_f = [f32(v) for v in F.fp8_factors(scale)]
        assert [v.view(np.uint32) for v in got_f] == [v.view(np.uint32) for v in want_f] or \
            (np.isnan(scale) and all(np.isnan(a) == np.isnan(b) for a, b in zip(got_f, want_f))), scale



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
    # the small tensors' float32 state back to back, each from a multiple of 8 elements
    small_at = [-1, 0, -1, 16, 16 + 4096]
    assert st.buffer_sizes() == {"exp_avg.codes": layout.total, "exp_avg.scales": 40, "exp_avg.small": 4113,
                                 "exp_avg_sq.codes": layout.total, "exp_avg_sq.scales": 40,
                                 "exp_avg_sq.small": 4113, "master_remainder": layout.total}
    assert st.buffer_dtypes()["exp_avg.codes"] == np.uint8 and st.buffer_dtypes()["master_remainder"] == np.int8
    table = st.tensor_table()
    assert table[:, 0].tolist() == layout.offsets.tolist()
    assert table[:, 1].tolist() == [0, -1, 16, -1, -1]
    assert table[:, 2].tolist() == small_at
    assert [st.is_small(t) for t in range(5)] == [b == 0 for b in blocks]
    assert st.state_shapes(2) == {"exp_avg.codes": (3, 2000), "exp_avg.scales": (24,), "exp_avg_sq.codes": (3, 2000),
                                  "exp_avg_sq.scales": (24,), "master_remainder": (3, 2000)}
    assert st.state_shapes(1) == {"exp_avg": (10,), "exp_avg_sq": (10,), "master_remainder": (10,)}
    host = {k: np.arange(n).astype(st.buffer_dtypes()[k]) for k, n in st.buffer_sizes().items()}
    v = st.tensor_views(3, host)
    assert v["exp_avg"].tolist() == list(range(16, 16 + 4095))
    assert st.tensor_views(2, host)["exp_avg.scales"].tolist() == list(range(16, 40))
    assert small_at[-1] + small[-1] == st.total_small


def test_layout_offsets_sit_on_the_vector_grid():
    """Each tensor's state starts at a multiple of ALIGN whatever the sizes before it (a tensor of odd
    size would otherwise put every later one off the kernels' vector grid); align=1 packs them."""
    rng = np.random.default_rng(5)
    shapes = [(int(n),) for n in rng.integers(0, 40, 30)] + [(3, 5), (0,), (1, 1)]
    layout = TensorLayout(shapes)
    ends = layout.offsets + layout.sizes
    assert (layout.offsets % ALIGN == 0).all() and layout.total == ends[-1]
    assert (layout.offsets[1:] >= ends[:-1]).all() and (layout.offsets[1:] - ends[:-1] < ALIGN).all()
    packed = TensorLayout(shapes, align=1)
    assert packed.offsets.tolist() == np.concatenate([[0], np.cumsum(packed.sizes)[:-1]]).tolist()
    assert packed.total == int(packed.sizes.sum())
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    flat = layout.pack(arrays)
    assert flat.shape == (layout.total,) and all(np.array_equal(v, a) for v, a in zip(layout.views(flat), arrays))
    gaps = np.ones(layout.total, bool)
    for o, n in zip(layout.offsets, layout.sizes):
        gaps[o : o + n] = False
    assert (flat[gaps] == 0).all()
    assert TensorLayout([]).total == 0 and aligned_offsets([])[1] == 0


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

from optirs.core import reference as R  # noqa: E402


def _special_floats(rng, n=4000):
    """Random float32 bit patterns plus the edges: zeros, subnormals, the largest, inf, NaN, ties."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                      0x3F808000, 0x3F818000, 0x3F800080, 0x3F800180, 0x3F7FFF80, 0x7F7F8000, 0x477FF000,
                      0x38800000, 0x33000000, 0x33000001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFC00000],
                     dtype=np.uint32)
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
            out[12, i] = E.bf16_nearest_wide_num(x[i]) >> 16
            out[13, i] = E.bf16_stochastic_wide_num(x[i], r[i]) >> 16

    return E, encode_all


def test_numba_encodings_match_the_reference(nb, rng):
    E, encode_all = nb
    x = _special_floats(rng)
    r = rng.integers(0, 2**32, x.size, dtype=np.uint64).astype(np.uint32)
    key = R.stream_key(12345, 7, 2)
    assert int(E.stream_key(12345, 7, 2)) == int(key)
    out = np.zeros((14, x.size), np.uint32)
    encode_all(x, r, np.uint64(key), out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out[0], x.astype(BF16).view(np.uint16))  # ml_dtypes
        assert np.array_equal(out[1], x.astype(np.float16).view(np.uint16))  # numpy
    assert np.array_equal(out[2], R.bf16_stochastic(x, r))
    hi, rem = R.remainder16_split(x)
    assert np.array_equal(out[3], hi) and np.array_equal(out[4].astype(np.int64), rem.astype(np.int64) & 0xFFFFFFFF)
    nan = np.isnan(x)
    assert np.array_equal(out[5][~nan], x.view(np.uint32)[~nan])  # remainder16 is exact
    assert np.array_equal(out[5][nan], _quiet_nan_of(x[nan]))  # a NaN: the quiet NaN of its sign
    y = R.round24(x)
    assert np.array_equal(out[6], y.view(np.uint32))
    hi, rem = R.remainder8_split(y)
    assert np.array_equal(out[7], hi) and np.array_equal(out[8].astype(np.int64), rem.astype(np.int64) & 0xFFFFFFFF)
    finite = np.isfinite(x)
    assert np.array_equal(out[9][finite], y.view(np.uint32)[finite])  # the 24-bit master round-trips
    assert np.array_equal(out[10], R.rand_bits(key, np.arange(x.size)))
    assert np.array_equal(out[11].view(np.float32)[finite], x.astype(BF16).astype(np.float32)[finite])
    # the encoders without a NaN test (a kernel's tested rounds): the same bits wherever x is not NaN
    num = ~np.isnan(x)
    assert np.array_equal(out[12][num], out[0][num]) and np.array_equal(out[13][num], out[2][num])


@pytest.fixture(scope="module")
def nb16():
    from numba import njit

    from optirs.backends.common import formats as E

    @njit  # not cached: a cached copy would outlive edits of the encodings it tests
    def f16_both(x, h, enc, dec, native):
        # native: the cpu's conversion instructions where it has them; else the bit-by-bit forms
        # that every other target (cuda) compiles
        for i in range(x.shape[0]):
            enc[i] = E.f16_nearest(x[i]) if native else E.f16_nearest_bits(x[i])
        for i in range(h.shape[0]):
            dec[i] = E.decode16(np.uint32(h[i]), 2) if native else E._f16_decode_bits(np.uint32(h[i]))

    return f16_both


@pytest.mark.parametrize("native", [True, False], ids=["native", "bits"])
def test_numba_float16_at_every_rounding_boundary(nb16, native):
    """float16 bits decoded (every pattern) and encoded at every rounding decision: each float16
    value, the midpoints to its neighbour (ties to even) and the float32 values either side of them,
    subnormals, the overflow edge, inf and NaN, against numpy's casts; by both forms."""
    h = np.arange(1 << 16, dtype=np.uint32)
    finite16 = h[(h & 0x7C00) != 0x7C00]
    lo = finite16.astype(np.uint16).view(np.float16).astype(np.float64)
    nxt = (finite16 + 1).astype(np.uint16).view(np.float16).astype(np.float64)  # inf past the largest
    top = np.isinf(nxt)
    nxt[top] = 65520.0 * np.sign(lo[top])  # the largest float16's upper rounding edge
    mid = ((lo + nxt) / 2).astype(np.float32)  # exact in float32: float16 midpoints need 12 bits
    x = np.concatenate([lo.astype(np.float32), mid, np.nextafter(mid, np.float32(np.inf)),
                        np.nextafter(mid, np.float32(-np.inf)), np.float32([np.inf, -np.inf, np.nan, -np.nan])])
    x = np.concatenate([x, np.uint32([0x7F800001, 0xFFBFFFFF, 0x7FA00000, 0x00000001, 0x807FFFFF]).view(np.float32)])
    enc = np.zeros(x.size, np.uint16)
    dec = np.zeros(h.size, np.float32)
    nb16(x, h, enc, dec, native)
    with np.errstate(over="ignore"):
        assert np.array_equal(enc, x.astype(np.float16).view(np.uint16))
    ref = h.astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(dec.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.array_equal(dec.view(np.uint32)[nan], ((h[nan] & 0x8000) << 16) | 0x7FC00000)  # the quiet NaN


def _quiet_nan_of(x):
    """The float32 quiet NaN of the sign of each of the NaNs ``x`` (0x7FC00000 | sign)."""
    return (x.view(np.uint32) & 0x80000000) | 0x7FC00000


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_reference_encodings_follow_the_contract(rng):
    x = _special_floats(rng)
    finite, nan = np.isfinite(x), np.isnan(x)
    # remainder16: the parameter is the master rounded to nearest, ties away from zero
    hi, rem = R.remainder16_split(x)
    u = x.view(np.uint32).astype(np.int64)
    lo = u & 0xFFFF
    assert np.array_equal(hi[finite], (((u >> 16) + (lo >= 0x8000)) & 0xFFFF)[finite])
    assert np.array_equal(R.remainder16_join(hi, rem).view(np.uint32)[~nan], x.view(np.uint32)[~nan])
    # a NaN master, whatever its payload, splits as the quiet NaN of its sign: a bfloat16 NaN
    # parameter and a remainder of 0 (split as a word, 0x7FFFFFFF would round up to 0x8000, a zero)
    assert np.array_equal(hi[nan], _quiet_nan_of(x[nan]) >> 16) and not rem[nan].any()
    assert np.array_equal(R.round24(x).view(np.uint32)[nan], _quiet_nan_of(x[nan]))
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


# ---------------------------------------------------------------- every format x family on every backend

import optirs  # noqa: E402
from conftest import backend_step, from_backend_array, to_backend_array  # noqa: E402

from optirs.core import params as P  # noqa: E402

FAMILY_HP = {  # each family's definition and hyperparameters that use every slot it has
    "adam": ("adamw", P.AdamParams(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "sgd": ("sgd", P.SgdParams(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "rmsprop": ("rmsprop", P.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True)),
    "adagrad": ("adagrad", P.AdagradParams(lr=1e-2, initial_accumulator_value=0.1)),
    "lion": ("lion", P.LionParams(lr=1e-3, weight_decay=0.1)),
    "lamb": ("lamb", P.LambParams(lr=1e-2, max_grad_norm=1.0)),
}
FORMATS = {  # name -> (param dtype, grad dtype, master, state dtype, stochastic)
    "bf16": ("bfloat16", "bfloat16", None, "float32", False),
    "bf16-sr": ("bfloat16", "bfloat16", None, "float32", True),
    "bf16-master32": ("bfloat16", "float32", "float32", "float32", False),
    "bf16-r16": ("bfloat16", "bfloat16", "remainder16", "float32", False),
    "bf16-r8-int8": ("bfloat16", "bfloat16", "remainder8", "int8", False),
    "bf16-sr-bf16state": ("bfloat16", "bfloat16", None, "bfloat16", True),
    "f16-master32-int8": ("float16", "float16", "float32", "int8", False),
    "f32-int8": ("float32", "float32", None, "int8", False),
    "f32-bf16state": ("float32", "float32", None, "bfloat16", False),
}
SHAPES = [(64, 80), (300,), (7, 3)]  # one int8 tensor (20 blocks, the last full), two small ones
TINY = [(4096 + 40,), (5,)]  # for the CUDA simulator: one int8 tensor with a short last block


def _open(backend):
    b = optirs.get_backend(backend)
    if not b.supports("formats"):
        pytest.skip(f"backend {backend} has no formats capability")
    return b


class FormatRun:
    """Drives the formats hooks of one backend over several steps, beside the reference's state."""

    def __init__(self, backend, family, fmt_name, shapes, seed=7):
        self.backend, self.b = backend, _open(backend)
        self.d = DEFINITIONS[FAMILY_HP[family][0]]
        self.hp = FAMILY_HP[family][1]
        self.fmt = F.StepFormat(*FORMATS[fmt_name]) if isinstance(fmt_name, str) else fmt_name
        self.layout = TensorLayout(shapes)
        self.fs = F.FormatState(self.layout, F.format_slots(self.d, self.hp), self.fmt)
        self.seed = seed
        host = R.fresh_buffers(self.fs, self.d, self.hp)
        self.state = {k: self.b.to_device(self.b.ctx, v) for k, v in host.items()}

    def host_state(self):
        return {k: np.asarray(self.b.to_host(self.b.ctx, v)).reshape(-1) for k, v in self.state.items()}

    def step(self, params, grads, step, found_inf=None):
        """params / grads: host word arrays (float32, or uint16 bits); returns the new host words."""
        dev_p = [to_backend_array(self.backend, p) for p in params]
        dev_g = [to_backend_array(self.backend, g) for g in grads]
        staged = self.b.stage(self.b.ctx, dev_p, dev_g, self.fmt)
        flag = None if found_inf is None else to_backend_array(self.backend, np.array([found_inf], np.int32))
        backend_step(self.b, self.d.name, staged.params, staged.grads, self.state, self.layout,
                     self.d.scalars(self.hp, step), step=step, seed=self.seed, found_inf=flag, fmt=self.fmt,
                     format_state=self.fs)
        if staged.finish is not None:
            staged.finish()
        self.b.synchronize()
        return [from_backend_array(p).reshape(s) for p, s in zip(dev_p, self.layout.shapes)]


def _words(x, dtype):
    x = np.asarray(x, np.float32)
    return x if dtype == "float32" else R.nearest16(x, dtype).reshape(x.shape)


def _problem(rng, shapes, fmt, steps):
    params = [_words(rng.standard_normal(s).astype(np.float32), fmt.param_dtype) for s in shapes]
    grads = [[_words(rng.standard_normal(s).astype(np.float32) * np.float32(0.5), fmt.grad_dtype) for s in shapes]
             for _ in range(steps)]
    return params, grads


def _values(words, dtype):
    w = np.asarray(words)
    return w.astype(np.float32) if dtype == "float32" else R.decode16(w.reshape(-1), dtype).reshape(w.shape)


def _ordered16(words):
    """16-bit sign-magnitude words -> integers in value order (+0 and -0 both 0): adjacent values differ by 1."""
    w = np.asarray(words).reshape(-1).view(np.uint16).astype(np.int64)
    return np.where(w & 0x8000, -(w & 0x7FFF), w)


def _assert_close_params(got, want, fmt, what):
    """Equal words, or values one 16-bit step (float32: a few ulps) apart."""
    for t, (g, w) in enumerate(zip(got, want)):
        gv, wv = _values(g, fmt.param_dtype).reshape(-1), _values(w, fmt.param_dtype).reshape(-1)
        if fmt.param_dtype == "float32":
            assert np.allclose(gv, wv, rtol=1e-5, atol=1e-5 * np.abs(wv).max()), f"{what}: params[{t}]"
            continue
        ulp = np.abs(_ordered16(g) - _ordered16(w))
        ulp[np.abs(gv - wv) <= 1e-5 * np.abs(wv).max()] = 0  # float32's own floor (cancellation)
        assert ulp.max() <= 1, f"{what}: params[{t}] differ by {ulp.max()} {fmt.param_dtype} steps"


def _assert_close_state(fs, got, want, what):
    fmt = fs.fmt
    gs, ws = R.decode_state(fs, got), R.decode_state(fs, want)
    for t in range(len(fs.layout)):
        for s in fs.slot_names:
            g, w = gs[t][s], ws[t][s]
            if fs.int8 and not fs.is_small(t):
                o, n = int(fs.layout.offsets[t]), int(fs.layout.sizes[t])
                b = int(fs.tensor_table()[t, 1])
                signed = {x.name: x.signed for x in fs.slots}[s]
                steps = R.code_step(want[f"{s}.{fs.codes}"][o : o + n], want[f"{s}.scales"][b : b + -(-n // F.BLOCK)],
                                    signed, fmt.state_dtype)
                scale_g = got[f"{s}.scales"][b : b + -(-n // F.BLOCK)]
                scale_w = want[f"{s}.scales"][b : b + -(-n // F.BLOCK)]
                # (a NaN where the reference has one: centered RMSprop's variance from two coded moments
                # can round below zero, whose root is NaN as torch's is)
                assert np.allclose(scale_g, scale_w, rtol=1e-5, atol=1e-30, equal_nan=True), \
                    f"{what}: {s}.scales of tensor {t}"
                both_nan = np.isnan(g) & np.isnan(w)
                assert np.all((np.abs(g - w) <= steps * 1.001 + 1e-30) | both_nan), \
                    f"{what}: {s} of tensor {t} off by more than a code"
            elif fmt.state_dtype == "bfloat16":
                ulp = np.abs(_ordered16(R.nearest16(g, "bfloat16")) - _ordered16(R.nearest16(w, "bfloat16")))
                ulp[np.abs(g - w) <= 1e-5 * np.abs(w).max()] = 0  # float32's own floor (cancellation)
                assert ulp.max() <= 1, f"{what}: {s} of tensor {t}"
            else:
                # float32 vs float64: as tests/test_optimizers.py (RMSprop's centered variance cancels)
                assert np.allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max()), f"{what}: {s} of tensor {t}"
    m = fs.master_buffer()
    if m == "master":
        assert np.allclose(got[m], want[m], rtol=1e-5, atol=1e-5 * np.abs(want[m]).max()), f"{what}: master"


def _shapes(backend):
    return TINY if backend == "cuda" else SHAPES


@pytest.mark.parametrize("family", list(FAMILY_HP))
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_format_step_matches_the_reference(backend, family, fmt_name, rng):
    """Three steps of each family in each format: the backend against the float64 reference of
    the format, each step starting from the backend's own previous result."""
    run = FormatRun(backend, family, fmt_name, _shapes(backend))
    params, grads = _problem(rng, run.layout.shapes, run.fmt, 3)
    _steps_against_the_reference(run, params, grads, f"{backend} {family} {fmt_name}")


def _steps_against_the_reference(run, params, grads, what):
    """Each step from the backend's own previous result, against the reference's step of it."""
    for k, g in enumerate(grads, start=1):
        before = run.host_state()
        got = run.step(params, g, k)
        want_p, want_s = R.format_step(run.d, run.hp, run.fs, params, g, before, run.seed, k)
        _assert_close_params(got, want_p, run.fmt, f"{what} step {k}")
        _assert_close_state(run.fs, run.host_state(), want_s, f"{what} step {k}")
        params = got


CODED_FORMATS = {  # the arithmetic one-byte codes (square-root codes, float8), as FORMATS
    "bf16-r8-int8sqrt": ("bfloat16", "bfloat16", "remainder8", "int8_sqrt", False),
    "f32-int8sqrt": ("float32", "float32", None, "int8_sqrt", False),
    "bf16-r8-float8": ("bfloat16", "bfloat16", "remainder8", "float8_e4m3fn", False),
}


@pytest.mark.parametrize("family", list(FAMILY_HP))
@pytest.mark.parametrize("fmt_name", list(CODED_FORMATS))
def test_coded_state_step_matches_the_reference(backend, family, fmt_name, rng):
    """Three steps with square-root codes or float8 state against the reference on a backend that
    stores them; any other refuses the format with UnsupportedOperationError before writing anything."""
    run = FormatRun(backend, family, F.StepFormat(*CODED_FORMATS[fmt_name]), _shapes(backend))
    params, grads = _problem(rng, run.layout.shapes, run.fmt, 3)
    if run.fmt.state_dtype not in run.b.support.state_dtypes:
        before = run.host_state()
        with pytest.raises(UnsupportedOperationError, match=run.fmt.state_dtype):
            run.step(params, grads[0], 1)
        assert all(np.array_equal(before[k], v) for k, v in run.host_state().items())
        return
    _steps_against_the_reference(run, params, grads, f"{backend} {family} {fmt_name}")


def _dense_step(backend, d, hp, params32, grads32, state32, step):
    """The backend's ordinary float32 step hook on float32 copies (the same element math)."""
    b = optirs.get_backend(backend)
    layout = TensorLayout([p.shape for p in params32])
    dev_p = [to_backend_array(backend, p) for p in params32]
    dev_g = [to_backend_array(backend, g) for g in grads32]
    staged = b.stage(b.ctx, dev_p, dev_g, None)
    if state32 is None:
        state32 = {k: b.alloc(b.ctx, layout.total, np.float32, v) for k, v in d.state_slots(hp).items()}
    backend_step(b, d.name, staged.params, staged.grads, state32, layout, d.scalars(hp, step), step=step)
    if staged.finish is not None:
        staged.finish()
    b.synchronize()
    return [from_backend_array(p).reshape(p32.shape) for p, p32 in zip(dev_p, params32)], state32


@pytest.mark.parametrize("family", list(FAMILY_HP))
@pytest.mark.parametrize("master", [None, "float32", "remainder16"])
def test_same_math_is_bit_exact(backend, family, master, rng):
    """bfloat16 parameters with float32 state run the float32 step's element math: the master
    (float32 or remainder16) is bit for bit the float32 step's parameter, the bfloat16 parameter its
    rounding (nearest even; remainder16: ties away), the state the float32 step's state."""
    fmt = F.StepFormat("bfloat16", "float32", master, "float32", False)
    run = FormatRun(backend, family, fmt, _shapes(backend))
    params, grads = _problem(rng, run.layout.shapes, fmt, 3)
    p32 = [_values(p, "bfloat16") for p in params]
    dense_state = None
    for k, g in enumerate(grads, start=1):
        if master is None:  # no master: each step starts from the rounded bfloat16 parameter
            p32 = [_values(p, "bfloat16") for p in params]
        params = run.step(params, g, k)
        p32, dense_state = _dense_step(backend, run.d, run.hp, p32, g, dense_state, k)
        host = run.host_state()
        want_bits = [R.nearest16(p, "bfloat16").reshape(p.shape) if master != "remainder16" else
                     R.remainder16_split(p.reshape(-1))[0].reshape(p.shape) for p in p32]
        # cuda LAMB: the per-tensor float64 sums are atomics added in launch order (the float32
        # step's too), so a trust ratio may differ by one float32 ulp, and each update lr * ratio * u
        # by its own float32 rounding: a master within that of the largest one, a bfloat16 step
        ulps = 1 if (backend == "cuda" and family == "lamb") else 0
        for t in range(len(params)):
            assert _max_ulps16(params[t], want_bits[t]) <= ulps, f"{family} {master} step {k}: params[{t}]"
        # every buffer compared through the layout's views (the gaps between tensors hold nothing)
        views = run.layout.views
        dense = np.concatenate([p.reshape(-1) for p in p32])
        got_master = None
        if master == "float32":
            got_master = np.concatenate([v.reshape(-1) for v in views(host["master"])])
        if master == "remainder16":
            got_master = np.concatenate([R.remainder16_join(p.reshape(-1), r.reshape(-1))
                                         for p, r in zip(params, views(host["master_remainder"]))])
        if got_master is not None and ulps:
            assert np.allclose(got_master, dense, rtol=2.0**-22, atol=2.0**-22 * np.abs(dense).max())
        elif got_master is not None:
            assert np.array_equal(got_master.view(np.uint32), dense.view(np.uint32))
        for s in run.fs.slot_names:
            for a, b in zip(views(host[s]), views(from_backend_array(dense_state[s]))):
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), s


def _max_ulps16(a, b):
    """The largest distance in units of the last place between same-signed bit patterns (uint16)."""
    return int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max(initial=0))


def test_small_tensors_keep_float32_state(backend, rng):
    """With int8 state, tensors under 4096 elements keep float32 state: bit for bit the float32 format's."""
    shapes = [(4096,), (4095,), (3, 5)]
    runs = {sd: FormatRun(backend, "adam", F.StepFormat("bfloat16", "bfloat16", "remainder16", sd, False), shapes)
            for sd in ("int8", "float32")}
    params, grads = _problem(rng, shapes, runs["int8"].fmt, 2)
    got = {}
    for sd, run in runs.items():
        p = params
        for k, g in enumerate(grads, start=1):
            p = run.step(p, g, k)
        got[sd] = (p, run.host_state())
    fs = runs["int8"].fs
    assert not fs.is_small(0) and fs.is_small(1) and fs.is_small(2)
    dense_fs = runs["float32"].fs
    for s in fs.slot_names:
        for t in (1, 2):
            small = fs.tensor_views(t, got["int8"][1])[s]  # its float32 state, in the small buffer
            dense = dense_fs.tensor_views(t, got["float32"][1])[s]
            assert np.array_equal(small.view(np.uint32), dense.view(np.uint32)), (s, t)
    for t in (1, 2):
        assert np.array_equal(got["int8"][0][t], got["float32"][0][t])


def _sr_run(backend, seed, n, value, state_dtype="float32"):
    """SGD with lr 1 on bfloat16 parameters 1.0 and float32 gradients 1 - value: every updated
    parameter is the float32 ``value`` (between two bfloat16 values), rounded stochastically."""
    fmt = F.StepFormat("bfloat16", "float32", None, state_dtype, True)
    run = FormatRun(backend, "sgd", fmt, [(n,)], seed=seed)
    run.d, run.hp = DEFINITIONS["sgd"], P.SgdParams(lr=1.0, momentum=0.5)
    run.fs = F.FormatState(run.layout, F.format_slots(run.d, run.hp), fmt)
    host = R.fresh_buffers(run.fs, run.d, run.hp)
    run.state = {k: run.b.to_device(run.b.ctx, v) for k, v in host.items()}
    g = np.full(n, np.float32(1) - np.float32(value), np.float32)
    p = run.step([R.nearest16(np.ones(n, np.float32), "bfloat16")], [g], 1)[0]
    return p, run.host_state(), np.float32(1) - g


def _assert_unbiased(bits, x):
    x = np.float32(x)
    # the two bfloat16 neighbours of x: truncated and one step up in magnitude
    lo, hi = sorted(R.decode16(R.bf16_stochastic(np.array([x, x]), np.array([0, 0xFFFF], np.uint32)), "bfloat16"))
    vals = R.decode16(bits, "bfloat16").astype(np.float64)
    assert set(np.unique(vals)) <= {float(lo), float(hi)} and lo < x < hi
    p = (float(x) - float(lo)) / (float(hi) - float(lo))
    se = (float(hi) - float(lo)) * math.sqrt(p * (1 - p) / vals.size)
    assert abs(vals.mean() - float(x)) <= 5 * se, (vals.mean(), float(x), se)


def _sr_size(backend):
    return 4096 if backend == "cuda" else 1 << 17


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2**-7, -2.7e-3, 3.0e5 + 123.0])
def test_stochastic_rounding_is_unbiased(backend, value):
    """The mean of many stochastically rounded copies of one float32 value is that value (within
    five standard errors), for the parameters (stream 0) and bfloat16 state (stream 1)."""
    n = _sr_size(backend)
    p, state, x = _sr_run(backend, 11, n, value, "bfloat16")
    _assert_unbiased(p, x[0])
    g = np.float32(1) - np.float32(value)  # the momentum buffer's first value is the gradient
    _assert_unbiased(state["momentum_buffer"], g)


def test_stochastic_rounding_of_every_moment_is_unbiased(backend):
    """AdamW (amsgrad) with bfloat16 state at step 1: exp_avg and exp_avg_sq round by the low and
    high halves of one hash, max_exp_avg_sq by its own stream (docs/formats.md): each is unbiased,
    and no two round up at the same elements."""
    n = _sr_size(backend)
    run = FormatRun(backend, "adam", F.StepFormat("bfloat16", "float32", None, "bfloat16", False), [(n,)], seed=3)
    g32 = np.float32(0.3)
    run.step([R.nearest16(np.ones(n, np.float32), "bfloat16")], [np.full(n, g32, np.float32)], 1)
    state, sc = run.host_state(), run.d.scalars(run.hp, 1)
    g = g32 * sc.grad_factor  # the kernels' float32 arithmetic, in their order
    m, v = sc.one_minus_beta1 * g, (sc.one_minus_beta2 * g) * g
    ups = []
    for slot, x in (("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", v)):
        _assert_unbiased(state[slot], x)
        ups.append(_ordered16(state[slot]) != _ordered16(state[slot]).min())
    assert not any(np.array_equal(a, b) for i, a in enumerate(ups) for b in ups[i + 1:])


def test_stochastic_rounding_is_reproducible(backend):
    """Same seed, same bits; another seed, other bits; the parameters and the state draw from
    different streams (their round-up patterns differ)."""
    n, value = _sr_size(backend), 1.0 + 0.3 * 2**-7
    a, b, c = (_sr_run(backend, seed, n, value, "bfloat16") for seed in (5, 5, 6))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1]["momentum_buffer"], b[1]["momentum_buffer"])
    assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[1]["momentum_buffer"], c[1]["momentum_buffer"])
    up_p = a[0] != a[0].min()
    up_s = _ordered16(a[1]["momentum_buffer"]) != _ordered16(a[1]["momentum_buffer"]).min()
    assert up_p.any() and up_s.any() and not np.array_equal(up_p, up_s)


@pytest.mark.parametrize("family", ["adam", "lamb", "sgd"])
@pytest.mark.parametrize("fmt_name", ["bf16-r8-int8", "bf16-sr-bf16state", "f16-master32-int8"])
def test_found_inf_skips_every_write(backend, family, fmt_name, rng):
    run = FormatRun(backend, family, fmt_name, _shapes(backend))
    params, grads = _problem(rng, run.layout.shapes, run.fmt, 2)
    params = run.step(params, grads[0], 1)
    before = run.host_state()
    after = run.step(params, grads[1], 2, found_inf=1)
    for a, b in zip(after, params):
        assert np.array_equal(a, b)
    for k, v in run.host_state().items():
        assert np.array_equal(v, before[k]), k
    moved = run.step(params, grads[1], 2, found_inf=0)
    assert any(not np.array_equal(a, b) for a, b in zip(moved, params))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_check_sets_the_flag(backend, dtype, bad, rng):
    b = _open(backend)
    fmt = F.StepFormat(dtype, dtype, None, "float32", False)
    shapes = _shapes(backend)
    layout = TensorLayout(shapes)
    grads = [_words(rng.standard_normal(s).astype(np.float32), dtype) for s in shapes]
    if bad is not None:
        last = grads[-1].reshape(-1)
        last[-1] = _words(np.array([bad], np.float32), dtype)[0]
    for start in (0, 1):
        dev_g = [to_backend_array(backend, g) for g in grads]
        staged = b.stage(b.ctx, [to_backend_array(backend, g.copy()) for g in grads], dev_g, fmt)
        flag = to_backend_array(backend, np.array([start], np.int32))
        b.plugin._formats_check(b.ctx, staged.grads, layout, fmt, flag)  # the check pass alone
        b.synchronize()
        assert int(from_backend_array(flag)[0]) == (1 if bad is not None or start else 0)


def test_bad_inputs_raise_optirs_errors(backend, rng):
    b = _open(backend)
    fmt = F.StepFormat("bfloat16", "bfloat16", None, "float32", False)
    def stage(ctx, params, grads, fmt):
        return b.stage(ctx, params, grads, fmt)

    p = to_backend_array(backend, np.zeros(8, np.float16))
    with pytest.raises(InvalidParameterError, match="params\\[0\\]"):
        stage(b.ctx, [p], [to_backend_array(backend, np.zeros(8, np.uint16))], fmt)
    with pytest.raises(InvalidParameterError, match="grads\\[0\\]"):
        stage(b.ctx, [to_backend_array(backend, np.zeros(8, np.uint16))], [to_backend_array(backend, np.zeros(8, np.float32))], fmt)
    run = FormatRun(backend, "adam", "bf16", [(8,)])
    staged = stage(b.ctx, [to_backend_array(backend, np.zeros(8, np.uint16))], [to_backend_array(backend, np.zeros(8, np.uint16))], fmt)
    with pytest.raises(UnsupportedOperationError, match="adafactor"):
        backend_step(b, "adafactor", staged.params, staged.grads, run.state, run.layout,
                     DEFINITIONS["adafactor"].scalars(P.AdafactorParams(), 1), fmt=fmt, format_state=run.fs)


# ---------------------------------------------------------------- the two-lookup quantizer


def _quantizer_points(signed):
    """Every midpoint, one ulp either side of each, every bucket's ends, random values, specials."""
    mid = F.map_midpoints(signed)
    edges = (np.arange(0, 0x8000, dtype=np.uint32) << 16)
    bucket_ends = np.concatenate([edges, edges | 0xFFFF]).view(np.float32)
    rng = np.random.default_rng(11)
    return np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                           F.dynamic_map(signed), bucket_ends, -bucket_ends,
                           rng.uniform(-1.01, 1.01, 1 << 16).astype(np.float32),
                           np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1, -1], np.float32)]).astype(np.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_table_quantizer_counts_the_midpoints_exactly(signed):
    """The numba quantizer (cpu and cuda's shared code) and the table's numpy text against
    searchsorted over the midpoints, at every point where the count can change."""
    from numba import njit

    from optirs.backends.common.formats import quantize, quantize_factors
    from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints, quantize_table

    y = _quantizer_points(signed)
    want = np.searchsorted(F.map_midpoints(signed), y, side="left")
    want[np.isnan(y)] = 0
    mid, table = padded_midpoints(signed), bucket_table(signed)
    assert np.array_equal(quantize_table(y, mid, table), want.astype(np.uint8))

    @njit
    def codes(y, scale, mid, table):
        out = np.empty(y.size, np.uint8)
        pre, inv = quantize_factors(scale)
        for i in range(y.size):
            out[i] = quantize(y[i] * scale, pre, inv, mid, table)
        return out

    assert np.array_equal(codes(y, np.float32(1), mid, table), want.astype(np.uint8))
    zero = np.searchsorted(F.map_midpoints(signed), 0.0, side="left")
    assert np.all(codes(y[:64], np.float32(0), mid, table) == zero)  # scale 0: every value is code(0)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_of_a_block_follow_the_reciprocal_contract(signed):
    """quantize and its finite-block form (the GPU's) against searchsorted of ``(x * pre) * inv``
    (numpy) for blocks of every kind of scale: normal, subnormal (``pre`` keeps the reciprocal
    finite), near float32's largest. A subnormal block has the codes of the same block scaled up
    into normal numbers, as the exact ``pre`` promises."""
    from numba import njit

    from optirs.backends.common.formats import quantize, quantize_factors, quantize_finite
    from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints

    @njit
    def codes(x, scale, mid, table):
        out = np.empty((2, x.size), np.uint8)
        pre, inv = quantize_factors(scale)
        for i in range(x.size):
            out[0, i] = quantize(x[i], pre, inv, mid, table)
            out[1, i] = quantize_finite(x[i], pre, inv, mid, table)
        return out

    y = _quantizer_points(signed)
    y = y[np.isfinite(y) & (np.abs(y) <= 1)]
    mid, table = padded_midpoints(signed), bucket_table(signed)
    by_scale = {}
    for scale in [np.float32(1), np.float32(3.7e-3), np.float32(3e38), np.float32(1e-39), np.float32(2.0**-140)]:
        x = np.clip((y.astype(np.float64) * scale).astype(np.float32), -scale, scale)
        x[0] = scale  # the block's absmax itself
        pre, inv = F.quantize_factors(scale)
        with np.errstate(over="ignore"):
            want = np.searchsorted(F.map_midpoints(signed), (x * pre) * inv, side="left").astype(np.uint8)
        got = codes(x, scale, mid, table)
        assert np.array_equal(got[0], want) and np.array_equal(got[1], want), scale
        assert got[0, 0] == 255  # the absmax codes to 1.0
        by_scale[float(scale)] = (x, got[0])
    x, _ = by_scale[float(np.float32(1e-39))]  # a subnormal block, and the same block scaled up exactly
    up = np.float32(2.0**64)
    assert np.array_equal(codes(x, np.float32(1e-39), mid, table), codes(x * up, np.float32(1e-39) * up, mid, table))


def test_packed_words_quantize_the_unsigned_map_exactly():
    """The unsigned map's packed words (the cuda kernels' one-load quantizer: table entry and midpoint
    in one word) against searchsorted of ``(x * pre) * inv`` at every point where the count can change,
    in the general form and the finite-block form, for a normal and a subnormal block scale."""
    from numba import njit

    from optirs.backends.common.formats import packed_word, quantize_factors, quantize_packed, quantize_packed_finite
    from optirs.backends.common.int8_buckets import WIDTH, bucket_table, padded_midpoints

    @njit
    def words(mid, table):
        out = np.empty(WIDTH, np.uint32)
        for b in range(WIDTH):
            out[b] = packed_word(b, table[b], mid[table[b]])
        return out

    @njit
    def codes(x, scale, packed):
        out = np.empty((2, x.size), np.uint32)
        pre, inv = quantize_factors(scale)
        for i in range(x.size):
            out[0, i] = quantize_packed(x[i], pre, inv, packed) >> 16
            out[1, i] = quantize_packed_finite(x[i], pre, inv, packed) >> 16
        return out

    packed = words(padded_midpoints(False), bucket_table(False))
    y = _quantizer_points(False)
    for scale in [np.float32(1), np.float32(2.0**-140)]:
        with np.errstate(invalid="ignore"):  # NaN among the points
            x = (y.astype(np.float64) * scale).astype(np.float32)
        pre, inv = F.quantize_factors(scale)
        want = np.searchsorted(F.map_midpoints(False), (x * pre) * inv, side="left")
        want[np.isnan(x)] = 0
        got = codes(x, scale, packed)
        assert np.array_equal(got[0], want), scale
        finite = np.abs(x) <= scale  # the finite form's domain: the block's own values
        assert np.array_equal(got[1][finite], want[finite]), scale


def test_bucket_table_refuses_a_map_too_dense_for_it():
    from optirs.backends.common.int8_buckets import build_table

    mid = np.sort(np.concatenate([F.map_midpoints(True)[:-1], [np.float32(0.99999)]])).astype(np.float32)
    mid[-2] = np.nextafter(mid[-1], np.float32(0))  # two midpoints one ulp apart: one bucket
    with pytest.raises(InvalidParameterError, match="holds 2 midpoints"):
        build_table(mid)
    with pytest.raises(InvalidParameterError, match="255 ascending"):
        build_table(mid[:10])


def test_the_gpu_formats_register_cap(monkeypatch):
    """int8 state capped at 64 registers (72 for a kernel with a full groups' round), other formats
    uncapped; the variable overrides both and a value that is not a count is refused naming it."""
    from optirs.backends.common.register_cap import (FULL_ROUNDS_MAX_REGISTERS, INT8_MAX_REGISTERS,
                                                     formats_register_cap)
    from optirs.core.formats import StepFormat

    int8, bf16 = StepFormat(state_dtype="int8"), StepFormat(param_dtype="bfloat16", master="float32")
    monkeypatch.delenv("OPTIRS_X_MAXREG", raising=False)
    assert (formats_register_cap(int8, "OPTIRS_X_MAXREG"), formats_register_cap(bf16, "OPTIRS_X_MAXREG")) == (
        INT8_MAX_REGISTERS, 0)
    assert formats_register_cap(int8, "OPTIRS_X_MAXREG", full_rounds=True) == FULL_ROUNDS_MAX_REGISTERS
    assert formats_register_cap(bf16, "OPTIRS_X_MAXREG", full_rounds=True) == 0
    monkeypatch.setenv("OPTIRS_X_MAXREG", "48")
    assert formats_register_cap(bf16, "OPTIRS_X_MAXREG") == 48
    monkeypatch.setenv("OPTIRS_X_MAXREG", "0")
    assert formats_register_cap(int8, "OPTIRS_X_MAXREG") == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv("OPTIRS_X_MAXREG", bad)
        with pytest.raises(InvalidParameterError, match=f"OPTIRS_X_MAXREG={bad!r}"):
            formats_register_cap(int8, "OPTIRS_X_MAXREG")


def test_the_cuda_formats_chunk_knob(monkeypatch):
    """The formats kernels' chunk is ROUNDS_PER_CHUNK rounds of the block's 8 elements a thread (at
    least the plain kernels' chunk) unless ``OPTIRS_CUDA_FORMATS_CHUNK`` names a multiple of 1024
    elements (0: the default); anything else is refused naming it."""
    from types import SimpleNamespace

    from optirs.backends.cuda.formats import ROUNDS_PER_CHUNK, _chunk_elements

    ctx = SimpleNamespace(kernels=SimpleNamespace(chunk_elements=lambda block: 32 * block))
    monkeypatch.delenv("OPTIRS_CUDA_FORMATS_CHUNK", raising=False)
    assert _chunk_elements(ctx, 128) == 128 * 8 * ROUNDS_PER_CHUNK
    assert _chunk_elements(SimpleNamespace(kernels=SimpleNamespace(chunk_elements=lambda block: 1 << 20)), 128) == 1 << 20
    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CHUNK", "4096")
    assert _chunk_elements(ctx, 128) == 4096
    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CHUNK", "0")
    assert _chunk_elements(ctx, 256) == 256 * 8 * ROUNDS_PER_CHUNK
    for bad in ("1000", "-1024", "many"):
        monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CHUNK", bad)
        with pytest.raises(InvalidParameterError, match=f"OPTIRS_CUDA_FORMATS_CHUNK={bad!r}"):
            _chunk_elements(ctx, 128)


def test_max_nan_is_the_nan_propagating_maximum(rng):
    """fast_paths.max_nan (Adam's fast radicand: a NaN moment must leave the window) is numpy's
    maximum, NaN wherever either operand is (zeros of both signs left out: the hardware's choice)."""
    from numba import njit

    from optirs.backends.common.fast_paths import max_nan

    @njit
    def both(a, b, out):
        for i in range(a.shape[0]):
            out[i] = max_nan(a[i], b[i])

    a, b = _special_floats(rng, 300), _special_floats(rng, 300)[::-1].copy()
    a[:3], b[:3] = np.nan, [1.0, np.nan, -np.inf]
    b[3:6], a[3:6] = np.nan, [2.0, np.inf, -1.0]
    out = np.zeros_like(a)
    both(a, b, out)
    keep = ~((a == 0) & (b == 0))
    assert np.array_equal(out[keep], np.maximum(a, b)[keep], equal_nan=True)


def _same_words(run_a, run_b):
    """Two runs' (parameters, host state) byte for byte; returns the second's state."""
    (p_a, s_a), (p_b, s_b) = run_a, run_b
    for a, b in zip(p_a, p_b):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    for name in s_b:
        assert np.array_equal(s_a[name].view(np.uint8), s_b[name].view(np.uint8)), name
    return s_b


def test_cpu_int8_blocks_by_the_gradients_shift_are_the_contracts_bits(monkeypatch, rng):
    """The cpu's int8 block loop decodes a block's bfloat16 gradients by their shift alone where the
    block holds no NaN word (the contract's decode differs from the shift only there), and by the
    contract's decode elsewhere: the same words as the contract's decode everywhere, with NaN words
    of several payloads and signs in some blocks (whose scales are then the quiet NaN of the
    contract, never a payload's NaN), infs and overflows in others."""
    import optirs.backends.cpu.formats_kernels as K

    fmt = F.StepFormat("bfloat16", "bfloat16", "remainder8", "int8_sqrt", False)
    shapes = [(17 * F.BLOCK + 37,), (300,)]  # int8 blocks (at least MIN_INT8_SIZE), a small tensor
    params, grads = _problem(rng, shapes, fmt, 2)
    payloads = np.uint16([0x7F81, 0xFFA5, 0x7FC3, 0xFFFF])  # bfloat16 NaN words with payloads
    g = grads[1][0].reshape(-1)
    g[[3, F.BLOCK + 7, 4 * F.BLOCK + 200, 4 * F.BLOCK + 201]] = payloads  # blocks 0, 1 and 4
    g[[6 * F.BLOCK + 1, 7 * F.BLOCK + 2]] = _words(np.float32([np.inf, -3e38]), "bfloat16")
    runs = []
    for shift in (True, False):
        monkeypatch.setattr(K, "GRAD_SHIFT", shift)
        monkeypatch.setattr(K, "_POINTWISE", {})
        run = FormatRun("cpu", "adam", fmt, shapes)
        p = run.step([x.copy() for x in params], grads[0], 1)
        p = run.step(p, grads[1], 2)
        assert [k.py_func.__globals__["GRAD16"] for k in K._POINTWISE.values()] == [shift]
        runs.append((p, run.host_state()))
    s_exact = _same_words(*runs)
    scales = s_exact["exp_avg.scales"].view(np.uint32)
    nan = (scales & 0x7FFFFFFF) > 0x7F800000
    assert scales.size == 18 and nan[[0, 1, 4]].all() and not nan[[2, 3, 5, 6, 7]].any()
    assert np.all((scales[nan] & 0x7FFFFFFF) == 0x7FC00000)  # the contract's quiet NaN, not a payload's


@pytest.mark.parametrize("fmt", [("bfloat16", "bfloat16", "float32", "bfloat16", False),
                                 ("bfloat16", "bfloat16", None, "bfloat16", True)])
def test_cpu_bf16_state_nan_free_try_is_the_contracts_bits(monkeypatch, fmt, rng):
    """The cpu's bfloat16-state loop of bfloat16 parameters with a float32 master or none runs each
    sub-block by NaN-free encodes and decodes and redoes the elements whose new values hold a NaN or
    inf by the contract's forms (the loop compiled with the first try, ``FAST``, checked): the same
    words as the contract's forms alone, with NaN words of every payload and sign, infs and
    overflows in the gradients, parameters and state (the canonical NaN stored where one is new)."""
    import optirs.backends.cpu.formats_kernels as K

    fmt = F.StepFormat(*fmt)
    shapes = [(2 * K.SUB + 37,), (300,)]
    params, grads = _problem(rng, shapes, fmt, 2)
    specials = np.float32([np.nan, -np.nan, np.inf, -np.inf, 3e38, -3e38, 1e30])
    payloads = np.uint32([0x7F800001, 0xFFBFFFFF, 0x7FA5A5A5, 0xFF812345])  # NaNs with payloads
    for k, g in enumerate(grads[0] + params):
        where = rng.choice(g.size, 12, replace=False)
        vals = np.concatenate([specials, payloads.view(np.float32), np.float32([0.5])])
        g.reshape(-1)[where] = _words(vals, fmt.grad_dtype if k < 2 else fmt.param_dtype)
        if g.dtype == np.uint16:  # a bfloat16 NaN word with its payload, not the rounding's
            g.reshape(-1)[where[7:11]] = (payloads >> 16).astype(np.uint16)
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(K, "FAST_BF16", fast)
        monkeypatch.setattr(K, "_POINTWISE", {})
        run = FormatRun("cpu", "adam", fmt, shapes)
        p = [x.copy() for x in params]
        p = run.step(p, grads[0], 1)
        assert [k.py_func.__globals__["FAST"] for k in K._POINTWISE.values()] == [fast]
        for name in run.fs.slot_names:  # NaN state words with payloads, in both sub-blocks
            w = run.state[name].reshape(-1)
            w[[5, K.SUB + 9, 2 * K.SUB + 3]] = [0x7F81, 0xFFC3, 0xFFFF]
        p = run.step(p, grads[1], 2)
        runs.append((p, run.host_state()))
    s_exact = _same_words(*runs)
    for name in run.fs.slot_names:
        w = s_exact[name].view(np.uint16)
        nan = (w & 0x7FFF) > 0x7F80
        assert nan.sum() >= 3 and np.all((w[nan] & 0x7FFF) == 0x7FC0), name  # the NaNs met the fallback
