"""The OpenCL C encodings of the step formats (optirs_formats.h) against numpy and ml_dtypes.

docs/formats.md is the contract; each test kernel below runs one header function over many
inputs and compares with an independent computation: ml_dtypes' bfloat16 and numpy's float16
casts, exhaustive 16-bit decodings, numpy's searchsorted for the int8 map, a float64 rounding
for round24, and the contract's hash written in numpy for the random bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import optirs
from optirs.backends.common.opencl_source import expand_includes
from conftest import backend_step

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")

_STATUS = {s.name: s for s in optirs.list_backends()}.get("opencl")
pytestmark = [
    pytest.mark.opencl,
    pytest.mark.skipif(_STATUS is None or not _STATUS.available,
                       reason=f"backend opencl cannot open here: {getattr(_STATUS, 'reason', 'not installed')}"),
]

# One work-item per 8 inputs; each kernel applies one header function.
HARNESS = r'''
#include "optirs_formats.h"
#define V8(a, i) vload8(i, a)
/* float16: the aligned vector path, and the unaligned one or the element-by-element tail with
 * (i % 9) lanes valid */
__kernel void decode(__global const ushort *h, __global float *bf, __global float *f16, __global float *f16u) {
    const size_t i = get_global_id(0);
    vstore8(optirs_bf16_decode8(V8(h, i)), i, bf);
    vstore8(optirs_f16_load8(h + 8 * i, 8, 1), i, f16);
    vstore8(optirs_f16_load8(h + 8 * i, (int)(i % 9), 0), i, f16u);
}
__kernel void encode(__global const uint *u, __global ushort *bf, __global ushort *f16, __global ushort *f16u) {
    const size_t i = get_global_id(0);
    vstore8(optirs_bf16_rne8(V8(u, i)), i, bf);
    optirs_f16_store8(as_float8(V8(u, i)), f16 + 8 * i, 8, 1);
    optirs_f16_store8(as_float8(V8(u, i)), f16u + 8 * i, (int)(i % 9), 0);
}
__kernel void rand_bits(uint seed, uint step, uint stream, __global const uint *idx, __global uint *out) {
    const size_t i = get_global_id(0);
    vstore8(optirs_rand8(optirs_rand_key(seed, step, stream), V8(idx, i)), i, out);
}
__kernel void slot_bits(uint seed, uint step, int slot, __global const uint *idx, __global uint *out) {
    const size_t i = get_global_id(0);
    const uint key = optirs_rand_key(seed, step, OPTIRS_STATE_STREAM(slot));
    vstore8(optirs_slot_bits8(optirs_rand8(key, V8(idx, i)), slot), i, out);
}
__kernel void sr(__global const uint *u, __global const uint *r, __global ushort *out) {
    const size_t i = get_global_id(0);
    vstore8(optirs_bf16_sr8(V8(u, i), V8(r, i)), i, out);
}
__kernel void remainders(__global const uint *u, __global ushort *hi16, __global short *rem16, __global uint *join16,
                         __global uint *r24, __global ushort *hi8, __global char *rem8, __global uint *join8) {
    const size_t i = get_global_id(0);
    ushort8 hi; short8 rem; char8 rem_8;
    optirs_r16_split8(V8(u, i), &hi, &rem);
    vstore8(hi, i, hi16); vstore8(rem, i, rem16); vstore8(optirs_r16_join8(hi, rem), i, join16);
    const uint8 u24 = optirs_round24_8(V8(u, i));
    vstore8(u24, i, r24);
    optirs_r8_split8(u24, &hi, &rem_8);
    vstore8(hi, i, hi8); vstore8(rem_8, i, rem8); vstore8(optirs_r8_join8(hi, rem_8), i, join8);
}
__kernel void quantize(__global const float *maps, __global const uchar *tables, __global const float *x, float scale,
                       int finite, __global uchar *code, __global float *deq) {
    __local float q[256], mid[256];
    __local uchar table[OPTIRS_QT_SIZE];
    for (int j = get_local_id(0); j < 256; j += get_local_size(0)) { q[j] = maps[j]; mid[j] = maps[256 + j]; }
    for (int j = get_local_id(0); j < (int)OPTIRS_QT_SIZE; j += get_local_size(0)) table[j] = tables[j];
    barrier(CLK_LOCAL_MEM_FENCE);
    const size_t i = get_global_id(0);
    const uchar8 c = optirs_quantize8(V8(x, i), optirs_quantize_factors(scale), finite, mid, table);
    vstore8(c, i, code);
    vstore8(optirs_dequantize8(c, scale, q), i, deq);
}
/* a block's codes as the kernels take them: the signed map by its table, a positive map by its
 * packed words (optirs_packed_word of its table and midpoints) */
__kernel void quantize_block(__global const float *maps, __global const uchar *tables, __global const float *x,
                             float scale, int full, int is_signed, __global uint *code) {
    __local float mid[256];
    __local uchar table[OPTIRS_QT_SIZE];
    __local uint packed[OPTIRS_QT_WIDTH];
    for (int j = get_local_id(0); j < 256; j += get_local_size(0)) mid[j] = maps[256 + j];
    for (int j = get_local_id(0); j < (int)OPTIRS_QT_SIZE; j += get_local_size(0)) table[j] = tables[j];
    for (int b = get_local_id(0); b < (int)OPTIRS_QT_WIDTH; b += get_local_size(0))
        packed[b] = optirs_packed_word((uint)b, tables[b], maps[256 + tables[b]]);
    barrier(CLK_LOCAL_MEM_FENCE);
    const size_t i = get_global_id(0);
    if (is_signed)
        vstore8(optirs_quantize_block8(V8(x, i), scale, full, mid, table), i, code);
    else
        vstore8(optirs_quantize_block8_packed(V8(x, i), scale, full, packed) >> 16, i, code);
}
__kernel void table_constants(__global uint *out) {
    out[0] = OPTIRS_QT_LO; out[1] = OPTIRS_QT_HI; out[2] = OPTIRS_QT_WIDTH; out[3] = OPTIRS_QT_SIZE;
}
'''


@pytest.fixture(scope="module")
def ctx():
    return optirs.get_backend("opencl").ctx


@pytest.fixture(scope="module")
def prg(ctx):
    from optirs.backends.opencl import build_program

    # the formats programs' own float options (correctly rounded division where the device has it)
    options = [o for o in ctx.build_options if not o.startswith("-D")]
    program = build_program(ctx.context, ctx.device, expand_includes(HARNESS), options, "formats_harness")
    return type("Kernels", (), {k.function_name: k for k in program.all_kernels()})


def _run(ctx, kernel, n, *args):
    """Run kernel over n elements (n/8 work-items): numpy inputs are uploaded, ("out", dtype)
    placeholders allocated; returns the outputs as numpy."""
    bufs, outs = [], []
    for a in args:
        if isinstance(a, tuple) and a[0] == "out":
            d = cla.empty(ctx.queue, n, a[1])
            bufs.append(d.data)
            outs.append(d)
        elif isinstance(a, np.ndarray):
            bufs.append(cla.to_device(ctx.queue, a).data)
        else:
            bufs.append(a)
    kernel(ctx.queue, (n // 8,), None, *bufs)
    return [o.get() for o in outs]


def _float_bits(rng, n):
    """Random float32 bit patterns covering every class, plus the edge cases."""
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 1, 0x807FFFFF,
                        0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x477FF000,
                        0x477FEFFF, 0x38800000, 0x33000000, 0x33000001, 0x387FFFFF, 0x3F800080, 0x3F800180,
                        0x3F80007F, 0x00000080, 0x00000180, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000], np.uint32)
    x = rng.integers(0, 2 ** 32, n - len(special), dtype=np.uint64).astype(np.uint32)
    near = (rng.normal(size=n // 4).astype(np.float32)).view(np.uint32)  # ordinary magnitudes
    x[: len(near)] = near
    return np.concatenate([special, x])


def _lanes(n):
    """The lanes the decode and encode kernels' second float16 output holds: (i % 9) of work-item i's 8."""
    return (np.arange(n) % 8) < (np.arange(n) // 8) % 9


def test_decodings_exhaustive(ctx, prg):
    h = np.arange(65536, dtype=np.uint16)
    bf, f16, f16u = _run(ctx, prg.decode, 65536, h, ("out", np.float32), ("out", np.float32), ("out", np.float32))
    want_bf = h.view(ml_dtypes.bfloat16).astype(np.float32)
    want_f16 = h.view(np.float16).astype(np.float32)
    live = _lanes(h.size)
    assert np.all(f16u[~live] == 0)  # lanes past the valid ones read as 0
    for got, want in ((bf, want_bf), (f16, want_f16), (f16u[live], want_f16[live])):
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # signed zeros too


def test_encodings_match_ml_dtypes_and_numpy(ctx, prg):
    u = _float_bits(np.random.default_rng(0), 1 << 16)
    bf, f16, f16u = _run(ctx, prg.encode, u.size, u, ("out", np.uint16), ("out", np.uint16), ("out", np.uint16))
    x = u.view(np.float32)
    nan = np.isnan(x)
    assert np.array_equal(bf[~nan], x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))
    # the contract's NaN: 0x7FC0 | sign
    assert np.array_equal(bf[nan], ((u[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0)
    with np.errstate(over="ignore"):
        want_f16 = x.astype(np.float16)
    assert np.array_equal(f16, want_f16.view(np.uint16))  # NaNs keep numpy's payload bits
    live = _lanes(u.size)
    assert np.array_equal(f16u[live], want_f16.view(np.uint16)[live])


def _fmix32(h):
    h = h.astype(np.uint64)
    m = np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & m
    h ^= h >> np.uint64(16)
    return h


def _rand(seed, step, stream, i):
    key = _fmix32(np.uint64(seed) ^ _fmix32(np.array([(step * 4 + stream) & 0xFFFFFFFF], np.uint64)))
    return _fmix32(key ^ ((i.astype(np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF))).astype(np.uint32)


@pytest.mark.parametrize("seed,step,stream", [(0, 1, 0), (12345, 7, 2), (2 ** 32 - 1, 2 ** 30 + 3, 3)])
def test_random_bits_are_the_contract_hash(ctx, prg, seed, step, stream):
    i = np.concatenate([np.arange(4096, dtype=np.uint32), np.array([2 ** 32 - 8 + k for k in range(8)], np.uint32)])
    (got,) = _run(ctx, prg.rand_bits, i.size, np.uint32(seed), np.uint32(step), np.uint32(stream), i,
                  ("out", np.uint32))
    assert np.array_equal(got, _rand(seed, step, stream, i))
    assert len(np.unique(got)) > 0.99 * got.size


@pytest.mark.parametrize("slot", [0, 1, 2])
def test_state_slot_bits_are_the_contract_halves(ctx, prg, slot):
    """Slots 0 and 1 take the low and the high half of stream 1's word, slot 2 the low half of
    stream 2's (docs/formats.md, "Random bits")."""
    i = np.concatenate([np.arange(2048, dtype=np.uint32), np.array([2 ** 32 - 8 + k for k in range(8)], np.uint32)])
    (got,) = _run(ctx, prg.slot_bits, i.size, np.uint32(99), np.uint32(5), np.int32(slot), i, ("out", np.uint32))
    word = _rand(99, 5, 1 + slot // 2, i)
    assert np.array_equal(got, (word >> 16) if slot == 1 else (word & 0xFFFF))


def test_stochastic_bf16_rounding(ctx, prg):
    rng = np.random.default_rng(1)
    u = _float_bits(rng, 1 << 14)
    r = rng.integers(0, 2 ** 32, u.size, dtype=np.uint64).astype(np.uint32)
    (got,) = _run(ctx, prg.sr, u.size, u, r, ("out", np.uint16))
    x = u.view(np.float32)
    finite = np.isfinite(x)
    # the result is one of the two bfloat16 neighbours: truncation, or truncation + 1 ulp
    trunc = (u[finite] >> 16).astype(np.uint16)
    assert np.all((got[finite] == trunc) | (got[finite] == trunc + 1))
    up = got[finite] == trunc + 1
    assert np.array_equal(up, (u[finite] & 0xFFFF) + (r[finite] & 0xFFFF) >= 0x10000)
    inf, nan = np.isinf(x), np.isnan(x)  # round to nearest: inf stays, NaN is 0x7FC0 | sign
    assert np.array_equal(got[inf], x[inf].astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.array_equal(got[nan], ((u[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0)


def test_stochastic_bf16_rounding_is_unbiased(ctx, prg):
    """The mean of many roundings of one value with the contract's random bits is the value."""
    n = 1 << 16
    for value in (1.0 + 2 ** -9, -3.14159, 1e-3, 7.123e5):
        u = np.full(n, np.float32(value).view(np.uint32), np.uint32)
        (r,) = _run(ctx, prg.rand_bits, n, np.uint32(3), np.uint32(1), np.uint32(0), np.arange(n, dtype=np.uint32),
                    ("out", np.uint32))
        (got,) = _run(ctx, prg.sr, n, u, r, ("out", np.uint16))
        vals = got.view(ml_dtypes.bfloat16).astype(np.float64)
        lo, hi = np.unique(vals)[[0, -1]]
        p = (float(np.float32(value)) - lo) / (hi - lo)  # chance of rounding up
        stderr = (hi - lo) * np.sqrt(p * (1 - p) / n)
        assert abs(vals.mean() - float(np.float32(value))) < 5 * stderr + 1e-30


def _round24_reference(x):
    """x rounded to 15 explicit mantissa bits (the top 24 bits of float32), nearest even, in float64;
    subnormals on the same grid as float32's (2**-149 * 256)."""
    x = x.astype(np.float64)
    mant, exp = np.frexp(x)
    exp = np.maximum(exp, -125)  # float32's subnormal range shares the smallest normal's spacing
    ulp = np.ldexp(1.0, exp - 16)  # 15 explicit mantissa bits kept
    return np.round(x / ulp) * ulp


def test_remainders_and_round24(ctx, prg):
    u = _float_bits(np.random.default_rng(2), 1 << 16)
    hi16, rem16, join16, r24, hi8, rem8, join8 = _run(
        ctx, prg.remainders, u.size, u, ("out", np.uint16), ("out", np.int16), ("out", np.uint32),
        ("out", np.uint32), ("out", np.uint16), ("out", np.int8), ("out", np.uint32))
    x = u.view(np.float32)
    nan = np.isnan(x)
    quiet = (u & 0x80000000) | 0x7FC00000  # a NaN master splits as the quiet NaN of its sign
    # remainder16: bfloat16 + int16 is the exact float32 master, and the bfloat16 is its nearest
    assert nan.any() and np.array_equal(join16[~nan], u[~nan]) and np.array_equal(join16[nan], quiet[nan])
    assert np.array_equal(hi16[nan], quiet[nan] >> 16) and not rem16[nan].any() and not rem8[nan].any()
    finite = np.isfinite(x) & (np.abs(x) < np.float32(3.38e38))
    err = np.abs(hi16[finite].view(ml_dtypes.bfloat16).astype(np.float64) - x[finite].astype(np.float64))
    ulp = np.abs(((u[finite] >> 16) + 1 << 16).astype(np.uint32).view(np.float32).astype(np.float64)
                 - ((u[finite] >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64))
    assert np.all(err <= ulp / 2)
    # round24: nearest even on the 8 dropped bits; the 24-bit master is rounded x
    ok = np.isfinite(x)
    want = _round24_reference(x[ok])
    got = (r24[ok] << 8).view(np.float32).astype(np.float64)
    keep = np.abs(want) < 3.4e38  # the largest values round to inf in both
    assert np.array_equal(got[keep], want[keep])
    assert np.array_equal(r24[~ok], np.where(nan, quiet, u)[~ok] >> 8)
    # remainder8: bfloat16 + int8 gives the 24-bit master back exactly
    assert np.array_equal(join8, r24 << 8)
    err8 = np.abs(hi8[finite].view(ml_dtypes.bfloat16).astype(np.float64) - got[finite[ok]])
    assert np.all(err8 <= ulp / 2)


# Adam's division by its uniform bias correction (optirs_elementwise.h) against the division, over
# the square roots of the float32 with bit patterns start + k * step (NaN and -0 kept as they are).
DIVISION = r'''
#pragma OPENCL FP_CONTRACT OFF
#ifdef OPTIRS_TEST_ULPS /* the reciprocal's approximation off by OPTIRS_TEST_ULPS units in the last place */
#define OPTIRS_RCP_APPROX(b) as_float(as_uint(1.0f / (b)) + (uint)(OPTIRS_TEST_ULPS))
#endif
#include "optirs_program.h"
#include "optirs_scalars.h"
#define T float
#define SUFFIX v1
#include "optirs_elementwise.h"
__kernel void divide(float b, uint start, uint step, uint count, __global int *bad) {
    for (uint k = get_global_id(0); k < count; k += get_global_size(0)) {
        const uint bits = start + k * step;
        const float v = as_float(bits);
        const float a = v >= 0.0f ? sqrt(v) : v;
        if (as_uint(divide_by_uniform_v1(a, b)) != as_uint(a / b)) {
            atomic_inc(bad);
            bad[1] = (int)bits;
        }
    }
}
'''


def _divisors():
    return [np.sqrt(np.float32(1) - np.float32(b2) ** np.float32(t)) for b2, t in
            [(0.999, 1), (0.999, 2), (0.999, 7), (0.999, 1000), (0.99, 1), (0.95, 3), (0.9999, 1), (0.0, 1)]]


def test_uniform_division_refinement_is_the_division(ctx):
    """The inline-PTX division's arithmetic (optirs_elementwise.h, ``OPTIRS_NV_PTX``) on any device:
    with its reciprocal approximation replaced by the correctly rounded one moved 1 unit in the last
    place down or up (rcp.approx's error bound) or 64 (which only the refinement's Newton step
    brings back: without it this fails), the quotient is the division's for the square roots of a
    sample of float32 (every 65521st bit pattern), NaNs, -0 and inf (without the select of 0, inf
    and NaN this fails too)."""
    from optirs.backends.opencl import build_program

    if "-cl-fp32-correctly-rounded-divide-sqrt" not in ctx.build_options:
        pytest.skip("the device's division is not correctly rounded: no reference to compare with")
    for ulps in (-64, -1, 1, 64):
        options = [o for o in ctx.build_options if not o.startswith("-D")] + [
            "-DOPTIRS_NV_PTX=1", f"-DOPTIRS_TEST_ULPS={ulps}"]
        divide = build_program(ctx.context, ctx.device, expand_includes(DIVISION), options, "division_emulated").divide
        for b in _divisors()[::2] + [np.nextafter(np.float32(1), np.float32(0))]:
            bad = cla.zeros(ctx.queue, 2, np.int32)
            for start, step, count in ((0, 65521, 0x7F800000 // 65521 + 1), (0x7F800000, 1, 1), (0x7FC00000, 1, 32),
                                         (0x80000000, 1, 1)):
                divide(ctx.queue, (256,), None, np.float32(b), np.uint32(start), np.uint32(step), np.uint32(count),
                       bad.data)
            got = bad.get()
            assert got[0] == 0, (ulps, float(b), hex(int(got[1]) & 0xFFFFFFFF))


def test_division_by_a_uniform_divisor_is_the_division(ctx):
    """The inline-PTX form of Adam's ``sqrt(v) / sqrt(1 - beta2**t)`` (the reciprocal taken once, no
    range check) against the division, for the square root of every non-negative float32 ``v``,
    of NaNs and of -0, by the bias corrections of several betas and steps, and 1 (the cuda kernels'
    check). NVIDIA's driver only: elsewhere the function is the division itself."""
    from optirs.backends.opencl import build_program
    from optirs.backends.opencl.formats import nv_level

    if not nv_level(ctx):
        pytest.skip("the inline-PTX division is built on NVIDIA's OpenCL driver only (elsewhere it is `/`)")
    options = [o for o in ctx.build_options if not o.startswith("-D")] + ["-DOPTIRS_NV_PTX=1"]
    divide = build_program(ctx.context, ctx.device, expand_includes(DIVISION), options, "division").divide
    for b in _divisors() + [np.float32(0.7373), np.nextafter(np.float32(1), np.float32(0))]:
        bad = cla.zeros(ctx.queue, 2, np.int32)
        for start, count, size in ((0, 0x7F800001, 1 << 18), (0x7FC00000, 32, 32), (0x80000000, 1, 32)):
            divide(ctx.queue, (size,), None, np.float32(b), np.uint32(start), np.uint32(1), np.uint32(count),
                   bad.data)
        got = bad.get()
        assert got[0] == 0, (float(b), hex(int(got[1]) & 0xFFFFFFFF))


# The int8 blocks' reciprocal scale (optirs_rcp_fast) against the division. Not emulated on other
# devices as Adam's division is: one Newton step from an approximation 1 ulp off misses the correctly
# rounded reciprocal near ties (x = 2^k * (2 - 2^-23), 1 ulp low), so only the hardware's own
# approximation can be checked, over the whole window.
RECIPROCAL = r'''
#include "optirs_formats.h"
__kernel void reciprocal(uint start, uint step, uint count, __global int *bad) {
    for (uint k = get_global_id(0); k < count; k += get_global_size(0)) {
        const float x = as_float(start + k * step);
        if (optirs_rcp_in_window(x) && as_uint(optirs_rcp_fast(x)) != as_uint(1.0f / x)) {
            atomic_inc(bad);
            bad[1] = (int)as_uint(x);
        }
    }
}
'''


def test_block_reciprocal_is_the_division_on_nvidia(ctx):
    """The inline-PTX block reciprocal (rcp.approx.ftz and one Newton step, ptxas's own expansion of
    div.rn there) against 1 / x for every x of its window and just outside it (the cuda kernels'
    rcp_fast check, the same PTX). NVIDIA's driver only: elsewhere it is the division itself."""
    from optirs.backends.opencl import build_program
    from optirs.backends.opencl.formats import nv_level

    if not nv_level(ctx):
        pytest.skip("the inline-PTX reciprocal is built on NVIDIA's OpenCL driver only (elsewhere it is `/`)")
    options = [o for o in ctx.build_options if not o.startswith("-D")] + ["-DOPTIRS_NV_PTX=1"]
    prog = build_program(ctx.context, ctx.device, expand_includes(RECIPROCAL), options, "reciprocal")
    bad = cla.zeros(ctx.queue, 2, np.int32)
    prog.reciprocal(ctx.queue, (1 << 18,), None, np.uint32(0x00800000 - 16), np.uint32(1),
                    np.uint32(0x7DFFFFFF - 0x00800000 + 33), bad.data)
    got = bad.get()
    assert got[0] == 0, hex(int(got[1]) & 0xFFFFFFFF)


# The int8 square-root codes (optirs_formats.h): a block's codes and values, every code of a root,
# and the block factors' divisions. OPTIRS_TEST_ULPS puts the reciprocal's and the reciprocal square
# root's approximations, moved that many units in the last place, in place of NVIDIA's (the inline
# PTX paths' C on any device).
SQRT = r"""
#pragma OPENCL FP_CONTRACT OFF
#ifdef OPTIRS_TEST_ULPS
#define OPTIRS_RCP_APPROX(b) as_float(as_uint(1.0f / (b)) + (uint)(OPTIRS_TEST_ULPS))
#define OPTIRS_RSQRT_APPROX(x) as_float(as_uint(1.0f / sqrt(x)) + (uint)(OPTIRS_TEST_ULPS))
#endif
#include "optirs_formats.h"
__kernel void sqrt_block(__global const float *x, float scale, int is_signed, __global uint *code,
                         __global float *val) {
    const size_t i = get_global_id(0);
    const uint2 raw = optirs_pack_byte0x8(optirs_sqrt_block8(vload8(i, x), scale, is_signed));
    vstore2(raw, i, code);
    vstore8(optirs_sqrt_values8(raw, is_signed, scale), i, val);
}
/* the codes of u and -u at k = 1 by both forms, u of bits start + k * step, against rint of the IEEE
 * root */
__kernel void sqrt_roots(uint start, uint step, uint count, __global int *bad) {
    for (uint k = get_global_id(0); k < count; k += get_global_size(0)) {
        const float8 u = as_float8(start + (8u * k + (uint8)(0u, 1u, 2u, 3u, 4u, 5u, 6u, 7u)) * step);
        const uint8 want = convert_uint8(rint(sqrt(u)));
        const uint8 plus = optirs_sqrt_words8(u, 1.0f, 0, 1) & 0xFFu;
        const uint8 minus = optirs_sqrt_words8(-u, 1.0f, 1, 1) & 0xFFu;
        const uint8 plus_ieee = optirs_sqrt_words8(u, 1.0f, 0, 0) & 0xFFu;
        if (any(plus != want) || any(minus != ((0u - want) & 0xFFu)) || any(plus_ieee != want)) {
            atomic_inc(bad);
            bad[1] = (int)(start + 8u * k * step);
        }
    }
}
/* the fast root against the IEEE one, u of bits start + k * step (from the floor, 2^-100, to 2^98: a
 * usual block's values) */
__kernel void sqrt_fast_roots(uint start, uint step, uint count, __global int *bad) {
    for (uint k = get_global_id(0); k < count; k += get_global_size(0)) {
        const uint8 bits = start + (8u * k + (uint8)(0u, 1u, 2u, 3u, 4u, 5u, 6u, 7u)) * step;  /* clamped below 2^98 */
        const float8 u = as_float8(min(bits, 0x707FFFFFu));
        if (any(as_uint8(optirs_sqrt_fast8(u)) != as_uint8(sqrt(u)))) {
            atomic_inc(bad);
            bad[1] = (int)(start + 8u * k * step);
        }
    }
}
/* the fast divisions of the block factors against the division, for scales of bits start + k * step */
__kernel void sqrt_divisions(uint start, uint step, uint count, __global int *bad) {
    for (uint k = get_global_id(0); k < count; k += get_global_size(0)) {
        const float scale = as_float(start + k * step);
        for (int sg = 0; sg < 2; ++sg) {
            const float n = OPTIRS_SQRT_N(sg), n2 = OPTIRS_SQRT_N2(sg);
            if ((scale >= 0x1p-80f && scale < 0x1p98f
                 && as_uint(optirs_div_fast(n, optirs_sqrt_fast(scale))) != as_uint(n / sqrt(scale)))
                || (optirs_dividend_in_window(scale) && as_uint(optirs_div_fast(scale, n2)) != as_uint(scale / n2))) {
                atomic_inc(bad);
                bad[1] = (int)as_uint(scale);
            }
        }
    }
}
"""


def _nv(ctx):
    from optirs.backends.opencl.formats import nv_level

    return nv_level(ctx)


def _sqrt_program(ctx, ulps=None, nv=False):
    from optirs.backends.opencl import build_program

    options = [o for o in ctx.build_options if not o.startswith("-D")]
    options += (["-DOPTIRS_NV_PTX=1"] if nv else []) + ([f"-DOPTIRS_TEST_ULPS={ulps}"] if ulps is not None else [])
    return build_program(ctx.context, ctx.device, expand_includes(SQRT), options, f"sqrt_codes{ulps}{int(nv)}")


def _sqrt_cases(signed):
    """(scale, values) pairs: random blocks at scales over the float32 range (the fast forms' window
    ends, tiny and huge ones by the IEEE forms), every tie of a root (scale n**2: k = 1) with its
    neighbours, and zero, NaN and inf scales."""
    f32 = np.float32
    rng = np.random.default_rng(8)
    n = F.sqrt_levels(signed)
    cases = []
    for s in (1.0, 3.7e-5, 1e-40, 1e-45, 2.0 ** -100, 2.0 ** -96, 2.0 ** -80, np.nextafter(f32(2.0 ** -80), f32(0)),
              2.0 ** -51, 2.0 ** -72, 1e-20, np.nextafter(f32(2.0 ** 98), f32(0)), 2.0 ** 98, 2.0 ** 72, 1e30, 3e38):
        x = (rng.uniform(-1 if signed else 0, 1, 4096) * f32(s)).astype(np.float32)
        x[:3] = [f32(s), -f32(s) if signed else f32(0), f32(0)]
        cases.append((f32(s), x))
    k = np.arange(1, n + 1)
    ties = ((k - 0.5) ** 2).astype(np.float32)
    x = np.concatenate([np.nextafter(ties, f32(0)), ties, np.nextafter(ties, f32(np.inf)), k.astype(np.float32) ** 2])
    cases.append((f32(n * n), np.concatenate([x, -x]) if signed else x))
    cases += [(f32(0), np.zeros(8, np.float32)), (f32(np.nan), rng.standard_normal(8).astype(np.float32)),
              (f32(np.inf), np.array([1, -2, np.inf, 0, -np.inf, 3e38, 5, 0], np.float32))]
    return [(s, np.concatenate([x, np.zeros(-x.size % 8, np.float32)])) for s, x in cases]


def _check_sqrt_blocks(ctx, prog):
    kernel = cl.Kernel(prog, "sqrt_block")
    for signed in (True, False):
        for scale, x in _sqrt_cases(signed):
            code, val = _run(ctx, kernel, x.size, x, scale, np.int32(signed), ("out", np.uint32),
                             ("out", np.float32))
            code = code[: x.size // 4].view(np.uint8)
            want = F.sqrt_quantize(x, scale, signed)
            assert np.array_equal(code, want), (signed, scale)
            want_val = F.sqrt_dequantize(want, scale, signed)
            assert np.array_equal(np.isnan(val), np.isnan(want_val)), (signed, scale)
            ok = ~np.isnan(want_val)
            assert np.array_equal(val[ok].view(np.uint32), want_val[ok].view(np.uint32)), (signed, scale)


# The float8 state (optirs_formats.h): a block's codes and values by the step kernels' own functions;
# on NVIDIA's driver from sm_89 on (nv_level 3) by the hardware's conversions.
FP8 = r"""
#pragma OPENCL FP_CONTRACT OFF
#include "optirs_formats.h"
__kernel void fp8_block(__global const float *x, float scale, __global uint *code, __global float *val) {
    const size_t i = get_global_id(0);
    const uint2 raw = optirs_fp8_block8(vload8(i, x), scale);
    vstore2(raw, i, code);
    vstore8(optirs_fp8_values8(raw, scale), i, val);
}
__kernel void fp8_values(__global const uint *code, float scale, __global float *val) {
    const size_t i = get_global_id(0);
    vstore8(optirs_fp8_values8(vload2(i, code), scale), i, val);
}
"""


def test_float8_codes_are_the_contracts(ctx):
    """A block's float8 codes and their values (optirs_fp8_block8, optirs_fp8_values8) against
    optirs.core.formats' fp8_quantize and fp8_dequantize, bit for bit (NaN where NaN): random blocks
    at scales over the float32 range (the divisions' window ends, pre = 2**64 below 2**-64, tiny and
    huge scales), zero, NaN and inf scales, and every byte's value; by the hardware's conversions on
    NVIDIA's driver from sm_89 on, by integer arithmetic elsewhere."""
    from optirs.backends.opencl import build_program

    if "-cl-fp32-correctly-rounded-divide-sqrt" not in ctx.build_options:
        pytest.skip("the device's division is not correctly rounded: no reference to compare with")
    level = _nv(ctx)
    options = [o for o in ctx.build_options if not o.startswith("-D")] + ["-DOPTIRS_FMT_STATE=4"]
    options += [f"-DOPTIRS_NV_PTX={level}"] if level else []
    prog = build_program(ctx.context, ctx.device, expand_includes(FP8), options, f"fp8_codes{level}")
    f32 = np.float32
    rng = np.random.default_rng(9)
    cases = []
    for scale in (1.0, 3.7e-5, 2.0 ** -64, np.nextafter(f32(2.0 ** -64), f32(0)), 1e-40, 1e-45, 2.0 ** -51,
                  np.nextafter(f32(2.0 ** 49), f32(0)), 2.0 ** 49, 2.0 ** 72, 1e30, 3e38):
        x = (rng.uniform(-1, 1, 4096) * f32(scale)).astype(np.float32)
        x[:3] = [f32(scale), -f32(scale), f32(0)]
        cases.append((f32(scale), x))
    cases += [(f32(0), np.zeros(8, np.float32)), (f32(np.nan), rng.standard_normal(8).astype(np.float32)),
              (f32(np.inf), np.array([1, -2, np.inf, 0, -np.inf, 3e38, 5, 0], np.float32))]
    block = cl.Kernel(prog, "fp8_block")
    for scale, x in cases:
        code, val = _run(ctx, block, x.size, x, scale, ("out", np.uint32), ("out", np.float32))
        code = code[: x.size // 4].view(np.uint8)
        want = F.fp8_quantize(x, scale)
        assert np.array_equal(code, want), scale
        want_val = F.fp8_dequantize(want, scale)
        assert np.array_equal(np.isnan(val), np.isnan(want_val)), scale
        ok = ~np.isnan(want_val)
        assert np.array_equal(val[ok].view(np.uint32), want_val[ok].view(np.uint32)), scale
    every = np.arange(256, dtype=np.uint8)
    for scale in (f32(448), f32(3.7e-5), f32(1e-40)):
        (val,) = _run(ctx, cl.Kernel(prog, "fp8_values"), 256, every.view(np.uint32), scale, ("out", np.float32))
        want_val = F.fp8_dequantize(every, scale)
        assert np.array_equal(np.isnan(val), np.isnan(want_val)), scale
        ok = ~np.isnan(want_val)
        assert np.array_equal(val[ok].view(np.uint32), want_val[ok].view(np.uint32)), scale


def test_sqrt_codes_are_the_contracts(ctx):
    """A block's square-root codes and their values (optirs_sqrt_block8, optirs_sqrt_values8, the
    step kernels' own functions) against optirs.core.formats' sqrt_quantize and sqrt_dequantize, bit
    for bit: random blocks at scales over the float32 range (the fast forms' window ends, tiny and
    huge scales), every tie of a root and its neighbours, zero, NaN and inf scales; signed and unsigned."""
    if "-cl-fp32-correctly-rounded-divide-sqrt" not in ctx.build_options:
        pytest.skip("the device's division and sqrt are not correctly rounded: no reference to compare with")
    _check_sqrt_blocks(ctx, _sqrt_program(ctx, nv=bool(_nv(ctx))))


def test_sqrt_code_of_every_root(ctx):
    """The code of u and of -u at k = 1 (optirs_sqrt_words8: the clamp, the root, the rounding by one
    add; both forms) against rint of the IEEE root, for every float32 u from 0 to 65025 * (1 + 2**-22),
    and the fast root against the IEEE one for every float32 below 2**98, the most a usual block's
    values reach (NVIDIA's driver: inline PTX's rsqrt.approx and the fast path's refinement), or
    every 97th (997th) of them elsewhere."""
    if "-cl-fp32-correctly-rounded-divide-sqrt" not in ctx.build_options:
        pytest.skip("the device's sqrt is not correctly rounded: no reference to compare with")
    nv = bool(_nv(ctx))
    prog = _sqrt_program(ctx, nv=nv)
    top = int(np.array([65025 * (1 + 2.0 ** -22)], np.float32).view(np.uint32)[0]) + 1
    step = 1 if nv else 97
    bad = cla.zeros(ctx.queue, 2, np.int32)
    prog.sqrt_roots(ctx.queue, (1 << 16,), None, np.uint32(0), np.uint32(step), np.uint32(-(-top // (8 * step))),
                    bad.data)
    floor, roots = (int(np.float32(v).view(np.uint32)) for v in (2.0**-100, 2.0**98))
    step = 1 if nv else 997
    prog.sqrt_fast_roots(ctx.queue, (1 << 16,), None, np.uint32(floor), np.uint32(step),
                         np.uint32(-(-(roots - floor) // (8 * step))), bad.data)
    got = bad.get()
    assert got[0] == 0, hex(int(got[1]) & 0xFFFFFFFF)


def test_sqrt_fast_paths_refinement_is_the_ieee_result(ctx):
    """The inline-PTX paths' arithmetic (optirs_div_fast, optirs_sqrt_fast8) on any device, their
    approximations replaced by the correctly rounded ones moved 1 unit in the last place down or up:
    the block factors' divisions are the division's over a sample of their windows, every code of a
    sample of roots is rint of the IEEE root, a sample of fast roots are the IEEE ones, and every block of test_sqrt_codes_are_the_contracts
    is the contract's."""
    if "-cl-fp32-correctly-rounded-divide-sqrt" not in ctx.build_options:
        pytest.skip("the device's division and sqrt are not correctly rounded: no reference to compare with")
    top = int(np.array([65025 * (1 + 2.0 ** -22)], np.float32).view(np.uint32)[0]) + 1
    for ulps in (-1, 1):
        prog = _sqrt_program(ctx, ulps=ulps)
        bad = cla.zeros(ctx.queue, 2, np.int32)
        prog.sqrt_divisions(ctx.queue, (256,), None, np.uint32(0), np.uint32(65521), np.uint32(0x7F800000 // 65521 + 1),
                            bad.data)
        prog.sqrt_roots(ctx.queue, (1 << 12,), None, np.uint32(0), np.uint32(997), np.uint32(-(-top // (8 * 997))),
                        bad.data)
        floor, roots = (int(np.float32(v).view(np.uint32)) for v in (2.0**-100, 2.0**98))
        prog.sqrt_fast_roots(ctx.queue, (1 << 12,), None, np.uint32(floor), np.uint32(99991),
                             np.uint32(-(-(roots - floor) // (8 * 99991))), bad.data)
        got = bad.get()
        assert got[0] == 0, (ulps, hex(int(got[1]) & 0xFFFFFFFF))
        _check_sqrt_blocks(ctx, prog)


def test_sqrt_divisions_are_the_division_on_nvidia(ctx):
    """The block factors' inline-PTX forms (n / sqrt(scale) by optirs_div_fast and optirs_sqrt_fast in
    the fast forms' window, scale / n**2 by optirs_div_fast in its) against the IEEE operations for
    every non-negative float32 scale. NVIDIA's driver only:
    elsewhere they are the division itself."""
    if not _nv(ctx):
        pytest.skip("the inline-PTX division is built on NVIDIA's OpenCL driver only (elsewhere it is `/`)")
    prog = _sqrt_program(ctx, nv=True)
    bad = cla.zeros(ctx.queue, 2, np.int32)
    prog.sqrt_divisions(ctx.queue, (1 << 18,), None, np.uint32(0), np.uint32(1), np.uint32(0x7F800001), bad.data)
    got = bad.get()
    assert got[0] == 0, hex(int(got[1]) & 0xFFFFFFFF)


def test_bucket_table_constants_match_the_host(ctx, prg):
    from optirs.backends.common import int8_buckets as B

    (out,) = _run(ctx, prg.table_constants, 8, ("out", np.uint32))
    assert out[:4].tolist() == [B.LO, B.HI, B.WIDTH, B.SIZE]


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code(ctx, prg, signed):
    """The two-lookup quantizer against searchsorted over the midpoints: on every midpoint, one ulp
    either side, every bucket's ends, random values, zeros, NaN and inf."""
    from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints

    q, mid, table = F.dynamic_map(signed), padded_midpoints(signed), bucket_table(signed)
    rng = np.random.default_rng(3)
    scale = np.float32(1)
    edges = (np.arange(0, 0x8000, 7, dtype=np.uint32) << 16).view(np.float32)
    y = np.concatenate([mid[:255], np.nextafter(mid[:255], np.float32(np.inf)),
                        np.nextafter(mid[:255], np.float32(-np.inf)), q, edges, -edges,
                        rng.uniform(-1.1 if signed else 0, 1.1, 1 << 14).astype(np.float32),
                        np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1, -1], np.float32)]).astype(np.float32)
    y = np.concatenate([y, np.zeros(-y.size % 8, np.float32)])
    maps = np.concatenate([q, mid]).astype(np.float32)
    code, deq = _run(ctx, prg.quantize, y.size, maps, table, y, scale, np.int32(0), ("out", np.uint8),
                     ("out", np.float32))
    want = np.searchsorted(mid[:255], y, side="left")  # the number of mid[k] < y
    want[np.isnan(y)] = 0
    assert np.array_equal(code, want.astype(np.uint8))
    assert np.array_equal(deq, q[code] * scale)
    x = y[:8] * np.float32(0.37)
    (zero_code, _) = _run(ctx, prg.quantize, 8, maps, table, x, np.float32(0), np.int32(1), ("out", np.uint8),
                          ("out", np.float32))
    assert np.array_equal(zero_code, np.full(8, np.searchsorted(mid[:255], 0.0, side="left"), np.uint8))
    # block scales over the float32 range, subnormal ones included (pre = 2**64), against numpy's
    # (x * pre) * inv: a code a quotient x / scale would move is caught at the midpoints. Blocks
    # as the kernels make them (every |x| at most the scale) take the finite-block bucket too
    for scale in (np.float32(3.7e-3), np.float32(1.5e30), np.float32(2.0 ** -127 * 1.37), np.float32(1e-45)):
        with np.errstate(over="ignore"):  # the largest values times 1.5e30: inf, code 255
            xs = (y[np.isfinite(y)] * scale).astype(np.float32)
        xs = np.concatenate([xs, np.zeros(-xs.size % 8, np.float32)])
        code, _ = _run(ctx, prg.quantize, xs.size, maps, table, xs, scale, np.int32(0), ("out", np.uint8),
                       ("out", np.float32))
        assert np.array_equal(code, F.quantize_host(xs, scale, signed)), scale
        block = np.clip(xs, -scale, scale)
        code, _ = _run(ctx, prg.quantize, block.size, maps, table, block, scale, np.int32(1), ("out", np.uint8),
                       ("out", np.float32))
        assert np.array_equal(code, F.quantize_host(block, scale, signed)), scale
        # the kernels' block quantizer (a positive map by its packed words), full lanes or not
        for full in (1, 0):
            (code,) = _run(ctx, prg.quantize_block, block.size, maps, table, block, scale, np.int32(full),
                           np.int32(signed), ("out", np.uint32))
            assert np.array_equal(code, F.quantize_host(block, scale, signed)), (scale, full)
    # ... on the general path's inputs (NaN, inf, values past the scale, every bucket's ends)
    (code,) = _run(ctx, prg.quantize_block, y.size, maps, table, y, np.float32(1), np.int32(0), np.int32(signed),
                   ("out", np.uint32))
    assert np.array_equal(code, want), signed


# ---------------------------------------------------------------- the formats capability's step

from optirs.core import formats as F  # noqa: E402
from optirs.core import reference as R  # noqa: E402
from optirs.core.definitions import DEFINITIONS  # noqa: E402
from optirs.core.layout import TensorLayout  # noqa: E402

# Odd sizes put later tensors at unaligned offsets; 4100 and 8195 keep int8 blocks (8195 spans
# two chunks and ends in a partial block), the others are small (float32 state under int8).
SHAPES = [(7,), (4, 3), (4100,), (5,), (8195,), (2, 2)]
FORMATS = [
    F.StepFormat("bfloat16", "bfloat16", None, "float32", False),
    F.StepFormat("bfloat16", "float32", None, "bfloat16", True),
    F.StepFormat("bfloat16", "bfloat16", "float32", "int8", False),
    F.StepFormat("bfloat16", "bfloat16", "remainder16", "bfloat16", False),
    F.StepFormat("bfloat16", "float32", "remainder8", "int8", False),
    F.StepFormat("float16", "float16", "float32", "float32", False),
    F.StepFormat("float16", "float32", None, "int8", False),
    F.StepFormat("float32", "float32", None, "int8", False),
    F.StepFormat("float32", "float32", None, "bfloat16", False),
]
CASES = {
    "adam": optirs.AdamParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.05, amsgrad=True),
    "adamw": optirs.AdamParams(lr=1e-2, weight_decay=0.3),
    "sgd": optirs.SgdParams(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    "rmsprop": optirs.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.1),
    "adagrad": optirs.AdagradParams(lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.5),
    "lion": optirs.LionParams(lr=1e-3, weight_decay=0.1),
    "lamb": optirs.LambParams(lr=1e-2, max_trust_ratio=10.0, max_grad_norm=5.0),
}


@pytest.fixture(scope="module")
def ocl():
    return optirs.get_backend("opencl")


def _words(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the words of dtype (uint16 bits for 16-bit)."""
    return x.astype(np.float32) if dtype == "float32" else R.nearest16(x, dtype)


class _Model:
    """A model's arrays for one format: host words, the compact state on the device and its host copy."""

    def __init__(self, backend, name, hp, fmt, shapes=SHAPES, seed=0):
        self.backend, self.ctx = backend, backend.ctx
        self.definition = DEFINITIONS[name]
        self.hp, self.fmt = hp, fmt
        self.layout = TensorLayout(shapes)
        self.fs = F.FormatState(self.layout, [s for s in self.definition.slots if s.needed(hp)], fmt)
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.params = [_words(rng.normal(size=s).astype(np.float32), fmt.param_dtype) for s in shapes]
        self.buffers = R.fresh_buffers(self.fs, self.definition, hp)
        self.state = {k: backend.to_device(self.ctx, v) for k, v in self.buffers.items()}
        self.t = 0

    def grads(self, scale=1.0):
        return [_words((self.rng.normal(size=s) * scale).astype(np.float32), self.fmt.grad_dtype)
                for s in self.layout.shapes]

    def host_state(self):
        return {k: np.asarray(self.backend.to_host(self.ctx, v)).reshape(-1) for k, v in self.state.items()}

    def step(self, grads, params=None, found_inf=None, seed=11):
        self.t += 1
        params = self.params if params is None else params
        b, ctx = self.backend, self.ctx
        staged = b.stage(ctx, params, grads, self.fmt)
        backend_step(b, self.definition.name, staged.params, staged.grads, self.state, self.layout,
                     self.definition.scalars(self.hp, self.t), step=self.t, seed=seed, found_inf=found_inf,
                     fmt=self.fmt, format_state=self.fs)
        if staged.finish is not None:
            staged.finish()
        b.synchronize()


def _master(fs, params, buffers, t):
    """The float32 masters the step at ``t`` reads (t >= 2: float32 masters from their buffer)."""
    return np.concatenate(R.decode_master(fs, params, buffers))


def _close_to_reference(model, before_p, before_s, grads, seed):
    """The backend's step against the float64 reference run from the same inputs."""
    fmt, fs = model.fmt, model.fs
    want_p, want_s = R.format_step(model.definition, model.hp, fs, before_p, grads, before_s, seed, model.t)
    got_s = model.host_state()
    got_m = _master(fs, model.params, got_s, 2)
    want_m = _master(fs, want_p, want_s, 2)
    old_m = _master(fs, before_p, before_s, model.t)
    size = np.abs(want_m) + np.abs(old_m) + np.abs(want_m - old_m)  # the float32 step's error scales with its terms
    if fmt.param_dtype == "float32" or fmt.master in ("float32", "remainder16"):
        rel = 2.0 ** -16  # float32 masters: float32 rounding of the step's terms (they may cancel)
    elif fmt.master == "remainder8":
        rel = 2.0 ** -15  # one step of the 24-bit master
    else:
        rel = 2.0 ** -7 if fmt.param_dtype == "bfloat16" else 2.0 ** -10  # one 16-bit step
    tol = rel * size * 1.01 + 1e-30 + (2.0 ** -24 if fmt.param_dtype == "float16" else 0)
    np.testing.assert_array_less(np.abs(got_m - want_m), tol + 1e-12 * (fmt.param_dtype == "float32"))
    if fmt.master is not None and fmt.param_dtype != "float32":  # the parameter is the master's rounding
        for got, want in zip(model.params, want_p):
            diff = np.abs(R.decode16(got.view(np.uint16), fmt.param_dtype) - R.decode16(want.view(np.uint16), fmt.param_dtype))
            assert np.all(diff <= np.abs(R.decode16(want.view(np.uint16), fmt.param_dtype)) * 2.0 ** -7 * 1.01)
    signed = {s.name: s.signed for s in fs.slots}
    got_v, want_v = R.decode_state(fs, got_s), R.decode_state(fs, want_s)
    old_v, gr = R.decode_state(fs, before_s), R.decode_grads(fmt, grads)
    for t in range(len(fs.layout)):
        for s in fs.slot_names:
            g, w = got_v[t][s], want_v[t][s]
            # the float32 step's error scales with its inputs (a new moment may cancel to ~0)
            f32_err = 2.0 ** -20 * (np.abs(w) + np.abs(old_v[t][s]) + np.abs(gr[t]) + np.abs(gr[t]) ** 2)
            if fs.int8 and not fs.is_small(t):
                o, n = int(fs.layout.offsets[t]), int(fs.layout.sizes[t])
                b0 = int(fs.tensor_table()[t, 1])
                nb = -(-n // F.BLOCK)
                np.testing.assert_allclose(got_s[f"{s}.scales"][b0: b0 + nb], want_s[f"{s}.scales"][b0: b0 + nb],
                                           rtol=1e-5, atol=1e-30)
                step = R.code_step(want_s[f"{s}.{fs.codes}"][o: o + n], want_s[f"{s}.scales"][b0: b0 + nb], signed[s],
                                   fmt.state_dtype)
                assert np.all(np.abs(g - w) <= step * 1.01 + 1e-30), (t, s)
            elif fmt.state_dtype == "bfloat16":
                assert np.all(np.abs(g - w) <= np.abs(w) * 2.0 ** -7 * 1.01 + f32_err), (t, s)
            else:
                assert np.all(np.abs(g - w) <= f32_err + 1e-30), (t, s)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.param_dtype}-{f.grad_dtype}-{f.master}-{f.state_dtype}"
                         + ("-sr" if f.stochastic else ""))
@pytest.mark.parametrize("name", sorted(CASES))
def test_format_step_matches_reference(ocl, name, fmt):
    model = _Model(ocl, name, CASES[name], fmt)
    for _ in range(3):
        grads = model.grads()
        before_p, before_s = [p.copy() for p in model.params], model.host_state()
        model.step(grads, seed=11)
        _close_to_reference(model, before_p, before_s, grads, 11)


def _exact_sgd(model, before_p, before_s, grads, seed):
    """SGD with momentum (no decay, no nesterov) in numpy float32, the kernels' exact operations,
    then the contract's encodings (the format step of optirs.core.reference): the expected words, bit for bit."""
    fmt, fs, t = model.fmt, model.fs, model.t
    sc = model.definition.scalars(model.hp, t)
    p = _master(fs, before_p, before_s, t)
    g = np.concatenate(R.decode_grads(fmt, grads))
    buf = np.concatenate([s["momentum_buffer"] for s in R.decode_state(fs, before_s)])
    buf = g.copy() if sc.first_step else sc.momentum * buf + sc.dampening_factor * g
    x = p - sc.lr * buf
    # the words here are the tensors back to back; the random bits take each element's layout index
    layout = fs.layout
    index = np.concatenate([np.arange(o, o + n) for o, n in zip(layout.offsets, layout.sizes)])
    out = {}
    if fmt.param_dtype == "float32":
        out["params"] = x.view(np.uint32)
    elif fmt.master == "remainder16":
        out["params"], out["master_remainder"] = R.remainder16_split(x)
    elif fmt.master == "remainder8":
        out["params"], out["master_remainder"] = R.remainder8_split(R.round24(x))
    elif fmt.stochastic:
        out["params"] = R.bf16_stochastic(x, R.rand_bits(R.stream_key(seed, t, 0), index))
    else:
        out["params"] = R.nearest16(x, fmt.param_dtype)
        if fmt.master == "float32":
            out["master"] = x
    if fmt.state_dtype == "float32":
        out["momentum_buffer"] = buf
    elif fmt.state_dtype == "bfloat16":
        word = R.rand_bits(R.stream_key(seed, t, R.state_stream(0)), index)
        out["momentum_buffer"] = R.bf16_stochastic(buf, R.slot_bits(word, 0))
    else:
        codes, scales, small = [], [], []
        packed = TensorLayout(layout.shapes, align=1)
        for o, n in zip(packed.offsets, packed.sizes):
            v = buf[o: o + n]
            if n < F.MIN_INT8_SIZE:
                codes.append(np.zeros(n, np.uint8))
                small.append(v)
            else:
                c, s = R.quantize_blocks(v, signed=True)
                codes.append(c)
                scales.append(s)
        out["momentum_buffer.codes"] = np.concatenate(codes)
        out["momentum_buffer.scales"] = np.concatenate(scales)
        out["momentum_buffer.small"] = np.concatenate(small)
    return out


@pytest.mark.parametrize("fmt", FORMATS + [F.StepFormat("float16", "float16", None, "bfloat16", False)],
                         ids=lambda f: f"{f.param_dtype}-{f.grad_dtype}-{f.master}-{f.state_dtype}"
                         + ("-sr" if f.stochastic else ""))
def test_format_encodings_are_bit_exact(ocl, fmt):
    """Where the float32 arithmetic is known exactly (SGD with momentum), every stored word is the
    contract's: the rounding of parameters, masters and state, the random bits' streams and
    indices, the int8 blocks and their scales."""
    model = _Model(ocl, "sgd", optirs.SgdParams(lr=0.01, momentum=0.9), fmt, seed=5)
    for _ in range(3):
        grads = model.grads()
        before_p, before_s = [p.copy() for p in model.params], model.host_state()
        model.step(grads, seed=1234)
        want = _exact_sgd(model, before_p, before_s, grads, 1234)
        got = {k: _packed(model.fs, k, v) for k, v in model.host_state().items()}
        got["params"] = np.concatenate([p.reshape(-1) for p in model.params])
        for key, w in want.items():
            g = got[key]
            if key.endswith(".codes"):  # small tensors' range is unused
                live = np.concatenate([np.full(n, n >= F.MIN_INT8_SIZE) for n in model.layout.sizes])
                g, w = g[live], w[live]
            assert np.array_equal(np.asarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8)), key


def _packed(fs, buffer, flat):
    """A state buffer's tensors back to back (the layout's gaps out), as the expected words are."""
    if buffer.endswith(".scales"):
        return flat
    views = fs.views(buffer, flat) if buffer.endswith(".small") else fs.layout.views(flat)
    return np.concatenate([v.reshape(-1) for v in views if v is not None] or [flat[:0]])


def _coded_elements(layout):
    """Where a codes buffer holds codes: the tensors of MIN_INT8_SIZE elements and more (the small
    tensors' range and the gaps between tensors are unused)."""
    live = np.zeros(layout.total, bool)
    for o, n in zip(layout.offsets, layout.sizes):
        live[o : o + n] = n >= F.MIN_INT8_SIZE
    return live


def _device_copies(ctx, arrays, shared_from=None):
    """pyopencl copies of host word arrays: separate buffers, except tensors from ``shared_from`` on,
    which are views of one buffer at odd offsets (unaligned)."""
    out = [cla.to_device(ctx.queue, np.ascontiguousarray(a.view(np.uint16) if a.dtype.itemsize == 2 else a))
           for a in arrays]
    if shared_from is not None:
        tail = arrays[shared_from:]
        dt = out[0].dtype
        sizes = [a.size for a in tail]
        flat = cla.zeros(ctx.queue, sum(sizes) + 3 * len(tail), dt)
        o = 3
        for k, (a, n) in enumerate(zip(tail, sizes)):
            view = flat[o: o + n]
            view.set(np.ascontiguousarray(a.reshape(-1).view(dt)))
            out[shared_from + k] = view
            o += n + 3
    return out


def _many_shapes(ocl):
    """More tensors than one launch takes buffers (the slots, each kind): two launch groups."""
    return [(5000,), (7,)] * (ocl.ctx.slots // 2 + 1) + [(4099,), (33,), (4096,)]


@pytest.mark.parametrize("fmt", [FORMATS[1], FORMATS[4], FORMATS[7]],
                         ids=["bf16-sr-bf16state", "bf16-r8-int8", "f32-int8"])
def test_device_arrays_in_many_buffers_match_the_packed_step(ocl, fmt):
    """pyopencl arrays stepped in place (more distinct buffers than one launch takes, so two chunk
    groups, and views of a shared buffer at unaligned offsets) give the numpy-staged step's bits."""
    shapes = _many_shapes(ocl)
    packed = _Model(ocl, "adamw", CASES["adamw"], fmt, shapes=shapes, seed=3)
    device = _Model(ocl, "adamw", CASES["adamw"], fmt, shapes=shapes, seed=3)
    dev_params = _device_copies(ocl.ctx, device.params, shared_from=len(shapes) - 5)
    for _ in range(2):
        grads = packed.grads()
        device.grads()  # keep the generators in step
        packed.step(grads)
        device.step(_device_copies(ocl.ctx, grads, shared_from=len(shapes) - 3), params=dev_params)
        for a, b in zip(packed.params, dev_params):
            assert np.array_equal(a.reshape(-1).view(np.uint8), b.get().view(np.uint8))
        for k, v in packed.host_state().items():
            assert np.array_equal(v.view(np.uint8), device.host_state()[k].view(np.uint8)), k


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_found_inf_skips_the_whole_step(ocl, name):
    fmt = FORMATS[4]
    model = _Model(ocl, name, CASES[name], fmt)
    model.step(model.grads())  # a real step first: the state is not fresh
    before_p, before_s = [p.copy() for p in model.params], model.host_state()
    found = cla.to_device(ocl.ctx.queue, np.array([1], np.int32))
    model.step(model.grads(), found_inf=found)
    for a, b in zip(before_p, model.params):
        assert np.array_equal(a, b)
    for k, v in model.host_state().items():
        assert np.array_equal(v, before_s[k]), k
    found.fill(0)
    model.step(model.grads(), found_inf=found)
    assert not all(np.array_equal(a, b) for a, b in zip(before_p, model.params))


@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float16", "float32"])
def test_check_flags_non_finite_gradients(ocl, grad_dtype):
    ctx = ocl.ctx
    check = ocl.plugin._formats_check  # the check pass alone
    fmt = F.StepFormat("float32" if grad_dtype == "float32" else grad_dtype, grad_dtype, None, "float32", False)
    shapes = [(7,), (9000,), (13,)]
    layout = TensorLayout(shapes)
    rng = np.random.default_rng(0)
    for bad in (None, np.inf, -np.inf, np.nan):
        host = [_words(rng.normal(size=s).astype(np.float32), grad_dtype) for s in shapes]
        if bad is not None:
            host[1].reshape(-1)[8999] = _words(np.array([bad], np.float32), grad_dtype)[0]
        grads = _device_copies(ctx, host, shared_from=2)
        flag = cla.zeros(ctx.queue, 1, np.int32)
        check(ctx, grads, layout, fmt, flag)
        assert flag.get()[0] == (0 if bad is None else 1), bad


# Every pointwise family in the headline format, and Adam in every format (each pair compiles
# its own numba loop on first use, so not the whole product).
CPU_PAIRS = [(n, FORMATS[4]) for n in sorted(set(CASES) - {"lamb", "adam"})] + [("adam", f) for f in FORMATS]


def _beside_the_cpu_backend(ocl, name, hp, fmt):
    """The same model on the OpenCL device and on the cpu backend (seeded alike), or a skip where the
    two cannot agree bit for bit (no cpu formats, or no correctly rounded division and sqrt)."""
    cpu = optirs.get_backend("cpu")
    if not cpu.supports("formats"):
        pytest.skip("the cpu backend has no formats capability")
    if not ocl.ctx.build_options.count("-cl-fp32-correctly-rounded-divide-sqrt"):
        pytest.skip("this OpenCL device does not round division and sqrt correctly")
    return _Model(ocl, name, hp, fmt, seed=9), _Model(cpu, name, hp, fmt, seed=9)


@pytest.mark.parametrize("name,fmt", CPU_PAIRS, ids=[f"{n}-{f.param_dtype}-{f.grad_dtype}-{f.master}-{f.state_dtype}"
                                                     + ("-sr" if f.stochastic else "") for n, f in CPU_PAIRS])
def test_format_step_is_bit_exact_with_the_cpu_backend(ocl, name, fmt):
    """The OpenCL C and the numba element code are two texts of one contract: with FP_CONTRACT off
    and correctly rounded division and sqrt, every word agrees bit for bit (NaN aside: none here).
    LAMB is left out: its float64 norms are summed in another order (tests/test_formats.py)."""
    a, b = _beside_the_cpu_backend(ocl, name, CASES[name], fmt)
    for _ in range(3):
        grads = a.grads()
        b.grads()
        a.step(grads, seed=77)
        b.step([g.copy() for g in grads], seed=77)
        for x, y in zip(a.params, b.params):
            assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))
        sb = b.host_state()
        for k, v in a.host_state().items():
            live = _coded_elements(a.layout) if k.endswith(".codes") else np.ones(v.size, bool)
            assert np.array_equal(v[live].view(np.uint8), sb[k][live].view(np.uint8)), k


# The square-root codes: Adam with amsgrad (a signed slot and two unsigned ones) in the headline
# format and with float32 parameters, and LAMB's two passes (no clipping: its moments then take no
# norm, so they are the cpu backend's bit for bit; its parameters take the float64 norms, summed in
# another order).
SQRT_FORMATS = [F.StepFormat("bfloat16", "bfloat16", "remainder8", "int8_sqrt", False),
                F.StepFormat("float32", "float32", None, "int8_sqrt", False)]
# The float8 state (state_dtype "float8_e4m3fn") in the headline format, the same way.
FP8_FORMAT = F.StepFormat("bfloat16", "bfloat16", "remainder8", "float8_e4m3fn", False)
SQRT_PAIRS = [("adam", SQRT_FORMATS[0]), ("adam", SQRT_FORMATS[1]), ("lamb", SQRT_FORMATS[0]), ("adam", FP8_FORMAT),
              ("lamb", FP8_FORMAT)]
SQRT_CASES = {"adam": optirs.AdamParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6, amsgrad=True),  # no decay: a zero
              "lamb": optirs.LambParams(lr=1e-2, max_trust_ratio=10.0, weight_decay=0.01)}  # gradient, a zero moment


def _sqrt_edge_blocks(grads, t):
    """Blocks of the 8195-element tensor (two chunks, a ragged last block) whose scales take the
    codes' other paths: zero gradients (scale 0), tiny ones (scales under 2**-80: the IEEE forms),
    huge ones (the second moment's scales over 2**98) and,
    at the first step, a NaN and an inf gradient (NaN and inf scales: codes 0, NaN values after)."""
    g = grads[4].reshape(-1)
    dtype = "float32" if g.dtype == np.float32 else "bfloat16"
    rng = np.random.default_rng(t)
    for begin, size in ((256, 0.0), (1024, 1e-20), (2048, 1e18)):
        g[begin: begin + 256] = _words(rng.normal(size=256).astype(np.float32) * np.float32(size), dtype)
    if t == 0:
        g[[3000, 5000]] = _words(np.array([np.nan, np.inf], np.float32), dtype)


@pytest.mark.parametrize("name,fmt", SQRT_PAIRS,
                         ids=[f"{n}-{f.param_dtype}-{f.master}-{f.state_dtype}" for n, f in SQRT_PAIRS])
def test_coded_state_is_the_cpu_backends_bit_for_bit(ocl, name, fmt):
    """Square-root codes (state_dtype "int8_sqrt", under s.sqrt_codes) and float8 codes
    ("float8_e4m3fn", under s.fp8_codes) after each of three steps: codes, scales and the small
    tensors' float32 state are the cpu backend's bit for bit (NaN where it is NaN), for signed and
    unsigned slots, small tensors, unaligned tensors, a ragged end, and blocks of zero, tiny, huge,
    NaN and inf scales; the parameters too (LAMB's within its norms' float64 rounding)."""
    a, b = _beside_the_cpu_backend(ocl, name, SQRT_CASES[name], fmt)
    suffix = "." + F.CODES_SUFFIX[fmt.state_dtype]
    assert any(k.endswith(suffix) for k in a.state) and not any(k.endswith(".codes") for k in a.state)
    live = _coded_elements(a.layout)
    for t in range(3):
        grads = a.grads()
        b.grads()
        _sqrt_edge_blocks(grads, t)
        a.step(grads, seed=77)
        b.step([g.copy() for g in grads], seed=77)
        sb = b.host_state()
        # a NaN master (NVIDIA's NaN is 0x7FFFFFFF, x86's 0xFFC00000) splits as the quiet NaN of its
        # sign: the same remainder, 0, on both
        for k, v in a.host_state().items():
            keep = live if k.endswith(suffix) else slice(None)
            _same_words_nan_by_hardware(v[keep], sb[k][keep], (t, k))
        if name == "lamb":
            got = np.concatenate(_master_values(a))
            want = np.concatenate(_master_values(b))
            ok = ~np.isnan(want)
            assert np.array_equal(np.isnan(got), ~ok), t
            np.testing.assert_allclose(got[ok], want[ok], rtol=2.0 ** -15, atol=1e-30)
        else:
            for x, y in zip(a.params, b.params):
                _same_words_nan_by_hardware(x, y, (t, "params"))


def _master_values(model):
    return R.decode_master(model.fs, model.params, model.host_state())


NAN_PAIRS = [("adamw", FORMATS[1]), ("adamw", FORMATS[0]), ("adam", FORMATS[8])]


def _quiet_nan(words):
    """Where bfloat16 words are the quiet NaN (0x7FC0, either sign)."""
    return (np.asarray(words) & 0x7FFF) == 0x7FC0


def _same_words_nan_by_hardware(got, want, what):
    """Every word the cpu backend's, but for the sign and payload of a NaN that arithmetic made (as
    inf / inf in Adam's update): the hardware's own (x86: negative; NVIDIA: the canonical positive NaN),
    which an encoder keeps as its sign. So where both are NaN, float32 words need only be NaN, and
    bfloat16 words must both be the quiet NaN (0x7FC0, either sign): an encoder without its NaN test
    writes other words there."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.dtype == np.float32:
        nan = np.isnan(got) & np.isnan(want)
    elif got.dtype == np.uint16:
        nan = _quiet_nan(got) & _quiet_nan(want)
    else:
        nan = np.zeros(got.shape, bool)
    assert np.array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8)), what


@pytest.mark.parametrize("name,fmt", NAN_PAIRS, ids=[f"{n}-{f.param_dtype}-{f.grad_dtype}-{f.state_dtype}"
                                                     for n, f in NAN_PAIRS])
def test_nan_rounds_are_the_cpu_backends_bit_for_bit(ocl, name, fmt):
    """A full round with a NaN (either sign, full payload) or inf gradient takes the encoders with their NaN test
    (a NaN-free round skips it: optirs_formats_step.h's fmt_num, by the new parameter alone for AdamW,
    by every encoded value for Adam with amsgrad), and every encoded word, NaN included, is the cpu
    backend's (float32 state: NaN where it is NaN); over two steps, so that NaN state words are read
    back too. Without the fallback (every round taken as NaN-free) each case fails."""
    cpu = optirs.get_backend("cpu")
    if not cpu.supports("formats"):
        pytest.skip("the cpu backend has no formats capability")
    if not ocl.ctx.build_options.count("-cl-fp32-correctly-rounded-divide-sqrt"):
        pytest.skip("this OpenCL device does not round division and sqrt correctly")
    shapes = [(4100,)]
    a = _Model(ocl, name, CASES[name], fmt, shapes=shapes, seed=5)
    b = _Model(cpu, name, CASES[name], fmt, shapes=shapes, seed=5)
    for t in range(2):
        grads = a.grads()
        b.grads()
        # NaNs with every payload bit set (an encoder without its NaN test would carry them into
        # other words), either sign, and infinities
        if fmt.grad_dtype == "float32":
            bad = np.array([0x7FFFFFFF, 0xFFBFFFFF, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)
        else:
            bad = np.array([0x7FFF, 0xFFBF, 0x7F80, 0xFF80], np.uint16)
        grads[0][[3 + t, 1001, 2050 + 8 * t, 4091]] = bad
        a.step(grads, seed=31)
        b.step([g.copy() for g in grads], seed=31)
        _same_words_nan_by_hardware(a.params[0], b.params[0], "parameters")
        sb = b.host_state()
        for k, v in a.host_state().items():
            _same_words_nan_by_hardware(v, sb[k], k)


_SHAPE_ENV = ("OPTIRS_OPENCL_FORMATS_WG", "OPTIRS_OPENCL_FORMATS_CHUNK", "OPTIRS_OPENCL_FORMATS_RESIDENT")


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_launch_shape_changes_no_bit(ocl, name, monkeypatch):
    """Work-group, chunk and grid sizes change only which work-group does what: every word is the
    same, also after a step that found_inf skipped (each launch, skipped or not, moves the chunk
    counter by what the host expects, or the next step would miss or repeat chunks)."""
    fmt = FORMATS[4]  # bfloat16 + remainder8 + int8 state: the int8 blocks' reduction over work-items
    shapes = _many_shapes(ocl)
    ctx = ocl.ctx

    def run(env, skip):
        for k in _SHAPE_ENV:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        model = _Model(ocl, name, CASES[name], fmt, shapes=shapes, seed=5)
        params = _device_copies(ctx, model.params)
        found = cla.to_device(ctx.queue, np.array([1], np.int32))
        for k in range(3):
            grads = _device_copies(ctx, model.grads())
            if k == 1 and not skip:
                model.t += 1  # the step numbers of the run that skips
                continue
            model.step(grads, params=params, found_inf=found if k == 1 else None)
        return [p.get().view(np.uint8) for p in params], {k: v.view(np.uint8) for k, v in model.host_state().items()}

    want_p, want_s = run({}, skip=False)
    for env in ({}, {"OPTIRS_OPENCL_FORMATS_WG": "32", "OPTIRS_OPENCL_FORMATS_CHUNK": "512",
                     "OPTIRS_OPENCL_FORMATS_RESIDENT": "32"}):
        got_p, got_s = run(env, skip=True)
        for a, b in zip(want_p, got_p):
            assert np.array_equal(a, b), env
        for k, v in want_s.items():
            assert np.array_equal(v, got_s[k]), (env, k)


@pytest.mark.parametrize("var,value", [("OPTIRS_OPENCL_FORMATS_WG", "100"), ("OPTIRS_OPENCL_FORMATS_CHUNK", "300"),
                                       ("OPTIRS_OPENCL_FORMATS_RESIDENT", "many"),
                                       ("OPTIRS_OPENCL_FORMATS_MAXREG", "-1")])
def test_bad_launch_shape_settings_are_refused(ocl, var, value, monkeypatch):
    model = _Model(ocl, "adamw", CASES["adamw"], FORMATS[4])
    before_p, before_s = [p.copy() for p in model.params], model.host_state()
    monkeypatch.setenv(var, value)
    with pytest.raises(optirs.InvalidParameterError, match=f"{var}={value!r}"):
        model.step(model.grads())
    for a, b in zip(before_p, model.params):
        assert np.array_equal(a, b)
    for k, v in model.host_state().items():
        assert np.array_equal(v, before_s[k]), k


@pytest.mark.parametrize("slots", [16, 128])
def test_every_slot_count_builds_with_the_host_arguments(ocl, slots):
    """The slot macros the host generates for another device's argument space (NVIDIA's driver:
    128 of each kind) build, and the kernel takes the arguments the host passes."""
    from optirs.backends.opencl import formats as OF
    from optirs.backends.opencl.context import build_program

    ctx, fmt = ocl.ctx, FORMATS[4]
    options = [o for o in ctx.build_options if not o.startswith(("-DOPTIRS_WG=", "-DOPTIRS_CHUNK="))]
    options += ["-DOPTIRS_WG=128", "-DOPTIRS_CHUNK=2048", *OF.format_defines(fmt), "-DOPTIRS_FMT_USED=3",
                "-DOPTIRS_FMT_SIGNED=1", "-DOPTIRS_FMT_LAMB=0",
                f"-DOPTIRS_FMT_MAXREG={64 if slots == 16 else 0}"]  # a capped build: no work-group attribute
    program = build_program(ctx.context, ctx.device, OF.format_source("adam", slots), options, f"slots{slots}")
    for name, types in OF._arg_types(ctx, "adam", slots).items():
        assert cl.Kernel(program, name).num_args == len(types) == 2 * slots + (22 if name == "adam_fmt" else 8), name


def test_a_refused_register_cap_builds_without_one(ocl, monkeypatch):
    """A driver that lists cl_nv_compiler_options but refuses -cl-nv-maxrregcount (PoCL refuses
    it) gets the kernels without a cap, a warning, and a step that still matches the reference."""
    from optirs.backends.opencl import formats as OF

    if OF.register_options(ocl.ctx, FORMATS[4]):
        pytest.skip("this driver takes the cap (NVIDIA's): the refusal is another driver's case")
    monkeypatch.setitem(OF._cache(ocl.ctx), "nv_options", True)
    monkeypatch.setenv("OPTIRS_OPENCL_FORMATS_MAXREG", "64")
    model = _Model(ocl, "sgd", CASES["sgd"], FORMATS[4], seed=4)
    grads = model.grads()
    before_p, before_s = [p.copy() for p in model.params], model.host_state()
    with pytest.warns(RuntimeWarning, match="maxrregcount"):
        model.step(grads)
    assert OF._cache(ocl.ctx)["nv_options"] is False
    _close_to_reference(model, before_p, before_s, grads, 11)


def test_a_refused_warp_reduction_builds_the_portable_one(ocl, monkeypatch):
    """The int8 kernels' inline-PTX warp reduction (asked of NVIDIA's driver; PoCL cannot build it)
    falls back to the local-memory reduction with a warning, and the step still matches."""
    from optirs.backends.opencl import formats as OF

    if OF.warp_options(ocl.ctx, FORMATS[4]):
        pytest.skip("this driver builds the inline PTX (NVIDIA's): the fallback is another driver's case")
    monkeypatch.setitem(OF._cache(ocl.ctx), "nv_warp", 2)
    model = _Model(ocl, "sgd", CASES["sgd"], FORMATS[4], seed=6)
    grads = model.grads()
    before_p, before_s = [p.copy() for p in model.params], model.host_state()
    with pytest.warns(RuntimeWarning, match="OPTIRS_NV_WARP"):
        model.step(grads)
    assert OF._cache(ocl.ctx)["nv_warp"] == 0
    _close_to_reference(model, before_p, before_s, grads, 11)


def test_a_refused_float8_conversion_keeps_the_rest_of_the_inline_ptx(ocl, monkeypatch):
    """A driver that lists sm_89 but refuses the float8 conversions (level 3) builds the float8
    program at level 2 with a warning, and keeps level 2 for later programs: the step still matches.
    Here the refusal is a stand-in build_program that fails at level 3 (and, PoCL building no inline
    PTX at all, drops the defines of the level it is given)."""
    from optirs.backends.opencl import context as OC
    from optirs.backends.opencl import formats as OF
    from optirs.core.errors import GpuOptimError

    if OF.nv_level(ocl.ctx):
        pytest.skip("NVIDIA's driver: its own answer is the case")
    real = OC.build_program
    asked = []

    def build(context, device, source, options, name):
        asked.append([o for o in options if o.startswith("-DOPTIRS_NV_")])
        if any(o.startswith("-DOPTIRS_NV_") and o.endswith("=3") for o in options):
            raise GpuOptimError("ptxas: Feature 'cvt.e4m3x2.f32' requires PTX ISA .version 7.8 or later")
        return real(context, device, source, [o for o in options if not o.startswith("-DOPTIRS_NV_")], name)

    monkeypatch.setattr(OC, "build_program", build)
    monkeypatch.setitem(OF._cache(ocl.ctx), "nv_warp", 3)
    model = _Model(ocl, "adamw", CASES["adamw"], FP8_FORMAT, seed=6)
    grads = model.grads()
    before_p, before_s = [p.copy() for p in model.params], model.host_state()
    with pytest.warns(RuntimeWarning, match="float8 conversions"):
        model.step(grads)
    assert OF._cache(ocl.ctx)["nv_warp"] == 2
    assert asked[:2] == [["-DOPTIRS_NV_WARP=3", "-DOPTIRS_NV_PTX=3"], ["-DOPTIRS_NV_WARP=2", "-DOPTIRS_NV_PTX=2"]]
    _close_to_reference(model, before_p, before_s, grads, 6)
