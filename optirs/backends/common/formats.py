"""The per-element code of the step formats, written once for numba and shared by cpu and cuda.

docs/formats.md is the contract; this is its numba text: the float32 <-> bits casts, the
counter-based random bits, bfloat16 rounding (nearest even and stochastic), float16, the
remainder16 / remainder8 master splits, int8 map quantization, and the uniform format element
step (decode the master and the gradient, the family's ``element_update``, encode the master).
Every function is ``@njit``: the cpu loops call them, numba-cuda compiles them as device
functions (as :mod:`optirs.backends.common.elementwise`). Bit arithmetic is 32-bit, through the
intrinsics of :mod:`optirs.backends.common.bits32`: numba widens uint32 arithmetic to 64 bits,
which a GPU emulates with two to four instructions per operation.

The codes the functions branch on (``fc``, an :class:`optirs.core.formats.FormatCodes`) are the
same for every element of a launch. State slots are decoded and encoded by the loops around the
element step, since an int8 block's scale depends on all of its new values.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from optirs.backends.common.bits32 import (add32, and32, bits_f32_cast, f32_bits_cast, lt_bit, mul32, or32, shl32,
                                           shr32, sub32, u32, xor32)
from optirs.backends.common.int8_buckets import HI as _BK_HI, LO as _BK_LO, WIDTH as _BK_WIDTH
from optirs.backends.common.elementwise import element_update, lamb_direction, lamb_moments
from optirs.backends.common.fast_paths import div_fast, dividend_in_window, fma_rn, mul_rn, sqrt_fast
from optirs.backends.common.half_native import native_or
from optirs.core.compile_cache import prepare_kernel_compilation
from optirs.core.formats import (BF16, F32, FP8_MAX, FP8_PRE_BELOW, MASTER_F32, MASTER_NONE, MASTER_R16, MASTER_R8,
                                 STATE_BF16, STATE_F32)

prepare_kernel_compilation()  # before the first decorator: numba picks the cache directory there

# Not cached on disk: numba links a function loaded from its cache into a new caller as object
# code, which LLVM cannot inline, so a loop compiled in a later process would call these per
# element and not vectorize (2-4x slower, measured on the cpu). The loops that call them are
# cached, with them inlined.
_jit = njit(cache=False, error_model="numpy")
# The element steps are inlined into their loops by numba itself: the format codes are constants
# of each loop, and once the step is in it the branches on them fold away (LLVM then inlines the
# helpers they call). Left to LLVM, whose inliner judges a function by its size with every branch
# still in it, format_element of float16 parameters stayed a call per element and its loop ran
# scalar (26 ns a value, measured).
_inline = njit(cache=False, error_model="numpy", inline="always")

_Z = np.uint32(0)
_EXP = np.uint32(0x7F800000)  # float32 exponent bits: inf when the mantissa is 0
_ABS = np.uint32(0x7FFFFFFF)
_QNAN = np.uint32(0x7FC00000)
_E5 = np.uint32(0x1F)
_F16_INF = np.uint32(0x7C00)
_BK_FIRST = np.uint32(_BK_LO - 1)  # the bucket table's clamp of |y|'s top 16 bits
_BK_LAST = np.uint32(_BK_HI + 1)


# ---------------------------------------------------------------- bit casts


@_jit
def f32_bits(x):
    """The float32 bit pattern of ``x`` (as uint32)."""
    return f32_bits_cast(np.float32(x))


@_jit
def bits_f32(u):
    """The float32 whose bit pattern is the low 32 bits of ``u``."""
    return bits_f32_cast(np.uint32(u))


_F16_SUB = np.float32(2.0**-24)  # the float16 subnormal step


@_jit
def _f16_decode_bits(h):
    """float16 bits -> float32, as :func:`optirs.backends.common.half.f16_decode` (NaN -> the quiet NaN
    with h's sign), from bit operations: no scale table, whose lane-divergent reads the GPU serialises.
    Every case is computed and the result selected, no branch: the cpu loops vectorize it."""
    sign = shl32(and32(h, 0x8000), 16)
    e = and32(shr32(h, 10), 0x1F)
    m = and32(h, 0x3FF)
    normal = add32(shl32(and32(h, 0x7FFF), 13), 0x38000000)  # exponent rebased by 127 - 15
    special = or32(_EXP, _Z if m == _Z else _QNAN)  # inf, or the quiet NaN
    subnormal = f32_bits(np.float32(m) * _F16_SUB)  # exact: m < 2**10
    a = special if e == _E5 else normal
    a = subnormal if e == _Z else a
    return bits_f32(or32(sign, a))


@_jit
def _bf16_decode(h):
    """bfloat16 bits -> float32, as :func:`optirs.backends.common.half.bf16_decode` (NaN -> the quiet
    NaN with h's sign): the bits shifted up, which is the exact value for every other input. Bit
    operations only: the scale-table form's lane-divergent reads are serialised on a GPU (the
    old kernels' ld.const)."""
    u = shl32(h, 16)
    if and32(u, _ABS) > _EXP:
        u = or32(and32(u, 0x80000000), _QNAN)
    return bits_f32(u)


# ---------------------------------------------------------------- random bits


@_jit
def fmix32(h):
    """MurmurHash3's 32-bit finalizer of the low 32 bits of ``h`` (a uint32)."""
    h = u32(h)
    h = xor32(h, shr32(h, 16))
    h = mul32(h, 0x85EBCA6B)
    h = xor32(h, shr32(h, 13))
    h = mul32(h, 0xC2B2AE35)
    return xor32(h, shr32(h, 16))


@_jit
def stream_key(seed, step, stream):
    """``fmix32(seed ^ fmix32(step * 4 + stream))``: the key of one random stream of one step."""
    return fmix32(xor32(seed, fmix32(add32(mul32(step, 4), stream))))


@_jit
def rand32(key, i):
    """``fmix32(key ^ (i * 0x9E3779B1))`` for element ``i`` (its flat layout index, low 32 bits).

    The finalizer's first step distributed over the xor (a logical shift does:
    ``(k ^ t) >> 16 == (k >> 16) ^ (t >> 16)``): ``key ^ (key >> 16)`` is the same for every element
    (hoisted out of a kernel's loops), so the element pays a shift and one three-input xor where the
    xor with the key, the shift and the second xor took three instructions."""
    t = mul32(i, 0x9E3779B1)
    h = xor32(xor32(key, shr32(key, 16)), xor32(t, shr32(t, 16)))
    h = mul32(h, 0x85EBCA6B)
    h = xor32(h, shr32(h, 13))
    h = mul32(h, 0xC2B2AE35)
    return xor32(h, shr32(h, 16))


@_jit
def state_stream(k):
    """The random stream of state slot ``k``: slots 0 and 1 share stream 1, slot 2 takes stream 2."""
    return 1 + (k >> 1)


@_jit
def slot_bits(r, k):
    """Slot ``k``'s 16 random bits from its stream's word ``r`` (low half for even ``k``, high half
    for odd): two slots stochastically rounded by one hash per element."""
    return shr32(r, 16) if (k & 1) == 1 else and32(r, 0xFFFF)


# ---------------------------------------------------------------- 16-bit encodings


@_jit
def decode16(h, kind):
    """bfloat16 (``kind`` BF16) or float16 bits -> float32."""
    if kind == BF16:
        return _bf16_decode(h)
    return _f16_decode(h)


@_jit
def decode_value(raw, kind):
    """A parameter or gradient word -> float32: float32 bits (``kind`` F32), else 16-bit bits."""
    if kind == F32:
        return bits_f32(raw)
    return decode16(raw, kind)


@_jit
def bf16_nearest(x):
    """float32 -> bfloat16 bits, nearest even, NaN -> quiet NaN (ml_dtypes' cast; the rounding of
    :func:`optirs.backends.common.half.bf16_encode` in 32-bit operations)."""
    return shr32(bf16_nearest_wide(x), 16)


@_jit
def bf16_nearest_wide(x):
    """:func:`bf16_nearest`'s bits in the high half of a word whose low half is left undefined: a GPU
    kernel packs two such words into one with a byte permute, where the shift and the pack took
    three instructions. A finite ``u`` plus the rounding increment stays below 2**32."""
    u = f32_bits(x)
    rounded = add32(add32(u, 0x7FFF), and32(shr32(u, 16), 1))
    return _nan_wide(u) if and32(u, _ABS) > _EXP else rounded


@_jit
def _nan_wide(u):
    """The quiet NaN with the sign of float32 bits ``u``, in a word's high half (the bfloat16 NaN)."""
    return or32(and32(u, 0x80000000), _QNAN)


@_jit
def f16_nearest_bits(x):
    """float32 -> float16 bits, nearest even (numpy's cast; :func:`optirs.backends.common.half.f16_encode`
    in 32-bit operations, a NaN keeping its top payload bits). Every case is computed and the result
    selected, no branch, so that the cpu loops vectorize it (the branchy form ran scalar, 26 ns a
    value)."""
    u = f32_bits(x)
    sign = and32(shr32(u, 16), 0x8000)
    a = and32(u, _ABS)
    # normal: rebase the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
    # carry out of the mantissa steps the exponent, up to 0x7C00 (inf) from 65520 on
    normal = min(shr32(add32(add32(sub32(a, 0x38000000), 0xFFF), and32(shr32(a, 13), 1)), 13), _F16_INF)
    # subnormal (|x| < 2**-14): the value in units of 2**-24 is mant >> shift, nearest even by the
    # same carry trick; shift clamped to 14..25 (25 and more: 0, 2**-25 itself the tie to even 0)
    shift = min(sub32(126, min(shr32(a, 23), 112)), 25)
    mant = or32(and32(a, 0x7FFFFF), 0x800000)
    half_ulp = shl32(1, sub32(shift, 1))
    subnormal = shr32(add32(add32(mant, sub32(half_ulp, 1)), and32(shr32(mant, shift), 1)), shift)
    payload = and32(shr32(a, 13), 0x3FF)  # a NaN keeps its top payload bits and never becomes inf
    special = or32(_F16_INF, or32(payload, np.uint32(1) if a > _EXP and payload == _Z else _Z))
    h = normal if a >= np.uint32(0x38800000) else subnormal
    h = special if a >= _EXP else h
    return or32(sign, h)


# The cpu's own conversion instructions where it has them (one per 16 values in the cpu loops), the
# bit-by-bit forms above on every other target: the same bits (optirs.backends.common.half_native).
_f16_decode = native_or(_f16_decode_bits, "decode")
f16_nearest = native_or(f16_nearest_bits, "encode")


@_jit
def bf16_stochastic(x, r):
    """float32 -> bfloat16 bits, rounded up with probability ``low16 / 65536`` (``r`` the random word);
    inf and NaN round to nearest. The sum is inf's nearest too (its low 16 bits are 0, so nothing
    carries): only a NaN is set apart, as ``bf16_nearest`` does (half the instructions of the
    nearest rounding on a GPU; the select vectorizes in the cpu loops)."""
    return shr32(bf16_stochastic_wide(x, r), 16)


@_jit
def bf16_stochastic_wide(x, r):
    """:func:`bf16_stochastic`'s bits in the high half of a word, the low half undefined (as
    :func:`bf16_nearest_wide`)."""
    u = f32_bits(x)
    return _nan_wide(u) if and32(u, _ABS) > _EXP else add32(u, and32(r, 0xFFFF))


@_jit
def bf16_stochastic_wide_num(x, r):
    """:func:`bf16_stochastic_wide` of an ``x`` known not to be NaN (inf included): the sum alone. A
    GPU kernel whose round has tested its values once (a fast step's flag) pays one add, where the
    NaN test and its select took four instructions."""
    return add32(f32_bits(x), and32(r, 0xFFFF))


@_jit
def bf16_nearest_wide_num(x):
    """:func:`bf16_nearest_wide` of an ``x`` known not to be NaN: the rounding alone."""
    u = f32_bits(x)
    return add32(add32(u, 0x7FFF), and32(shr32(u, 16), 1))


@_jit
def param_word_wide_num(x, fc, key, i):
    """:func:`param_word_wide` of a master ``x`` known not to be NaN (the same bits, no NaN test)."""
    if fc.master == MASTER_NONE and fc.stochastic:
        return bf16_stochastic_wide_num(x, rand32(key, i))
    return bf16_nearest_wide_num(x)


# ---------------------------------------------------------------- remainder masters


@_jit
def quiet_nan_master(u):
    """The bits ``u`` of a new float32 master with a NaN made the quiet NaN of its sign (0x7FC00000 |
    sign), every other value kept: a remainder master splits a NaN as any other word, and a payload
    with its bit 15 set (NVIDIA's NaN, 0x7FFFFFFF; a gradient's NaN payload carried by the arithmetic)
    would carry the rounding up into the sign bit and leave the bfloat16 parameter a zero."""
    return _nan_wide(u) if and32(u, _ABS) > _EXP else u


@_jit
def remainder16_split_num(x):
    """The exact float32 master ``x``, not NaN -> (bfloat16 bits ``hi``, int16 remainder as int32)."""
    u = f32_bits(x)
    lo = and32(u, 0xFFFF)
    # a remainder of 0x8000 or more is negative: the high half rounds up by one
    return and32(add32(shr32(u, 16), shr32(lo, 15)), 0xFFFF), np.int32(np.int16(lo))


@_jit
def remainder16_split(x):
    """:func:`remainder16_split_num` of any master: a NaN splits as the quiet NaN of its sign (the
    bfloat16 quiet NaN and a remainder of 0, :func:`quiet_nan_master`)."""
    return remainder16_split_num(bits_f32(quiet_nan_master(f32_bits(x))))


@_jit
def remainder16_join(hi, rem):
    """bfloat16 bits ``hi`` and an int16 remainder -> the exact float32 master."""
    return bits_f32(or32(shl32(sub32(hi, shr32(rem, 31)), 16), and32(rem, 0xFFFF)))


@_jit
def round24_word_num(x):
    """:func:`round24_word` of an ``x`` known not to be NaN (inf included: its low byte is 0, so the
    rounding increment carries nothing into the top 24 bits): the rounding without the test. A GPU
    kernel whose round has tested its masters once (a fast step's flag) pays the shift, the mask and
    one add, where the exponent test and its select took three more."""
    u = f32_bits(x)
    return add32(add32(u, 0x7F), and32(shr32(u, 8), 1))


@_jit
def round24_num(x):
    """:func:`round24` of a non-NaN ``x`` (inf rounds to itself: the same bits, no exponent test)."""
    return bits_f32(shl32(shr32(round24_word_num(x), 8), 8))


@_jit
def round24(x):
    """float32 -> float32 with its low 8 bits zero, nearest even on them (inf stays; a NaN is the quiet
    NaN of its sign, :func:`quiet_nan_master`)."""
    if and32(f32_bits(x), _EXP) == _EXP:
        return bits_f32(quiet_nan_master(f32_bits(x)))
    return round24_num(x)


@_jit
def round24_word(x):
    """:func:`round24`'s bits in the top 24 bits of a word whose low byte is left as the addition
    leaves it (nobody reads it): the rounding without the masking."""
    u = f32_bits(x)
    if and32(u, _EXP) == _EXP:
        return quiet_nan_master(u)
    return round24_word_num(x)


@_jit
def remainder8_split(x):
    """A float32 master with zero low 8 bits (``round24``'s result) -> (bfloat16 bits, int8 remainder as int32)."""
    u24 = shr32(f32_bits(x), 8)
    lo = and32(u24, 0xFF)
    return and32(add32(shr32(u24, 8), shr32(lo, 7)), 0xFFFF), np.int32(np.int8(lo))


@_jit
def remainder8_join(hi, rem):
    """bfloat16 bits ``hi`` and an int8 remainder -> the 24-bit float32 master."""
    return bits_f32(shl32(or32(shl32(sub32(hi, shr32(rem, 31)), 8), and32(rem, 0xFF)), 8))


# ---------------------------------------------------------------- int8 blocks


@_jit
def quantize(x, pre, inv, mid, table):
    """The code of float32 ``x`` in a block whose :func:`quantize_factors` are ``pre, inv``: the
    number of ``mid[k] < (x * pre) * inv``. ``mid``: the map's 255 float32 midpoints padded with
    +inf, ``table`` its bucket table (:mod:`optirs.backends.common.int8_buckets`): one lookup and
    one compare, no branch. Its three steps are functions of their own so that a cpu loop can run
    the arithmetic ones vectorized, apart from the lookups."""
    y = quantize_scaled(x, pre, inv)
    return quantize_code(y, table[quantize_bucket(y)], mid)


_TINY_SCALE = np.float32(2.0**-126)  # below: a subnormal scale, whose reciprocal may overflow
_PRE_TINY = np.float32(2.0**64)


@_jit
def quantize_factors(scale):
    """A block's ``(pre, inv)``: its values are coded as ``(x * pre) * inv``, one reciprocal per block
    in place of a division per element (docs/formats.md). ``pre`` is 1, or 2**64 for a subnormal
    scale (exact: the scale and the block's values are scaled up alike, and the reciprocal stays
    finite); ``inv`` is 0 for a zero scale (every value of the block is then 0)."""
    if scale < _TINY_SCALE and scale > 0:
        return _PRE_TINY, np.float32(1) / (scale * _PRE_TINY)
    if scale == 0:
        return np.float32(1), np.float32(0)
    return np.float32(1), np.float32(1) / scale


@_jit
def quantize_scaled(x, pre, inv):
    """``(x * pre) * inv`` in float32: the value :func:`quantize` codes (``pre`` 1 leaves ``x`` as it is)."""
    return (x * pre) * inv


@_jit
def quantize_bucket(y):
    """The bucket table index of the scaled value ``y`` (uint32). A NaN takes the bucket of its
    magnitude with the sign set, whose table entry is 0 (no midpoint lies below -inf), so that
    :func:`quantize_code` needs no test of its own for it."""
    u = f32_bits(y)
    a = min(max(and32(shr32(u, 16), 0x7FFF), _BK_FIRST), _BK_LAST)
    negative = np.uint32(1) if y != y else shr32(u, 31)
    return add32(sub32(a, _BK_FIRST), mul32(negative, _BK_WIDTH))


@_jit
def quantize_finite(x, pre, inv, mid, table):
    """:func:`quantize` for a block of finite scale, whose scaled values are never NaN and at most
    ``1 + 2**-23`` in magnitude (``|x| <= scale``, ``inv`` its correctly rounded reciprocal): the
    bucket needs neither the NaN test nor the upper clamp. The same code as :func:`quantize`."""
    y = quantize_scaled(x, pre, inv)
    # the magnitude clamped as a float (one max with |y|, the sign a free operand modifier on a GPU),
    # whose top 16 bits are those of quantize_bucket's integer clamp
    a = shr32(f32_bits(max(abs(y), _PK_LOW)), 16)
    return quantize_code(y, table[add32(sub32(a, _BK_FIRST), mul32(shr32(f32_bits(y), 31), _BK_WIDTH))], mid)


# ---- the square-root codes (state_dtype "int8_sqrt"): arithmetic, no table


@_jit
def sqrt_factors(scale, n):
    """A block's ``(k, w)`` of the square-root codes: a value's root times ``k`` is coded and
    ``(c * |c|) * w`` decoded (docs/formats.md). ``k = n / sqrt(scale)`` (0 for a zero scale),
    ``w = scale / n**2``; ``n``: the largest code (127 for a signed slot, 255 for an unsigned one),
    float32."""
    scale = np.float32(scale)  # the CUDA simulator's Python floats
    k = np.float32(0) if scale == 0 else np.float32(n / np.float32(math.sqrt(scale)))
    return k, np.float32(scale / np.float32(n * n))


@_jit
def sqrt_value(c, w):
    """The value of code ``c`` (int32: a signed slot's byte sign-extended) under factor ``w``."""
    t = np.float32(c)
    return (t * abs(t)) * w


# s + 1.5 * 2**23 holds the integer nearest s (ties to even: the constant is even) in its low mantissa
# bits, two's complement below the constant for a negative s (|s| < 2**22)
_ROUND_WORD = np.float32(12582912.0)


@_jit
def sqrt_code_of_product(t, x, signed):
    """The code of ``x`` (docs/formats.md) from ``t``, its root times its block's ``k`` (not NaN, not
    negative), as a uint32 whose low byte is the code (the stores take that byte): ``t`` given
    ``x``'s sign in a signed slot, rounded to the nearest integer by one add (:data:`_ROUND_WORD`),
    where a GPU's conversion to an integer runs on its narrow conversion pipe and a cpu's rounding
    and conversion take one vector instruction as well."""
    t = np.float32(t)
    if signed:
        t = np.float32(math.copysign(t, x))
    return f32_bits(t + _ROUND_WORD)


@_jit
def sqrt_code_of_root(r, k, x, signed):
    """The code of ``x`` from its root ``r`` (``sqrt(|x|)`` in a signed slot, ``sqrt(x)`` in an
    unsigned one) and its block's ``k``: a NaN product (a negative or NaN radicand's root, or inf
    times the 0 of an inf scale's block) made 0."""
    t = mul_rn(np.float32(r), np.float32(k))  # rounded before the rounding add: never fused with it
    return sqrt_code_of_product(t if t > 0 else np.float32(0), x, signed)


@_jit
def sqrt_code(x, k, signed):
    """:func:`sqrt_code_of_root` with the root taken here (correctly rounded; a negative or NaN
    radicand's root is 0 here, NaN in the contract: the same code 0)."""
    x = np.float32(x)
    u = abs(x) if signed else x
    return sqrt_code_of_root(np.float32(math.sqrt(u if u > 0 else np.float32(0))), k, x, signed)


# ---- the square-root codes by a GPU's fast paths: the same factors and codes (fast_paths' windows)

# A block whose scale is in [2**-80, 2**98) takes k by sqrt_fast and div_fast (the root of the scale
# is in div_fast's divisor window, n in its dividend window) and its values' roots by sqrt_fast of the
# radicand raised to SQRT_FLOOR: there k < 2**48, so a radicand below the floor codes as 0 either
# way (its root times k is below 1/4), and 0, negative and NaN radicands keep the contract's code 0
# (a NaN fails the compare); the floor is inside sqrt_fast's window, so the root needs no test
SQRT_FAST_LO = np.float32(2.0**-80)
SQRT_FAST_HI = np.float32(2.0**98)
SQRT_FLOOR = np.float32(2.0**-100)


@_jit
def sqrt_decode_factor(scale, n2):
    """:func:`sqrt_factors`' ``w`` (``scale / n2``, ``n2`` the largest code squared): by ``div_fast``
    where ``scale`` is in its dividend window (``n2`` always is in its divisor window), the IEEE
    division elsewhere (0, tiny, huge, inf, NaN)."""
    if dividend_in_window(scale):
        return div_fast(scale, n2)
    return scale / n2


@_jit
def sqrt_encode_factor(scale, n):
    """``(fast, k)``: :func:`sqrt_factors`' ``k``, and whether the block takes the fast forms
    (:func:`sqrt_code_fast`): by ``sqrt_fast`` and ``div_fast`` for a scale in [2**-80, 2**98),
    :func:`sqrt_factors` elsewhere (then each code by :func:`sqrt_code`)."""
    scale = np.float32(scale)
    if scale >= SQRT_FAST_LO and scale < SQRT_FAST_HI:
        return True, np.float32(div_fast(n, sqrt_fast(scale)))
    k, _ = sqrt_factors(scale, n)
    return False, k


@_jit
def sqrt_code_fast(x, k, signed):
    """:func:`sqrt_code` in a block of :func:`sqrt_encode_factor`'s fast forms: the root of the
    radicand raised to the floor, by ``sqrt_fast``, times ``k`` (never NaN there: no select; 9
    instructions, one ``MUFU``, on a GPU)."""
    x = np.float32(x)
    u = abs(x) if signed else x
    return sqrt_code_of_product(mul_rn(sqrt_fast(u if u > SQRT_FLOOR else SQRT_FLOOR), np.float32(k)), x, signed)


@_jit
def sqrt_value_byte(b, signed, w):
    """:func:`sqrt_value` of the code byte ``b`` (a uint32 below 256) of a signed or unsigned slot, the
    integer made a float by its bits: ``b`` in the low mantissa bits of 2**23 (xor 0x80 first for a
    signed slot, which makes it ``c + 128``) less the constant, exactly ``c``. Two full-rate
    instructions, where a GPU's integer conversion runs on its narrow conversion pipe."""
    if signed:
        t = bits_f32(xor32(b, 0x4B000080)) - np.float32(8388736.0)
    else:
        t = bits_f32(or32(b, 0x4B000000)) - np.float32(8388608.0)
    return (t * abs(t)) * w


# sqrt_value_fma's window: sqrt_decode_factor's (a scale in div_fast's dividend window), where w is in
# [2**-88, 2**58], so that -2**23 * w is exact and every product of the block is normal
SQRT_FMA_BASE = np.float32(-(2.0**23))


@_jit
def sqrt_value_fma(b, signed, w, nw):
    """:func:`sqrt_value_byte` for a block whose scale is in :func:`sqrt_decode_factor`'s window, ``nw``
    its ``-2**23 * w``: ``c * c`` put in 2**23's mantissa by one integer multiply-add, times ``w`` less
    ``2**23 * w`` by one fused multiply-add, which is ``c * c * w`` exactly before its one rounding
    (the contract's ``(c * |c|) * w``); a signed slot's sign put back on it by one or."""
    c = u32(np.int32(np.int8(b))) if signed else u32(b)
    v = fma_rn(bits_f32(add32(mul32(c, c), 0x4B000000)), w, nw)
    if signed:
        return bits_f32(or32(f32_bits(v), and32(c, 0x80000000)))
    return v


# ---- the float8 state (state_dtype "float8_e4m3fn"): float8 bits by integer arithmetic, no table
#
# A GPU from sm_89 on converts float32 pairs to float8 and back in one instruction (the cuda kernels'
# fast forms); these are the contract's bits on every target, and what the cpu loops vectorize.

_F8_MAX_BITS = np.uint32(0x43E00000)  # 448.0, float8_e4m3fn's largest finite value
_F8_NORMAL_BITS = np.uint32(0x3C800000)  # 2**-6, its smallest normal
_F8_SUB_WORD = np.float32(16384.0)  # 2**14, whose ulp is 2**-9: the float8 subnormals' step
_F8_SUB_BITS = np.uint32(0x46800000)  # its bits
_F8_REBIAS = np.uint32(120 << 3)  # the exponent bias 127 less float8's 7, in the code's exponent field
_F8_PRE = np.float32(2.0**64)
_F8_POST = np.float32(2.0**-64)
_F8_MAX = np.float32(FP8_MAX)
_F8_PRE_BELOW = np.float32(FP8_PRE_BELOW)


@_jit
def fp8_factors(scale):
    """A block's ``(pre, k, w, post)`` of the float8 state (:func:`optirs.core.formats.fp8_factors`):
    values coded as ``(x * pre) * k``, decoded as ``(v * w) * post``."""
    scale = np.float32(scale)  # the CUDA simulator's Python floats
    tiny = scale > 0 and scale < _F8_PRE_BELOW
    pre = _F8_PRE if tiny else np.float32(1)
    sp = np.float32(scale * pre)
    k = np.float32(0) if scale == 0 else np.float32(_F8_MAX / sp)
    return pre, k, np.float32(sp / _F8_MAX), _F8_POST if tiny else np.float32(1)


@_jit
def fp8_code(y):
    """The float8_e4m3fn bits of float32 ``y`` (a uint32 whose low byte is the code; docs/formats.md):
    nearest even on the 20 bits a normal value drops, the exponent rebased; below 2**-6 the
    subnormal count by one add to 2**14 (whose ulp is their step; the add rounds to nearest even);
    at and above 448 saturated to 448; a NaN 0x7F."""
    u = f32_bits(y)
    a = and32(u, _ABS)
    normal = sub32(shr32(add32(add32(a, 0x7FFFF), and32(shr32(a, 20), 1)), 20), _F8_REBIAS)
    small = sub32(f32_bits(bits_f32(a) + _F8_SUB_WORD), _F8_SUB_BITS)
    c = small if a < _F8_NORMAL_BITS else normal
    c = np.uint32(0x7E) if a >= _F8_MAX_BITS else c
    c = or32(c, and32(shr32(u, 24), 0x80))
    return np.uint32(0x7F) if a > _EXP else c


@_jit
def fp8_value(b):
    """The float32 value of float8_e4m3fn bits ``b`` (a uint32 below 256; 0x7F and 0xFF: NaN): a normal
    code's exponent and mantissa moved into a float32's and rebased, a subnormal's count (made a float
    by its bits in 2**23's mantissa) times 2**-9, the sign or'ed in."""
    m = and32(b, 0x7F)
    normal = bits_f32(add32(shl32(m, 20), 0x3C000000))
    small = (bits_f32(or32(m, 0x4B000000)) - np.float32(8388608.0)) * np.float32(2.0**-9)
    v = small if m < np.uint32(8) else normal
    v = bits_f32(or32(f32_bits(v), shl32(and32(b, 0x80), 24)))
    return bits_f32(_QNAN) if m == np.uint32(0x7F) else v


# ---- the packed bucket words of a map whose midpoints are all positive (the unsigned map)
#
# One 32-bit word per positive bucket b (index b = top16(a) - (LO - 1), a = y clamped to
# [_PK_LOW, _PK_TOP]) holds both lookups of :func:`quantize`: with ``c`` the bucket's table entry and
# ``thr`` the low 16 bits of its midpoint (mid[c], in the bucket when their top 16 bits agree),
# ``word = ((c - top16) << 16) + (0xFFFF - thr)`` (``+ 0`` without a midpoint). Then ``word + bits(a)``
# has ``c`` in its top 16 bits, plus one exactly when the low 16 bits of ``a`` exceed ``thr``: in the
# bucket, where the top 16 bits agree, that is ``mid[c] < y`` (a carry). A value below every bucket
# (zero, negative, tiny) is clamped into bucket 0, which holds no midpoint (code 0); one above (only
# the general path's: > 1, inf) into the last, whose code is 255. One shared load and one add an
# element, where the bucket arithmetic, two dependent loads and a compare took about 14 instructions.
_PK_LOW = np.uint32(np.uint32(_BK_LO - 1) << np.uint32(16)).view(np.float32)  # bucket 0's lowest value
_PK_TOP = np.uint32(np.uint32(_BK_HI + 1) << np.uint32(16)).view(np.float32)  # the last bucket's


@_jit
def packed_word(b, c, m):
    """The packed word of positive bucket ``b`` (0 to WIDTH - 1) of a map with no midpoint at or below
    2**-23 nor any negative one: ``c`` its bucket table entry, ``m`` = mid[c] (float32)."""
    top = add32(b, _BK_FIRST)
    mu = f32_bits(m)
    low = sub32(0xFFFF, and32(mu, 0xFFFF)) if shr32(mu, 16) == top else _Z
    return add32(shl32(sub32(c, top), 16), low)


@_jit
def quantize_packed(x, pre, inv, packed):
    """:func:`quantize` by the packed words ``packed`` (:func:`packed_word` of every positive bucket):
    the code in the top 16 bits of the uint32 returned (a NaN codes as 0, as in quantize)."""
    y = quantize_scaled(x, pre, inv)
    if y != y:
        y = np.float32(0)
    u = f32_bits(min(max(y, _PK_LOW), _PK_TOP))
    return add32(packed[sub32(shr32(u, 16), _BK_FIRST)], u)


@_jit
def quantize_packed_finite(x, pre, inv, packed):
    """:func:`quantize_packed` for a block of finite scale (:func:`quantize_finite`'s reason: no NaN,
    no value above the last bucket, so one clamp)."""
    u = f32_bits(max(quantize_scaled(x, pre, inv), _PK_LOW))
    return add32(packed[sub32(shr32(u, 16), _BK_FIRST)], u)


@_jit
def quantize_code(y, c, mid):
    """The code of the scaled value ``y`` whose bucket (:func:`quantize_bucket`) has table entry ``c``:
    ``c`` plus one where the bucket's midpoint lies below ``y`` (a NaN compares false: code 0). A
    uint32 below 256: the stores take its low byte (on a GPU the pack's ``prmt`` needs no mask)."""
    c = u32(c)  # unsigned: no negative-index wraparound
    return add32(c, lt_bit(mid[c], y))


@_jit
def dequantize(code, scale, q):
    """``q[code] * scale`` in float32."""
    return q[code] * scale


@_jit
def absmax_update(m, x):
    """max(m, |x|), NaN-propagating: once ``m`` or ``|x|`` is NaN the result is NaN, so a NaN anywhere
    in a block makes its scale NaN (docs/formats.md), whatever comes after it in its lane."""
    a = abs(x)
    return a if not (a <= m) and m == m else m


# ---------------------------------------------------------------- state words


@_jit
def decode_state(raw, kind):
    """A float32 (``kind`` STATE_F32: its bits) or bfloat16 state word -> float32."""
    if kind == STATE_F32:
        return bits_f32(raw)
    # np.uint32: loops that hold float32 state type this branch with a float ``raw`` too
    return _bf16_decode(np.uint32(raw))


@_jit
def encode_state(x, kind, r):
    """float32 -> a state word: float32 bits, or bfloat16 rounded stochastically with random bits ``r``
    (the slot's :func:`slot_bits`; only the low 16 bits count)."""
    if kind == STATE_BF16:
        return bf16_stochastic(x, r)
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


def _master_store(round24_of, remainder16_of, param_word_of):
    """The new float32 master ``x`` -> (parameter word, master word), as :func:`load_master` reads them,
    by the given rounding of a remainder8 master and bfloat16 parameter word: the forms with their
    NaN tests, or the forms for a master known not to be NaN (the same bits for every other value).

    ``key`` is the parameter stream's key and ``i`` the element's flat index (stochastic rounding)."""

    @_jit
    def store(x, fc, key, i):
        if fc.param == F32:
            return f32_bits(x), np.uint32(0)
        if fc.master == MASTER_R16:
            hi, rem = remainder16_of(x)
            return hi, u32(rem)
        if fc.master == MASTER_R8:
            hi, rem = remainder8_split(round24_of(x))
            return hi, u32(rem)
        if fc.param == BF16:
            h = shr32(param_word_of(x, fc, key, i), 16)
        else:
            h = f16_nearest(x)
        if fc.master == MASTER_F32:
            return h, f32_bits(x)
        return h, np.uint32(0)

    return store


@_jit
def param_word_wide(x, fc, key, i):
    """The bfloat16 parameter of master ``x`` in a word's high half (:func:`bf16_nearest_wide`), for
    a bfloat16 parameter that is its own master (stochastically rounded where ``fc`` says so) or
    has a float32 master."""
    if fc.master == MASTER_NONE and fc.stochastic:
        return bf16_stochastic_wide(x, rand32(key, i))
    return bf16_nearest_wide(x)


# Every master store of the formats; the cpu loops' NaN-free first try takes store_master_num.
store_master = _master_store(round24, remainder16_split, param_word_wide)
store_master_num = _master_store(round24_num, remainder16_split_num, param_word_wide_num)


@_jit
def store_master_wide(x, fc, key, i):
    """:func:`store_master` for the formats of :func:`param_word_wide` and the remainder masters, as
    words a kernel stores by picking bytes: (the bfloat16 parameter in the high half, the master
    word). The master word is the float32 master's bits (or 0), or for a remainder master the word
    whose low half (remainder16) or byte 1 (remainder8) is the remainder: the split's words with
    neither mask nor sign extension (:func:`load_master_wide` reads them back)."""
    if fc.master == MASTER_R16:
        u = quiet_nan_master(f32_bits(x))
        return add32(u, 0x8000), u  # the high half rounds up where the remainder is negative
    if fc.master == MASTER_R8:
        t = round24_word(x)
        return add32(t, 0x8000), t
    return param_word_wide(x, fc, key, i), f32_bits(x) if fc.master == MASTER_F32 else np.uint32(0)


@_jit
def store_master_wide_num(x, fc, key, i):
    """:func:`store_master_wide` of a master ``x`` known not to be NaN (the same words; the remainder
    masters without :func:`quiet_nan_master`'s and :func:`round24_word`'s tests)."""
    if fc.master == MASTER_R16:
        u = f32_bits(x)
        return add32(u, 0x8000), u
    if fc.master == MASTER_R8:
        t = round24_word_num(x)
        return add32(t, 0x8000), t
    return store_master_wide(x, fc, key, i)


@_jit
def remainder_word(w, master):
    """A remainder word as stored (int16 in the low half, int8 in the low byte) -> the word
    :func:`load_master_wide` adds to the bfloat16 high half: the remainder sign-extended (remainder16)
    or sign-extended and shifted to bits 8 and up (remainder8)."""
    if master == MASTER_R16:
        return u32(np.int32(np.int16(w)))
    return shl32(u32(np.int32(np.int8(w))), 8)


@_jit
def load_master_wide(pw, mw):
    """The float32 master of a remainder format from its bfloat16 parameter in a word's high half and
    :func:`remainder_word`'s word: their sum (``(hi << 16) + rem`` is the join of
    :func:`remainder16_join` / :func:`remainder8_join`, the rounding up of ``hi`` undone by the
    negative remainder)."""
    return bits_f32(add32(pw, mw))


@_inline
def format_element(praw, mraw, graw, s0, s1, s2, sc, fc, key, i):
    """One element of a pointwise family in a format: decode, ``element_update``, encode the master.

    ``s0``-``s2`` are the decoded float32 state values (0 for unused slots) and come back updated
    for the loop to encode. Returns (parameter word, master word, s0, s1, s2) with the words as uint32
    (a remainder word holds the signed remainder's two's complement)."""
    return format_update(load_master(praw, mraw, fc), decode_value(graw, fc.grad), s0, s1, s2, sc, fc, key, i)


@_inline
def format_update(p, g, s0, s1, s2, sc, fc, key, i):
    """:func:`format_element` from the decoded float32 master ``p`` and gradient ``g`` on (for a
    kernel that decodes them its own way)."""
    p, s0, s1, s2 = element_update(p, g, s0, s1, s2, sc)
    pw, mw = store_master(p, fc, key, i)
    return pw, mw, s0, s1, s2


@_inline
def lamb_format_element(praw, mraw, graw, m, v, grad_scale, sc, fc):
    """LAMB's per-element work in a format: (master p, new m, new v, direction u), all float32.

    Both passes call it with the same inputs (pass 1 for the norms, pass 2 to apply
    ``p - lr * ratio * u``), so they see the same values; nothing is written in pass 1."""
    return lamb_format_update(load_master(praw, mraw, fc), decode_value(graw, fc.grad), m, v, grad_scale, sc)


@_inline
def lamb_format_update(p, g, m, v, grad_scale, sc):
    """:func:`lamb_format_element` from the decoded float32 master ``p`` and gradient ``g`` on."""
    m, v = lamb_moments(g, m, v, grad_scale, sc)
    return p, m, v, lamb_direction(p, m, v, sc)
