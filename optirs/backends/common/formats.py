"""The per-element code of the step formats, written once for numba and shared by cpu and cuda.

docs/formats.md is the contract; this is its numba text: the float32 <-> bits casts, the
counter-based random bits, bfloat16 rounding (nearest even and stochastic), float16, the
remainder16 / remainder8 master splits, int8 map quantization, and the uniform format element
step (decode the master and the gradient, the family's ``element_update``, encode the master).
Every function is ``@njit``: the cpu loops call them, numba-cuda compiles them as device
functions (as :mod:`optirs.backends.common.elementwise`). Integer arithmetic is on uint64
holding 32-bit values, masked back to 32 bits after each multiply (numba widens uint32
arithmetic, and mixing unsigned with signed integers would give float64); the random bits'
multiplies are LLVM IR on 32-bit integers (vector lanes of 32 bits on the cpu).

The codes the functions branch on (``fc``, an :class:`optirs.core.formats.FormatCodes`) are the
same for every element of a launch. State slots are decoded and encoded by the loops around the
element step, since an int8 block's scale depends on all of its new values.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from optirs.backends.common import half
from optirs.backends.common.int8_buckets import HI as _BK_HI, LO as _BK_LO, WIDTH as _BK_WIDTH
from optirs.backends.common.elementwise import element_update, lamb_direction, lamb_moments
from optirs.core.compile_cache import prepare_kernel_compilation
from optirs.core.formats import (BF16, F16, F32, MASTER_F32, MASTER_NONE, MASTER_R16, MASTER_R8, STATE_BF16,
                                 STATE_F32)

prepare_kernel_compilation()  # before the first decorator: numba picks the cache directory there

# Not cached on disk: a loop compiled in a later process would link a cached function as object
# code, which LLVM cannot inline, so the loop calls it per element and does not vectorize (2-4x
# slower, measured). The loops that call these are cached, with them inlined.
_jit = njit(cache=False, error_model="numpy")

_U = np.uint64
_MASK32 = np.uint64(0xFFFFFFFF)
_MASK16 = np.uint64(0xFFFF)
_S8, _S16 = np.uint64(8), np.uint64(16)


# ---------------------------------------------------------------- bit casts


@intrinsic
def _f32_bits(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, u):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@_jit
def f32_bits(x):
    """The float32 bit pattern of ``x`` (as uint32)."""
    return _f32_bits(np.float32(x))


@_jit
def bits_f32(u):
    """The float32 whose bit pattern is the low 32 bits of ``u``."""
    return _bits_f32(np.uint32(u))


_f16_encode = _jit(half.f16_encode)
_F16_SUB = np.float32(2.0**-24)  # the float16 subnormal step


@_jit
def _f16_decode(h):
    """float16 bits -> float32, as :func:`optirs.backends.common.half.f16_decode` (NaN -> the quiet NaN
    with h's sign), from bit operations: no scale table, whose lane-divergent reads the GPU serialises."""
    h = _U(h) & _MASK16
    sign = (h & _U(0x8000)) << _S16
    e = (h >> _U(10)) & _U(0x1F)
    m = h & _U(0x3FF)
    if e == _U(0x1F):
        return bits_f32(sign | (_U(0x7F800000) if m == _U(0) else _U(0x7FC00000)))
    if e == _U(0):
        v = np.float32(m) * _F16_SUB
        return -v if sign != _U(0) else v
    return bits_f32(sign | ((e + _U(112)) << _U(23)) | (m << _U(13)))


# bfloat16 in 32-bit LLVM IR: numba's integer arithmetic is 64-bit, and its vector loops then
# carry 64-bit lanes (half as many per register, compares and selects emulated on x86 before
# AVX-512); these compute the same bits as half.bf16_decode / bf16_encode on 32-bit integers.


def _c32(value):
    return ir.Constant(ir.IntType(32), value)


def _low32(builder, value):
    """An integer LLVM value as i32 (its low 32 bits)."""
    width = value.type.width
    if width > 32:
        return builder.trunc(value, ir.IntType(32))
    return builder.zext(value, ir.IntType(32)) if width < 32 else value


def _bf16_nearest_ir(builder, u):
    """float32 bits ``u`` (i32) -> bfloat16 bits (i32), nearest even, NaN -> quiet NaN with u's sign."""
    nan = builder.icmp_unsigned(">", builder.and_(u, _c32(0x7FFFFFFF)), _c32(0x7F800000))
    quiet = builder.or_(builder.lshr(builder.and_(u, _c32(0x80000000)), _c32(16)), _c32(0x7FC0))
    lsb = builder.and_(builder.lshr(u, _c32(16)), _c32(1))
    near = builder.lshr(builder.add(builder.add(u, _c32(0x7FFF)), lsb), _c32(16))  # below 2**32 when not NaN
    return builder.select(nan, quiet, near)


@intrinsic
def _bf16_decode_i32(typingctx, h):
    """bfloat16 bits (low 16 of an integer) -> float32; NaN -> the quiet NaN with h's sign."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        u = builder.shl(builder.and_(_low32(builder, args[0]), _c32(0xFFFF)), _c32(16))
        nan = builder.icmp_unsigned(">", builder.and_(u, _c32(0x7FFFFFFF)), _c32(0x7F800000))
        quiet = builder.or_(builder.and_(u, _c32(0x80000000)), _c32(0x7FC00000))
        return builder.bitcast(builder.select(nan, quiet, u), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def _bf16_nearest_i32(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _bf16_nearest_ir(builder, builder.bitcast(args[0], ir.IntType(32)))

    return types.uint32(types.float32), codegen


@intrinsic
def _bf16_stochastic_i32(typingctx, x, r):
    if x != types.float32 or not isinstance(r, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        u = builder.bitcast(args[0], ir.IntType(32))
        special = builder.icmp_unsigned("==", builder.and_(u, _c32(0x7F800000)), _c32(0x7F800000))
        up = builder.lshr(builder.add(u, builder.and_(_low32(builder, args[1]), _c32(0xFFFF))), _c32(16))
        return builder.select(special, _bf16_nearest_ir(builder, u), up)

    return types.uint32(types.float32, r), codegen


@_jit
def _bf16_decode(h):
    """bfloat16 bits -> float32, as :func:`optirs.backends.common.half.bf16_decode` (NaN -> the quiet
    NaN with h's sign): the bits shifted up, which is the exact value for every other input. Bit
    operations only: the scale-table form's lane-divergent reads are serialised on a GPU (the
    old kernels' ld.const)."""
    return _bf16_decode_i32(h)


# ---------------------------------------------------------------- random bits


def _fmix32_ir(builder, h):
    """MurmurHash3's finalizer on an LLVM i32 value, in 32-bit operations."""
    i32 = ir.IntType(32)
    h = builder.xor(h, builder.lshr(h, ir.Constant(i32, 16)))
    h = builder.mul(h, ir.Constant(i32, 0x85EBCA6B))
    h = builder.xor(h, builder.lshr(h, ir.Constant(i32, 13)))
    h = builder.mul(h, ir.Constant(i32, 0xC2B2AE35))
    return builder.xor(h, builder.lshr(h, ir.Constant(i32, 16)))


@intrinsic
def _fmix32_u32(typingctx, h):
    # in 32-bit lanes: numba's own integer arithmetic is 64-bit, whose vector multiplies x86
    # before AVX-512 emulates with three 32-bit ones (the same low 32 bits either way)
    if h != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        x = builder.trunc(args[0], ir.IntType(32))
        return builder.zext(_fmix32_ir(builder, x), ir.IntType(64))

    return types.uint64(types.uint64), codegen


@intrinsic
def _rand32_u32(typingctx, key, i):
    if key != types.uint64 or i != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        k, x = builder.trunc(args[0], i32), builder.trunc(args[1], i32)
        x = builder.xor(k, builder.mul(x, ir.Constant(i32, 0x9E3779B1)))
        return builder.zext(_fmix32_ir(builder, x), ir.IntType(64))

    return types.uint64(types.uint64, types.uint64), codegen


@_jit
def fmix32(h):
    """MurmurHash3's 32-bit finalizer (``h`` a uint64 holding 32 bits; returns the same)."""
    return _fmix32_u32(_U(h))


@_jit
def stream_key(seed, step, stream):
    """``fmix32(seed ^ fmix32(step * 4 + stream))``: the key of one random stream of one step."""
    return fmix32((_U(seed) & _MASK32) ^ fmix32(_U(step) * _U(4) + _U(stream)))


@_jit
def rand32(key, i):
    """``fmix32(key ^ (i * 0x9E3779B1))`` for element ``i`` (its flat layout index, low 32 bits)."""
    return _rand32_u32(_U(key), _U(i))


# ---------------------------------------------------------------- 16-bit encodings


@_jit
def decode16(h, kind):
    """bfloat16 (``kind`` BF16) or float16 bits -> float32."""
    if kind == BF16:
        return _bf16_decode(_U(h))
    return _f16_decode(_U(h))


@_jit
def decode_value(raw, kind):
    """A parameter or gradient word -> float32: float32 bits (``kind`` F32), else 16-bit bits."""
    if kind == F32:
        return bits_f32(raw)
    return decode16(raw, kind)


@_jit
def bf16_nearest(x):
    """float32 -> bfloat16 bits, nearest even, NaN -> quiet NaN (ml_dtypes' cast)."""
    return _bf16_nearest_i32(np.float32(x))


@_jit
def f16_nearest(x):
    """float32 -> float16 bits, nearest even (numpy's cast)."""
    return np.uint32(_f16_encode(_U(f32_bits(x))))


@_jit
def bf16_stochastic(x, r):
    """float32 -> bfloat16 bits, rounded up with probability ``low16 / 65536`` (``r`` the random word);
    inf and NaN round to nearest."""
    return _bf16_stochastic_i32(np.float32(x), _U(r))


# ---------------------------------------------------------------- remainder masters


@_jit
def remainder16_split(x):
    """The exact float32 master ``x`` -> (bfloat16 bits ``hi``, int16 remainder as int32)."""
    u = _U(f32_bits(x))
    hi = u >> _S16
    lo = u & _MASK16
    if lo >= _U(0x8000):
        hi = hi + _U(1)
    return np.uint32(hi & _MASK16), np.int32(np.int64(lo) - (65536 if lo >= _U(0x8000) else 0))


@_jit
def remainder16_join(hi, rem):
    """bfloat16 bits ``hi`` and an int16 remainder -> the exact float32 master."""
    h = _U(hi) & _MASK16
    if rem < 0:
        h = (h - _U(1)) & _MASK16
    return bits_f32((h << _S16) | (_U(np.int64(rem) & 0xFFFF)))


@_jit
def round24(x):
    """float32 -> float32 with its low 8 bits zero, nearest even on them (non-finite stays)."""
    u = _U(f32_bits(x))
    if (u & _U(0x7F800000)) == _U(0x7F800000):
        return x
    u24 = ((u + _U(0x7F) + ((u >> _S8) & _U(1))) & _MASK32) >> _S8
    return bits_f32(u24 << _S8)


@_jit
def remainder8_split(x):
    """A float32 master with zero low 8 bits (``round24``'s result) -> (bfloat16 bits, int8 remainder as int32)."""
    u24 = _U(f32_bits(x)) >> _S8
    hi = u24 >> _S8
    lo = u24 & _U(0xFF)
    if lo >= _U(0x80):
        hi = hi + _U(1)
    return np.uint32(hi & _MASK16), np.int32(np.int64(lo) - (256 if lo >= _U(0x80) else 0))


@_jit
def remainder8_join(hi, rem):
    """bfloat16 bits ``hi`` and an int8 remainder -> the 24-bit float32 master."""
    h = _U(hi) & _MASK16
    if rem < 0:
        h = (h - _U(1)) & _MASK16
    return bits_f32(((h << _S8) | _U(np.int64(rem) & 0xFF)) << _S8)


# ---------------------------------------------------------------- int8 blocks


@intrinsic
def _bucket_i32(typingctx, y):
    """:func:`quantize_bucket` in 32-bit IR (32-bit vector lanes on the cpu)."""
    if y != types.float32:
        return None

    def codegen(context, builder, sig, args):
        u = builder.bitcast(args[0], ir.IntType(32))
        a = builder.and_(builder.lshr(u, _c32(16)), _c32(0x7FFF))
        lo, hi = _c32(_BK_LO - 1), _c32(_BK_HI + 1)
        a = builder.select(builder.icmp_unsigned("<", a, lo), lo, a)
        a = builder.sub(builder.select(builder.icmp_unsigned(">", a, hi), hi, a), lo)
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        negative = builder.select(nan, _c32(1), builder.lshr(u, _c32(31)))
        return builder.zext(builder.add(a, builder.mul(negative, _c32(_BK_WIDTH))), ir.IntType(64))

    return types.uint64(types.float32), codegen


@_jit
def quantize(x, scale, mid, table):
    """The code of float32 ``x`` in a block of ``scale``: the number of ``mid[k] < x / scale``
    (0 where scale is 0). ``mid``: the map's 255 float32 midpoints padded with +inf, ``table`` its
    bucket table (:mod:`optirs.backends.common.int8_buckets`): one lookup and one compare, no branch.
    Its three steps are functions of their own so that a cpu loop can run the arithmetic ones
    vectorized, apart from the lookups."""
    y = quantize_scaled(x, scale)
    return quantize_code(y, _U(table[quantize_bucket(y)]), mid)


@_jit
def quantize_scaled(x, scale):
    """``x / scale`` in float32, 0 where scale is 0: the value :func:`quantize` codes."""
    return x / scale if scale != 0 else np.float32(0)


@_jit
def quantize_bucket(y):
    """The bucket table index of the scaled value ``y`` (uint64). A NaN takes the bucket of its
    magnitude with the sign set, whose table entry is 0 (no midpoint lies below -inf), so that
    :func:`quantize_code` needs no test of its own for it."""
    return _bucket_i32(np.float32(y))


@_jit
def quantize_code(y, c, mid):
    """The code of the scaled value ``y`` whose bucket (:func:`quantize_bucket`) has table entry ``c``
    (uint64): ``c`` plus one where the bucket's midpoint lies below ``y`` (a NaN compares false: code 0)."""
    return np.uint8(c + _U(mid[c] < y))


@_jit
def dequantize(code, scale, q):
    """``q[code] * scale`` in float32."""
    return q[code] * scale


@_jit
def absmax_update(m, x):
    """max(m, |x|), NaN-propagating: a NaN in a block makes its scale NaN (docs/formats.md)."""
    a = abs(x)
    return a if not (a <= m) else m


# ---------------------------------------------------------------- state words


@_jit
def decode_state(raw, kind):
    """A float32 (``kind`` STATE_F32: its bits) or bfloat16 state word -> float32."""
    if kind == STATE_F32:
        return bits_f32(raw)
    return _bf16_decode(_U(raw))


@_jit
def encode_state(x, kind, key, i):
    """float32 -> a state word: float32 bits, or bfloat16 rounded stochastically with ``key`` at ``i``."""
    if kind == STATE_BF16:
        return bf16_stochastic(x, rand32(key, i))
    return f32_bits(x)


# ---------------------------------------------------------------- masters and the element step


@_jit
def load_master(praw, mraw, fc):
    """The float32 master of one element.

    :param praw: the parameter word (float32 bits, or 16-bit bits), uint32.
    :param mraw: the master word: float32 bits (MASTER_F32), the remainder (int16 / int8 as
        int32, MASTER_R16 / MASTER_R8), else unused.
    :param fc: the :class:`~optirs.core.formats.FormatCodes`.

    A float32 master word of 0 (a fresh buffer, or a master of +0.0, whose parameter is +0.0 too)
    is read from the parameter: the first step needs no variant of its own (docs/formats.md).
    """
    if fc.param == F32:
        return bits_f32(praw)
    if fc.master == MASTER_F32:
        return bits_f32(mraw) if mraw != 0 else decode16(praw, fc.param)
    if fc.master == MASTER_R16:
        return remainder16_join(praw, np.int32(mraw))
    if fc.master == MASTER_R8:
        return remainder8_join(praw, np.int32(mraw))
    return decode16(praw, fc.param)


@_jit
def store_master(x, fc, key, i):
    """The new float32 master ``x`` -> (parameter word, master word), as :func:`load_master` reads them.

    ``key`` is the parameter stream's key and ``i`` the element's flat index (stochastic rounding)."""
    if fc.param == F32:
        return f32_bits(x), np.uint32(0)
    if fc.master == MASTER_R16:
        hi, rem = remainder16_split(x)
        return hi, np.uint32(np.int64(rem) & 0xFFFFFFFF)
    if fc.master == MASTER_R8:
        hi, rem = remainder8_split(round24(x))
        return hi, np.uint32(np.int64(rem) & 0xFFFFFFFF)
    if fc.param == BF16:
        if fc.master == MASTER_NONE and fc.stochastic:
            h = bf16_stochastic(x, rand32(key, i))
        else:
            h = bf16_nearest(x)
    else:
        h = f16_nearest(x)
    if fc.master == MASTER_F32:
        return h, f32_bits(x)
    return h, np.uint32(0)


@_jit
def format_element(praw, mraw, graw, s0, s1, s2, sc, fc, key, i):
    """One element of a pointwise family in a format: decode, ``element_update``, encode the master.

    ``s0``-``s2`` are the decoded float32 state values (0 for unused slots) and come back updated
    for the loop to encode. Returns (parameter word, master word, s0, s1, s2) with the words as uint32
    (a remainder word holds the signed remainder's two's complement)."""
    p = load_master(praw, mraw, fc)
    g = decode_value(graw, fc.grad)
    p, s0, s1, s2 = element_update(p, g, s0, s1, s2, sc)
    pw, mw = store_master(p, fc, key, i)
    return pw, mw, s0, s1, s2


@_jit
def lamb_format_element(praw, mraw, graw, m, v, grad_scale, sc, fc):
    """LAMB's per-element work in a format: (master p, new m, new v, direction u), all float32.

    Both passes call it with the same inputs (pass 1 for the norms, pass 2 to apply
    ``p - lr * ratio * u``), so they see the same values; nothing is written in pass 1."""
    p = load_master(praw, mraw, fc)
    g = decode_value(graw, fc.grad)
    m, v = lamb_moments(g, m, v, grad_scale, sc)
    return p, m, v, lamb_direction(p, m, v, sc)
