"""The cuda backend's formats kernels (imported on the first formats call: imports numba.cuda).

Every kernel covers the whole model in one launch, driven by the tables of
:mod:`optirs.backends.cuda.kernels` (the chunk table ``tensor, start, count, state offset`` and
the pointer table ``param, grad`` addresses) plus the formats' tensor table (``state offset,
first int8 block, small-state offset``, :meth:`optirs.core.formats.FormatState.tensor_table`).

Work is cut in groups of 256 elements, one warp per group and 8 consecutive elements per lane:
8 bfloat16/float16 values are one 16-byte load, 8 int8 codes or remainders one 8-byte load
(:mod:`optirs.backends.cuda.formats_memory`). A group is exactly one int8 block (blocks and chunks
both start at multiples of 256 from the start of their tensor), so a block's absmax is a warp
reduction in registers (``shfl.sync.bfly``), with no shared memory and no barrier. Chunks whose
addresses are not aligned for the vector accesses take scalar loads of the same 8 elements.

The loops are uniform over a thread block (every warp runs the same number of rounds, lanes past
the end carry no elements), because numba's simulator has no warp shuffle: there the butterfly
is emulated through shared memory and ``syncthreads``, which needs every thread of the block.

Per-element format math (encodings, random bits, remainders, the int8 map) is the shared numba
code of :mod:`optirs.backends.common.formats`; the optimizer math is ``element_update`` of
:mod:`optirs.backends.common.elementwise`. The kernels here only move memory and reduce, but for
the float8 state's codes, converted in pairs by the GPU's instructions (``fp8_codes4``,
``fp8_values4``: the shared ``fp8_code`` / ``fp8_value``'s bits where the kernels take them).

A family with a fast element step (``FAST_ELEMENT_STEPS``: Adam's square root and division by the
GPU's fast paths, :mod:`optirs.backends.common.fast_paths`) takes a round's 8 elements by it with
one flag and no branch per element; a lane whose flag is false loads the round again and takes
``element_update`` (a branch per round, uniform over the lane; the loop stays block-uniform).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda, float32, float64, int64, uint8, uint32

from optirs.backends.common.bits32 import add32, and32, mul32, or32, shl32, shr32, sub32, u32
from optirs.backends.common.elementwise import lamb_grad_scale, lamb_trust_ratio
from optirs.backends.common.elementwise import APPROX_ELEMENT_STEPS, FAST_ELEMENT_STEPS, element_update
from optirs.backends.common.fast_paths import (DIVIDEND_HI, div_fast, dividend_in_window, divisor_in_window, rcp_fast,
                                               rcp_in_window)
from optirs.backends.common.formats import (absmax_update, bf16_nearest_wide, bf16_stochastic_wide,
                                           bf16_stochastic_wide_num, bits_f32,
                                           decode_state, decode_value, param_word_wide_num,
                                           dequantize, f32_bits, fp8_code, fp8_factors, fp8_value, lamb_format_update,
                                           load_master, load_master_wide,
                                           packed_word, remainder_word,
                                           quantize, quantize_factors, quantize_finite, quantize_packed,
                                           quantize_packed_finite, rand32, slot_bits, SQRT_FMA_BASE, sqrt_code, sqrt_code_fast,
                                           sqrt_decode_factor, sqrt_encode_factor, sqrt_value_byte, sqrt_value_fma,
                                           state_stream, store_master, store_master_wide, store_master_wide_num,
                                           stream_key)
from optirs.backends.common.int8_buckets import SIZE as TABLE_SIZE, WIDTH as TABLE_WIDTH
from optirs.core.formats import (BF16, F16, F32, FP8_MAX, FP8_PRE_BELOW, MASTER_F32, MASTER_NONE, MASTER_R16, MASTER_R8,
                                 STATE_BF16, STATE_F32, STATE_FP8, STATE_INT8, STATE_INT8_SQRT, INT8_STATE_CODES,
                                 sqrt_levels)

from optirs.backends.cuda.formats_memory import (ld_u8, ld_u16, ld_u32, ld_u32x2, ld_u32x4, st_u8, st_u16, st_u32,
                                                 st_u32x2, st_u32x4)
from optirs.backends.cuda.kernels import SIMULATOR, _device, ld, st

GROUP = 256  # elements per warp and per int8 block
LANE = 8  # elements per lane
GROUP32 = np.uint32(GROUP)
LANE32 = np.uint32(LANE)  # compared with the uint32 counts: a 64-bit compare is two instructions
_FULL = 0xFFFFFFFF

# Non-finite test on raw bits: every exponent bit set (inf or NaN).
EXP_MASK = {"float32": 0x7F800000, "bfloat16": 0x7F80, "float16": 0x7C00}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------ warp reduction

# max_nan(m, x): max(m, x), NaN-propagating (a NaN in either gives NaN), for m and x that are 0 or
# more or NaN; absmax_step(m, x) = max_nan(m, |x|): a block's absmax. On the GPU one
# ``max.NaN.f32`` (sm_80 on), where the compare-and-select took three instructions; its NaN is the
# canonical NaN, as every NaN of GPU arithmetic is, so the scales stored are the same bits.
if SIMULATOR:
    # The simulator has no cuda.shfl_xor_sync: exchange through shared memory (the loops are
    # block-uniform, so every thread reaches both barriers). Lives in the kernels' module, since
    # the simulator gives only this module's ``cuda`` global its per-thread state.
    def _xor_exchange(x, lane_mask):
        buf = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid ^ lane_mask]
        cuda.syncthreads()
        return float32(y)

    def max_nan(m, x):
        return x if (x > m or x != x) else m

    absmax_step = absmax_update  # the shared code's: which NaN a block keeps, as the cpu does
else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @_device
    def _xor_exchange(x, lane_mask):
        return cuda.shfl_xor_sync(_FULL, x, lane_mask)

    @intrinsic
    def max_nan(typingctx, m, x):
        if m != types.float32 or x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            f = ir.FloatType()
            return builder.asm(ir.FunctionType(f, [f, f]), "max.NaN.f32 $0, $1, $2;", "=f,f,f", args,
                               side_effect=False)

        return types.float32(types.float32, types.float32), codegen

    @_device
    def absmax_step(m, x):
        return max_nan(m, abs(x))


if SIMULATOR:
    def pack_high16(a, b):
        return or32(shr32(a, 16), and32(b, 0xFFFF0000))

    def pack_low16(a, b):
        return or32(and32(a, 0xFFFF), shl32(b, 16))

    def _pack_low8(a, b):
        return or32(and32(a, 0xFF), shl32(and32(b, 0xFF), 8))

    def _pack_byte2(a, b):
        return or32(and32(shr32(a, 16), 0xFF), and32(shr32(b, 8), 0xFF00))

    def _pack_byte1(a, b):
        return or32(and32(shr32(a, 8), 0xFF), and32(b, 0xFF00))

    def _prmt(selector):
        def prmt(a, b):
            x = (int(b) << 32) | int(a)
            out = 0
            for i in range(4):
                n = (selector >> (4 * i)) & 0xF
                byte = (x >> (8 * (n & 7))) & 0xFF
                if n & 8:  # the sign of the byte, replicated
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
            return np.uint32(out)

        return prmt
else:
    def _prmt(selector):
        """``prmt.b32 d, a, b, selector`` as an intrinsic of two uint32 (the bytes of ``b:a`` that
        ``selector`` picks: one instruction)."""

        @intrinsic
        def prmt(typingctx, a, b):
            if a != types.uint32 or b != types.uint32:
                return None

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                return builder.asm(ir.FunctionType(i32, [i32, i32]), f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
                                   args, side_effect=False)

            return types.uint32(types.uint32, types.uint32), codegen

        return prmt

    pack_high16 = _prmt(0x7632)
    pack_low16 = _prmt(0x5410)
    _pack_low8 = _prmt(0x5140)  # the low bytes of a and b in the low half (the high half: don't care)
    _pack_byte2 = _prmt(0x7362)  # their bytes 2 there
    _pack_byte1 = _prmt(0x7351)  # their bytes 1 there
# with b = 0: byte k of a (zero-extended), and byte k of a as an int8 shifted to bits 8 and up (the
# remainder8 word of formats.remainder_word); int16 halves sign-extended (remainder16's): one
# instruction each, where shifting, masking and extending took two or three
_byte0, _byte1, _byte2 = _prmt(0x4440), _prmt(0x4441), _prmt(0x4442)
_rem8_0, _rem8_1, _rem8_2, _rem8_3 = _prmt(0x8804), _prmt(0x9914), _prmt(0xAA24), _prmt(0xBB34)
_sext_lo16, _sext_hi16 = _prmt(0x9910), _prmt(0xBB32)
_Z32 = np.uint32(0)
if SIMULATOR:
    def cvt_pack_bf16(lo, hi):
        return pack_high16(bf16_nearest_wide(lo), bf16_nearest_wide(hi))
else:
    @intrinsic
    def cvt_pack_bf16(typingctx, lo, hi):
        if lo != types.float32 or hi != types.float32:
            return None

        def codegen(context, builder, sig, args):
            f = ir.FloatType()
            return builder.asm(ir.FunctionType(ir.IntType(32), [f, f]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                               (args[1], args[0]), side_effect=False)

        return types.uint32(types.float32, types.float32), codegen
cvt_pack_bf16.__doc__ = """``lo`` and ``hi`` rounded to bfloat16 (nearest even) and packed as one word (``lo``'s in the low
half): one ``cvt.rn.bf16x2.f32`` (sm_80 on), ``bf16_nearest``'s bits for every input but NaN (the
hardware writes its own NaN), where rounding each (three instructions) and packing took seven."""

# The float8 state's conversions, four codes to a word (element 0 in the low byte, as stored). On a GPU
# (sm_89 on) a pair of codes is one F2FP each way: cvt.rn.satfinite.e4m3x2.f32 writes two codes, the
# first operand's in the high byte, and ptxas merges a word's second pair into the first's register
# (F2FP ... PACK_AB_MERGE_C: no packing instruction); cvt.rn.f16x2.e4m3x2 widens two codes to float16
# halves, each made a float32 by one HADD2.F32 (exact: every float8 value is a normal float16 or 0).
# The simulator runs the shared fp8_code / fp8_value (the contract's bits on every target).
if SIMULATOR:
    def fp8_codes4(a, b, c, d):
        return or32(or32(and32(fp8_code(a), 0xFF), shl32(and32(fp8_code(b), 0xFF), 8)),
                    or32(shl32(and32(fp8_code(c), 0xFF), 16), shl32(fp8_code(d), 24)))

    def fp8_values4(word):
        return (float32(fp8_value(and32(word, 0xFF))), float32(fp8_value(and32(shr32(word, 8), 0xFF))),
                float32(fp8_value(and32(shr32(word, 16), 0xFF))), float32(fp8_value(shr32(word, 24))))
else:
    _F8_ENCODE4 = """{
.reg .b16 %f8_lo, %f8_hi;
cvt.rn.satfinite.e4m3x2.f32 %f8_lo, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 %f8_hi, $4, $3;
mov.b32 $0, {%f8_lo, %f8_hi};
}"""

    @intrinsic
    def fp8_codes4(typingctx, a, b, c, d):
        if any(x != types.float32 for x in (a, b, c, d)):
            return None

        def codegen(context, builder, sig, args):
            f = ir.FloatType()
            return builder.asm(ir.FunctionType(ir.IntType(32), [f] * 4), _F8_ENCODE4, "=r,f,f,f,f", args,
                               side_effect=False)

        return types.uint32(types.float32, types.float32, types.float32, types.float32), codegen

    def _half_op(op, half, out):
        """An intrinsic of one uint32: ``op`` on its low or high 16 bits (``half`` "lo" or "hi"), split
        off by ``mov.b32`` (ptxas reads the half in place: no shift)."""
        text = f"{{\n.reg .b16 %f8_lo, %f8_hi;\nmov.b32 {{%f8_lo, %f8_hi}}, $1;\n{op} $0, %f8_{half};\n}}"
        ty = ir.FloatType() if out == types.float32 else ir.IntType(32)

        @intrinsic
        def half_op(typingctx, w):
            if w != types.uint32:
                return None

            def codegen(context, builder, sig, args):
                return builder.asm(ir.FunctionType(ty, [ir.IntType(32)]), text, ("=f" if out == types.float32 else "=r")
                                   + ",r", args, side_effect=False)

            return out(types.uint32), codegen

        return half_op

    _e4m3x2_lo, _e4m3x2_hi = (_half_op("cvt.rn.f16x2.e4m3x2", h, types.uint32) for h in ("lo", "hi"))
    _f16_lo, _f16_hi = (_half_op("cvt.f32.f16", h, types.float32) for h in ("lo", "hi"))

    @_device
    def fp8_values4(word):
        p = _e4m3x2_lo(word)
        q = _e4m3x2_hi(word)
        return _f16_lo(p), _f16_hi(p), _f16_lo(q), _f16_hi(q)
fp8_codes4.__doc__ = """The float8_e4m3fn codes of ``a``-``d`` as one word (``a``'s in the low byte): nearest even, a
magnitude of 448 or more saturated to 448. On a GPU two cvt.rn.satfinite.e4m3x2.f32, the contract's
code (``fp8_code``) for every finite value; a NaN's code is the hardware's (callers take fp8_code
where a value may be NaN)."""
fp8_values4.__doc__ = """The float32 values of the 4 float8 codes of ``word`` (the low byte's first): two
cvt.rn.f16x2.e4m3x2 and four conversions of a float16 half, exact (a NaN code's payload is the
hardware's: every use multiplies it, which gives the GPU's canonical NaN either way)."""


pack_high16.__doc__ = """The high halves of ``a`` and ``b`` as one word (``a``'s low): two bfloat16 values kept in
the high halves of their words (``bf16_*_wide``, the loads' widened words) stored as a pair with one
``prmt``, where shifting each down and packing took three instructions."""
pack_low16.__doc__ = """The low halves of ``a`` and ``b`` as one word (``a``'s low): one ``prmt`` where masking,
shifting and or-ing took three (the high halves of the inputs may hold anything)."""


def _has_redux() -> bool:
    """Whether the kernels compile for sm_80 or later (``redux.sync``): the current device's compute
    capability; without a device (PTX built ahead, tests) the kernels target sm_90."""
    if SIMULATOR:
        return False
    try:
        return tuple(cuda.get_current_device().compute_capability) >= (8, 0)
    except Exception:  # no device here: the kernels are compiled for sm_90 (tests, ahead-of-time PTX)
        return True


REDUX = _has_redux()

if REDUX:
    @intrinsic
    def _redux_max_u32(typingctx, x):
        if x != types.uint32:
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            return builder.asm(ir.FunctionType(i32, [i32]), "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r", args,
                               side_effect=True)

        return types.uint32(types.uint32), codegen

    @_device
    def warp_max(x):
        """The largest ``x`` over the 32 lanes of the warp, in every lane, for ``x`` 0 or more or NaN
        (a block's absmax: NaN-propagating, so a non-finite block is not silently scaled). Their
        bits order as their values, the canonical NaN of ``max.NaN`` above inf: one ``redux.sync``
        (sm_80 on) where five shuffles and five maxima took ten instructions a lane."""
        return bits_f32(_redux_max_u32(f32_bits(x)))
else:
    @_device
    def warp_max(x):
        """The largest ``x`` over the 32 lanes of the warp, in every lane (NaN-propagating: a NaN in
        any lane gives NaN everywhere, so a non-finite block is not silently scaled)."""
        for k in (16, 8, 4, 2, 1):
            x = max_nan(x, float32(_xor_exchange(x, k)))
        return x


@_device
def _block_sum(x):
    """The sum of ``x`` over the thread block (float64, a shared-memory tree), in every thread.
    Called by the whole block (barriers)."""
    buf = cuda.shared.array(1024, float64)
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    buf[tid] = x
    cuda.syncthreads()
    stride = 1
    while stride < n:
        stride <<= 1
    stride >>= 1
    while stride > 0:
        if tid < stride and tid + stride < n:
            buf[tid] += buf[tid + stride]
        cuda.syncthreads()
        stride >>= 1
    r = buf[0]
    cuda.syncthreads()  # buf is reused by the next call
    return r


_NO_ACC = np.zeros((2, 1), np.float64)  # the pointwise steps' stand-in for LAMB's sums


# ------------------------------------------------------------------ LAMB's gradient norm


def make_lamb_grad_kernel(grad_dtype: str):
    """``grad_norm(chunks, ptrs, nchunks, acc, ntensors, found, q, sc)``: ``acc[q, 2 * ntensors]`` +=
    the sum of g^2 over the model, each gradient decoded as stored and widened to float64 before
    squaring (global clipping, then :func:`lamb_grad_scale` in the passes). ``sc`` is unused."""
    size = ITEMSIZE[grad_dtype]
    kind = {"float32": F32, "bfloat16": BF16, "float16": F16}[grad_dtype]

    def grad_norm(chunks, ptrs, nchunks, acc, ntensors, found, q, sc):
        if found != 0:
            if ld_u32(found) != 0:
                return
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        c = cuda.blockIdx.x
        while c < nchunks:
            s = 0.0
            n = chunks[c, 2]
            ga = ptrs[chunks[c, 0], 1] + chunks[c, 1] * size
            i = tid
            while i < n:
                w = ld_u16(ga + i * 2) if size == 2 else ld_u32(ga + i * 4)
                g = float64(decode_value(w, kind))
                s += g * g
                i += nthreads
            s = _block_sum(s)
            if tid == 0:
                cuda.atomic.add(acc, (q, 2 * ntensors), s)
            c += cuda.gridDim.x

    grad_norm.__name__ = grad_norm.__qualname__ = f"formats_lamb_grad_norm_{grad_dtype}"
    return grad_norm


# ------------------------------------------------------------------ the non-finite check


def make_check_kernel(grad_dtype: str):
    """``check(chunks, ptrs, nchunks, (flag,))``: ``*flag`` (an int32 at that address) = 1 when any
    gradient is inf or NaN; reads the gradients only, 16 bytes per lane per load where aligned."""
    size = ITEMSIZE[grad_dtype]
    mask = EXP_MASK[grad_dtype]
    half = size == 2

    def bad_word(w):
        if half:
            return (w & mask) == mask or ((w >> 16) & mask) == mask
        return (w & mask) == mask

    bad_word = _device(bad_word)

    def check(chunks, ptrs, nchunks, extra):
        flag = extra[0]
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        bad = False
        c = cuda.blockIdx.x
        while c < nchunks:
            n = chunks[c, 2]
            ga = ptrs[chunks[c, 0], 1] + chunks[c, 1] * size
            per_vec = 16 // size
            nvec = n // per_vec if (ga & 15) == 0 else 0
            k = tid
            while k < nvec:
                w0, w1, w2, w3 = ld_u32x4(ga + (k << 4))
                if bad_word(w0) or bad_word(w1) or bad_word(w2) or bad_word(w3):
                    bad = True
                k += nthreads
            i = nvec * per_vec + tid
            while i < n:
                w = ld_u16(ga + i * 2) if half else ld_u32(ga + i * 4)
                if (w & mask) == mask:
                    bad = True
                i += nthreads
            c += cuda.gridDim.x
        if bad:
            st_u32(flag, 1)  # every writer stores the same value: no atomic needed

    check.__name__ = check.__qualname__ = f"formats_check_{grad_dtype}"
    return check


# ------------------------------------------------------------------ 8 elements per lane

# Every lane moves 8 consecutive elements: one vector access where the chunk is aligned and the
# lane's 8 elements all exist, else one scalar access per existing element. Words come as
# uint32 (float32 bits, 16-bit patterns, bytes), as the shared element code takes them.


@_device
def ld8_32(addr, vec, cnt, out):
    if vec and cnt == LANE32:
        out[0], out[1], out[2], out[3] = ld_u32x4(addr)
        out[4], out[5], out[6], out[7] = ld_u32x4(addr + 16)
    else:
        for j in range(LANE):
            out[j] = ld_u32(addr + 4 * j) if j < cnt else 0


@_device
def st8_32(addr, vec, cnt, w):
    if vec and cnt == LANE32:
        st_u32x4(addr, w[0], w[1], w[2], w[3])
        st_u32x4(addr + 16, w[4], w[5], w[6], w[7])
    else:
        for j in range(LANE):
            if j < cnt:
                st_u32(addr + 4 * j, w[j])


@_device
def _pack8_byte1(a, b, c, d):
    """The bytes 1 of ``a``-``d`` as one word (three ``prmt``)."""
    return pack_low16(_pack_byte1(a, b), _pack_byte1(c, d))


@_device
def _pack8_byte2(a, b, c, d):
    """The bytes 2 of ``a``-``d`` as one word (three ``prmt``)."""
    return pack_low16(_pack_byte2(a, b), _pack_byte2(c, d))


@_device
def _pack8(a, b, c, d):
    """The low bytes of ``a``-``d`` as one word (``a``'s lowest): three ``prmt``, whatever the inputs'
    higher bits (codes and remainders are stored without masking them first)."""
    return pack_low16(_pack_low8(a, b), _pack_low8(c, d))


@_device
def ld8_16(addr, vec, cnt, out, wide):
    """8 16-bit words; ``wide``: each in the high half of its word (a bfloat16 value widened to float32)."""
    if vec and cnt == LANE32:
        unpack8((ld_u32x4(addr), _ZERO4), 2, out, wide)
    else:
        for j in range(LANE):
            h = ld_u16(addr + 2 * j) if j < cnt else u32(0)
            out[j] = shl32(h, 16) if wide else h


@_device
def st8_16(addr, vec, cnt, w, wide):
    """8 16-bit words; ``wide``: each in the high half of its word, the low half undefined."""
    if vec and cnt == LANE32:
        if wide:
            st_u32x4(addr, pack_high16(w[0], w[1]), pack_high16(w[2], w[3]), pack_high16(w[4], w[5]),
                     pack_high16(w[6], w[7]))
        else:
            st_u32x4(addr, pack_low16(w[0], w[1]), pack_low16(w[2], w[3]), pack_low16(w[4], w[5]),
                     pack_low16(w[6], w[7]))
    else:
        for j in range(LANE):
            if j < cnt:
                st_u16(addr + 2 * j, shr32(w[j], 16) if wide else w[j])


@_device
def _pack_pairs(w):
    """The high halves of the 8 words ``w`` packed in pairs into ``w[0]``-``w[3]`` (``pack_high16``)."""
    for k in range(LANE // 2):
        w[k] = pack_high16(w[2 * k], w[2 * k + 1])


@_device
def _st_pairs_high(addr, w):
    """The high halves of the 8 words ``w`` as one 16-byte store (``pack_high16``)."""
    st_u32x4(addr, pack_high16(w[0], w[1]), pack_high16(w[2], w[3]), pack_high16(w[4], w[5]),
             pack_high16(w[6], w[7]))


@_device
def st8_16_pairs(addr, vec, cnt, w):
    """8 16-bit words packed in pairs in ``w[0]``-``w[3]`` (element 2k in the low half of ``w[k]``)."""
    if vec and cnt == LANE32:
        st_u32x4(addr, w[0], w[1], w[2], w[3])
    else:
        for j in range(LANE):
            if j < cnt:
                st_u16(addr + 2 * j, shr32(w[j >> 1], 16) if (j & 1) == 1 else w[j >> 1])


@_device
def ld8_8(addr, vec, cnt, out):
    if vec and cnt == LANE32:
        a, b = ld_u32x2(addr)
        out[0], out[1], out[2], out[3] = _byte0(a, _Z32), _byte1(a, _Z32), _byte2(a, _Z32), shr32(a, 24)
        out[4], out[5], out[6], out[7] = _byte0(b, _Z32), _byte1(b, _Z32), _byte2(b, _Z32), shr32(b, 24)
    else:
        for j in range(LANE):
            out[j] = ld_u8(addr + j) if j < cnt else 0


@_device
def st8_8_byte2(addr, vec, cnt, w):
    """:func:`st8_8` of the bytes 2 of the words ``w`` (packed quantizer codes)."""
    if vec and cnt == LANE32:
        st_u32x2(addr, _pack8_byte2(w[0], w[1], w[2], w[3]), _pack8_byte2(w[4], w[5], w[6], w[7]))
    else:
        for j in range(LANE):
            if j < cnt:
                st_u8(addr + j, shr32(w[j], 16))


@_device
def st8_8_byte1(addr, vec, cnt, w):
    """:func:`st8_8` of the bytes 1 of the words ``w`` (remainder8 master words)."""
    if vec and cnt == LANE32:
        st_u32x2(addr, _pack8_byte1(w[0], w[1], w[2], w[3]), _pack8_byte1(w[4], w[5], w[6], w[7]))
    else:
        for j in range(LANE):
            if j < cnt:
                st_u8(addr + j, shr32(w[j], 8))


@_device
def st8_8(addr, vec, cnt, w):
    if vec and cnt == LANE32:
        st_u32x2(addr, _pack8(w[0], w[1], w[2], w[3]), _pack8(w[4], w[5], w[6], w[7]))
    else:
        for j in range(LANE):
            if j < cnt:
                st_u8(addr + j, w[j])


# The vector path of a round in two halves: every load first (raw words, two 16-byte halves whatever
# the element size), then the unpacking. A load whose words are used before the next load is issued
# exposes its whole latency: ncu put 38% of the bf16-state kernel's stall samples on the first use
# of each of its four loads when each array was loaded and unpacked in turn (make_step_kernel's
# ``batch`` says where this is used).

_ZERO4 = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))


@_device
def raw8(addr, size):
    """The raw words of a lane's 8 elements of ``size`` bytes (8 bytes: two words, 16: four, 32: eight)."""
    if size == 4:
        return ld_u32x4(addr), ld_u32x4(addr + 16)
    if size == 2:
        return ld_u32x4(addr), _ZERO4
    a, b = ld_u32x2(addr)
    return (a, b, np.uint32(0), np.uint32(0)), _ZERO4


@_device
def unpack8(raw, size, out, wide):
    """``raw8``'s words as the 8 elements' words (uint32) in ``out``; ``wide`` (16-bit elements): each
    in the high half of its word, a bfloat16 value's float32 bits (one instruction per element, where
    unpacking and then shifting took two)."""
    lo, hi = raw
    if size == 4:
        out[0], out[1], out[2], out[3] = lo
        out[4], out[5], out[6], out[7] = hi
    elif size == 2 and wide:
        w0, w1, w2, w3 = lo
        out[0], out[1], out[2], out[3] = shl32(w0, 16), and32(w0, 0xFFFF0000), shl32(w1, 16), and32(w1, 0xFFFF0000)
        out[4], out[5], out[6], out[7] = shl32(w2, 16), and32(w2, 0xFFFF0000), shl32(w3, 16), and32(w3, 0xFFFF0000)
    elif size == 2:
        w0, w1, w2, w3 = lo
        out[0], out[1], out[2], out[3] = and32(w0, 0xFFFF), shr32(w0, 16), and32(w1, 0xFFFF), shr32(w1, 16)
        out[4], out[5], out[6], out[7] = and32(w2, 0xFFFF), shr32(w2, 16), and32(w3, 0xFFFF), shr32(w3, 16)
    else:
        a, b, _, _ = lo
        out[0], out[1], out[2], out[3] = _byte0(a, _Z32), _byte1(a, _Z32), _byte2(a, _Z32), shr32(a, 24)
        out[4], out[5], out[6], out[7] = _byte0(b, _Z32), _byte1(b, _Z32), _byte2(b, _Z32), shr32(b, 24)


@_device
def unpack8_remainders(raw, size, out):
    """``raw8``'s remainder words (int16 halves or int8 bytes) as ``formats.remainder_word``'s words."""
    lo, _ = raw
    if size == 2:
        w0, w1, w2, w3 = lo
        out[0], out[1] = _sext_lo16(w0, _Z32), _sext_hi16(w0, _Z32)
        out[2], out[3] = _sext_lo16(w1, _Z32), _sext_hi16(w1, _Z32)
        out[4], out[5] = _sext_lo16(w2, _Z32), _sext_hi16(w2, _Z32)
        out[6], out[7] = _sext_lo16(w3, _Z32), _sext_hi16(w3, _Z32)
    else:
        a, b, _, _ = lo
        out[0], out[1], out[2], out[3] = _rem8_0(a, _Z32), _rem8_1(a, _Z32), _rem8_2(a, _Z32), _rem8_3(a, _Z32)
        out[4], out[5], out[6], out[7] = _rem8_0(b, _Z32), _rem8_1(b, _Z32), _rem8_2(b, _Z32), _rem8_3(b, _Z32)


# ------------------------------------------------------------------ the pointwise format step


# _widen16: the kernels widen bfloat16 gradients, state words and parameters that are their own master
# (or a float32 master's first value) as they unpack them, each half moved to the high half of its
# word (one instruction), without the shared decode's NaN quieting (4 instructions of about 130 per
# element, each). The same bits are stored: every value so widened
# meets float arithmetic, min / max or comparisons before anything is stored (every family's new
# parameter is computed from the old one), and on the GPU a NaN result of arithmetic is the
# canonical NaN whatever the NaN that went in (min and max return the other operand), or it meets
# an encoder that writes NaN as its own quiet NaN with the sign kept, as the quieting does.


@_device
def _remainder(w, master):
    """A remainder word as the signed int32 the shared code takes (int16 or int8, two's complement)."""
    if master == MASTER_R16:
        return np.int32(np.int16(w))
    return np.int32(np.int8(w))


def full_group_rounds(fc, family: str) -> bool:
    """Whether the step kernel of ``family`` in format codes ``fc`` takes a chunk's full groups by a
    round compiled for them (make_step_kernel's ``make_round``): bfloat16 parameters with square-root
    codes, where AdamW's kernel took 6-9% less time with it at 72 registers on the H200 (remainder8,
    stochastic rounding; docs/benchmarks.md, 2026-12-05 02:10-02:18 UTC). The kernels with float32
    parameters or the dynamic map took 9-14% more with it at 64 registers and 5-7% more at 72, so
    they keep the general round alone; LAMB's passes too (not measured)."""
    return fc.state == STATE_INT8_SQRT and fc.param == BF16 and family != "lamb"


def step_kernel_signature(sc) -> tuple:
    """The argument types of :func:`make_step_kernel`'s step kernel (mode "step") for the family
    scalars ``sc``: what ``numba.cuda.compile_ptx`` needs to compile it without a launch (a GPU's
    PTX on a machine without one)."""
    from numba import types, typeof

    table = types.int64[:, ::1]
    return (table, table, table, types.int64, types.float32[:, ::1], types.uint8[:, ::1], types.int64,
            types.UniTuple(types.int64, 9), types.int64, types.int64, types.int64, typeof(sc))


def claim_chunks() -> bool:
    """Whether the pointwise step kernels take their chunks from a counter (the chunk table's row
    after the chunks), as the OpenCL program does, instead of every grid-th chunk: yes, unless
    ``OPTIRS_CUDA_FORMATS_CLAIM=0`` (to measure the static dealing; read once per context). On the
    H100 the claimed 2048-element chunks took 3-13% less kernel time than static 16384-element
    ones on GPT-2 1.3B shapes and, on 124M, 2-8% less (the stochastic-rounding one-byte rows up to
    3% more), with the same bytes (docs/benchmarks.md, 2026-12-06)."""
    import os

    return os.environ.get("OPTIRS_CUDA_FORMATS_CLAIM", "").strip() != "0"


def approx_steps() -> bool:
    """Whether the pointwise step kernels take Adam's root and quotient by the approximate operations
    (``OPTIRS_CUDA_FORMATS_APPROX=1``, a tuning build; read once per context)."""
    import os

    return os.environ.get("OPTIRS_CUDA_FORMATS_APPROX", "").strip() == "1"


def make_step_kernel(family: str, fc, signed, used: int, mode: str = "step", hot: bool = False,
                     claim: bool = True, approx: bool = False):
    """The one-launch step of pointwise ``family`` in format ``fc`` (a FormatCodes, compiled in as
    constants); ``signed[k]``: state slot k takes the signed map (int8); bit k of ``used``: state
    slot k exists (compiled in as well: an unused slot takes no registers).

    Arguments: ``(chunks, ptrs, tensors, nchunks, maps, tables, master, slots, found, seed, step,
    sc)``: the chunk, pointer and formats tensor tables; ``maps`` float32[4, 256] (signed q, signed
    mid, unsigned q, unsigned mid, each mid padded with +inf), ``tables`` uint8[2, TABLE_SIZE] their
    bucket tables (signed, unsigned; :mod:`optirs.backends.common.int8_buckets`); ``master`` the master buffer's address
    (0: none); ``slots`` the 9 addresses (values or codes of slots 0-2, their scales, their small
    state); ``found`` the found_inf word's address (0: none).

    ``mode`` "lamb_norms" / "lamb_apply": LAMB's two passes (family "lamb", slots exp_avg and
    exp_avg_sq), with ``acc, ntensors`` after ``slots`` and the parity ``q`` after ``step``:
    ``acc`` float64[2, 2 * ntensors + 1] holds per tensor the sums of p^2 (row q, column t) and
    u^2 (column ntensors + t) and the gradients' sum of squares (column 2 * ntensors, from
    :func:`make_lamb_grad_kernel`). The norms pass writes nothing else; the apply pass takes the
    trust ratios from them, writes parameters, masters and moments, and zeroes row 1 - q for the
    next step (also when found_inf skips the step, so a skipped step leaves both rows zero).

    ``claim`` (pointwise steps, :func:`claim_chunks`): each block takes its next chunk from the
    counter in the chunk table's last row (thread 0 takes the one after while the block runs the
    current one); the last block to finish sets the row back to zero, so that the next launch, a
    replayed graph's too, starts from zero. Without it (and in LAMB's passes, whose per-tensor sums
    keep the float32 step's order) each block takes every grid-th chunk.

    ``approx`` (:func:`approx_steps`, a tuning build): Adam's fast path by the approximate root and
    quotient (``APPROX_ELEMENT_STEPS``); the windows, the fallback and the encodings as without it.

    ``hot``: a measurement build, never launched (benchmarks/cuda_sass_rounds.py --hot): every round
    the full one and every tensor coded, so that the round loop holds a full round alone and its
    static shortest path is what a round issues where every fast path holds.
    """
    lamb = mode != "step"
    apply = mode == "lamb_apply"
    writes = mode != "lamb_norms"
    psize = 2 if fc.param != F32 else 4
    gsize = 2 if fc.grad != F32 else 4
    master = fc.master
    msize = {MASTER_NONE: 0, MASTER_F32: 4, MASTER_R16: 2, MASTER_R8: 1}[master]
    state = fc.state
    ssize = {STATE_F32: 4, STATE_BF16: 2, STATE_INT8: 1, STATE_INT8_SQRT: 1, STATE_FP8: 1}[state]
    int8 = state in INT8_STATE_CODES
    # the square-root codes: the int8 blocks coded by arithmetic (no maps in shared memory)
    sqrt_codes = state == STATE_INT8_SQRT
    # the float8 state: int8 blocks of float8 codes (no maps either), kept as the lane's two words of
    # 4 codes from load to store (the conversions take and give pairs: no byte unpacked or packed)
    fp8 = state == STATE_FP8
    # Compact state leaves the kernel bound by latency and instructions: there all of a round's loads
    # go first (-4 to -10% of kernel time on the H200). Float32 state keeps it bound by DRAM, where
    # loading and unpacking each array in turn measured 7% faster (bf16 + float32 masters).
    batch = state != STATE_F32
    # bfloat16 gradients reach the element step widened here, as float32 bits (_widen16's reason)
    widen_grad = fc.grad == BF16
    # a remainder master: its bfloat16 half widened as well, the master the sum of that word and the
    # remainder's (load_master_wide), stored from store_master_wide's words without masking
    wide_rem = fc.param == BF16 and master in (MASTER_R16, MASTER_R8)
    widen_param = fc.param == BF16 and master in (MASTER_NONE, MASTER_F32) or wide_rem
    sg0, sg1, sg2 = (bool(s) for s in tuple(signed) + (True,) * (3 - len(signed)))
    u0, u1, u2 = bool(used & 1), bool(used & 2), bool(used & 4)
    # a family with a fast-path element step (optirs.backends.common.elementwise.FAST_ELEMENT_STEPS)
    # takes it first; the others compile the exact pass only
    fast_setup, fast_step, windows_ok, w_start = (APPROX_ELEMENT_STEPS if approx else FAST_ELEMENT_STEPS).get(
        family, (_no_fast_setup, _no_fast_step, _no_windows_ok, (np.uint32(0),)))
    # the windows tested once a round (their words accumulated by maximum) in the int8 kernels: 1-2
    # instructions an element fewer at their cap of 64 registers (static SASS). The others test each
    # element, so that the uncapped bfloat16-state kernels keep their registers (ptxas 13 gave nearest
    # + bf16 state 96 registers for the round's test, 72 for the element's)
    windows_once = int8
    fast = family in FAST_ELEMENT_STEPS and not lamb
    # bfloat16 state: each path of a round encodes its own new values (random bits drawn there), the
    # fast one without a NaN test (its flag says none is NaN); the stores only pack
    bf16_state = state == STATE_BF16
    # a bfloat16 parameter that is its own master or has a float32 master: the fast path tests the new
    # master for NaN, folded into its flag, and encodes it without the NaN test
    param_num = fc.param == BF16 and master in (MASTER_NONE, MASTER_F32)
    # ... and both paths leave it packed in pairs, pw[k] holding elements 2k and 2k + 1: the fast path
    # rounding to nearest packs by cvt.rn.bf16x2.f32 (cvt_pack_bf16), the others by pack_high16
    param_nearest = param_num and not (master == MASTER_NONE and fc.stochastic)
    # bfloat16 state with a parameter stored as packed pairs or float32 words and no master or a
    # float32 one: a full vector lane's stores take one branch (below)
    one_branch = bf16_state and writes and (param_num or psize == 4) and msize in (0, 4)

    def decode_slot(usedk, quant, sz, w, x, scale, q_s, q_u, sgk):
        """A slot's values of the lane's 8 elements into ``x`` (:func:`_decode_state`; the square-root
        codes by :func:`_decode_sqrt`, float8 codes by :func:`_decode_fp8`)."""
        if sqrt_codes and quant:
            _decode_sqrt(usedk, w, x, scale, sgk)
        elif fp8 and quant:
            _decode_fp8(usedk, w, x, scale)
        else:
            _decode_state(usedk, quant, sz, w, x, scale, q_s if sgk else q_u)

    decode_slot = _device(decode_slot)

    def load_round(pa, ga, ma, sa0, sa1, sa2, ca0, ca1, ca2, base, cnt, vec, quant, live, grp, sz, pw, gw, mw, w0,
                   w1, w2, x0, x1, x2, q_s, q_u):
        """A round's loads and decoding: the lane's words into ``pw``, ``gw``, ``mw``, ``w0``-``w2`` and the
        state as float32 into ``x0``-``x2``; returns the int8 blocks' scales (0 where unused)."""
        sc0 = sc1 = sc2 = float32(0)
        if quant and live:
            if u0:
                sc0 = ld(ca0 + grp * 4)
            if u1:
                sc1 = ld(ca1 + grp * 4)
            if u2:
                sc2 = ld(ca2 + grp * 4)
        # every load of the round, then the words. The state's element size is the format's:
        # a small int8 tensor's float32 state takes the path below, so these loads and their
        # unpacking are not compiled for both sizes and predicated (which held 117 registers
        # in the int8 kernels, 79 without)
        if batch and vec and cnt == LANE32 and (quant or not int8):
            rp = raw8(pa + base * psize, psize)
            rg = raw8(ga + base * gsize, gsize)
            rm = raw8(ma + base * msize, msize) if msize != 0 else (_ZERO4, _ZERO4)
            r0 = raw8(sa0 + base * ssize, ssize) if u0 else (_ZERO4, _ZERO4)
            r1 = raw8(sa1 + base * ssize, ssize) if u1 else (_ZERO4, _ZERO4)
            r2 = raw8(sa2 + base * ssize, ssize) if u2 else (_ZERO4, _ZERO4)
            unpack8(rp, psize, pw, widen_param)
            unpack8(rg, gsize, gw, widen_grad)
            if wide_rem:
                unpack8_remainders(rm, msize, mw)
            elif msize != 0:
                unpack8(rm, msize, mw, False)
            if fp8:  # the codes' two words as loaded
                w0[0], w0[1] = r0[0][0], r0[0][1]
                w1[0], w1[1] = r1[0][0], r1[0][1]
                w2[0], w2[1] = r2[0][0], r2[0][1]
            else:
                if u0:
                    unpack8(r0, ssize, w0, True)
                if u1:
                    unpack8(r1, ssize, w1, True)
                if u2:
                    unpack8(r2, ssize, w2, True)
            if int8:
                # quant holds here: the codes decoded in this branch, where a test of quant per slot
                # below took a uniform branch each (about 3 instructions a round)
                decode_slot(u0, True, 1, w0, x0, sc0, q_s, q_u, sg0)
                decode_slot(u1, True, 1, w1, x1, sc1, q_s, q_u, sg1)
                decode_slot(u2, True, 1, w2, x2, sc2, q_s, q_u, sg2)
                return sc0, sc1, sc2
        else:
            if psize == 2:
                ld8_16(pa + base * 2, vec, cnt, pw, widen_param)
            else:
                ld8_32(pa + base * 4, vec, cnt, pw)
            if gsize == 2:
                ld8_16(ga + base * 2, vec, cnt, gw, widen_grad)
            else:
                ld8_32(ga + base * 4, vec, cnt, gw)
            if msize == 4:
                ld8_32(ma + base * 4, vec, cnt, mw)
            elif msize == 2:
                ld8_16(ma + base * 2, vec, cnt, mw, False)
            elif msize == 1:
                ld8_8(ma + base, vec, cnt, mw)
            if wide_rem:
                for j in range(LANE):
                    mw[j] = remainder_word(mw[j], master)
            if fp8 and quant:
                _load_code_words(u0, sa0 + base, vec, cnt, w0)
                _load_code_words(u1, sa1 + base, vec, cnt, w1)
                _load_code_words(u2, sa2 + base, vec, cnt, w2)
            else:
                _load_words(u0, sz, sa0 + base * sz, vec, cnt, w0)
                _load_words(u1, sz, sa1 + base * sz, vec, cnt, w1)
                _load_words(u2, sz, sa2 + base * sz, vec, cnt, w2)
        # the state as float32
        decode_slot(u0, quant, sz, w0, x0, sc0, q_s, q_u, sg0)
        decode_slot(u1, quant, sz, w1, x1, sc1, q_s, q_u, sg1)
        decode_slot(u2, quant, sz, w2, x2, sc2, q_s, q_u, sg2)
        return sc0, sc1, sc2

    load_round = _device(load_round)

    def element_inputs(j, pw, gw, mw):
        """Element ``j``'s (parameter or master, gradient) as float32 from the lane's words."""
        mraw = mw[j]
        if msize == 0:
            mraw = np.uint32(0)
        elif msize != 4 and not wide_rem:  # a remainder master's words come as remainder_word's
            mraw = _remainder(mraw, master)
        # widened as unpacked (_widen16's reason); a float32 master word of 0 is read from the
        # parameter. float32(): numba's simulator hands the shared functions Python floats
        g = float32(bits_f32(gw[j]) if widen_grad else decode_value(gw[j], fc.grad))
        if wide_rem:
            xp = float32(load_master_wide(pw[j], mraw))
        elif widen_param:
            xp = float32(bits_f32(pw[j]))
            if master == MASTER_F32 and mraw != 0:
                xp = float32(bits_f32(mraw))
        else:
            xp = float32(load_master(pw[j], mraw, fc))
        return xp, g

    element_inputs = _device(element_inputs)

    def fast_elements(pw, gw, mw, w0, w1, w2, x0, x1, x2, e, keyp, key01, key2, sc, u, ok):
        """The lane's 8 element steps by the family's fast variant, results written as the exact pass
        writes them (bfloat16 state already encoded, into ``w0``-``w2``); returns ``ok`` and-ed with every
        element's windows (true: all 8 results are the exact ones)."""
        w = w_start
        for j in range(LANE):
            xp, g = element_inputs(j, pw, gw, mw)
            if not windows_once:
                w = w_start
            if u2:
                xn, a, b, d, w = fast_step(xp, g, x0[j], x1[j], x2[j], sc, u, w)
            else:  # no third slot (Adam without amsgrad): the step compiles without its maximum
                xn, a, b, d, w = fast_step(xp, g, x0[j], x1[j], None, sc, u, w)
            okj = True if windows_once else windows_ok(w)
            ij = add32(e, j)
            if param_num:
                ok = ok & okj & (xn == xn)
                pw[j] = f32_bits(xn) if param_nearest else param_word_wide_num(xn, fc, keyp, ij)
                mw[j] = f32_bits(xn) if master == MASTER_F32 else np.uint32(0)
            elif wide_rem:
                # the new master tested for NaN in the flag (one predicate an element), so that
                # neither round24_word's exponent test nor the quiet NaN's select is paid (three
                # instructions an element each; store_master_wide_num)
                ok = ok & okj & (xn == xn)
                p_, m_ = store_master_wide_num(xn, fc, keyp, ij)
                pw[j] = p_
                mw[j] = m_
            else:
                ok = ok & okj
                p_, m_ = _store_param(xn, fc, keyp, ij, widen_param)
                pw[j] = p_
                mw[j] = m_
            if bf16_state:
                # no new state value is NaN where the flag holds (FAST_ELEMENT_STEPS)
                if u0 or u1:
                    r = rand32(key01, ij)
                    if u0:
                        w0[j] = bf16_stochastic_wide_num(a, slot_bits(r, 0))
                    if u1:
                        w1[j] = bf16_stochastic_wide_num(b, slot_bits(r, 1))
                if u2:
                    w2[j] = bf16_stochastic_wide_num(d, rand32(key2, ij))
            else:
                x0[j] = a
                x1[j] = b
                x2[j] = d
        if windows_once:
            ok = ok & windows_ok(w)
        if param_nearest:
            for k in range(LANE // 2):
                pw[k] = cvt_pack_bf16(bits_f32(pw[2 * k]), bits_f32(pw[2 * k + 1]))
        elif param_num:
            _pack_pairs(pw)
        return ok

    fast_elements = _device(fast_elements)

    def make_round(full):
        """One round of a warp's group (256 elements, 8 a lane): its loads, element steps, int8 scales and
        stores; returns the LAMB sums ``(sp, su)`` with the lane's terms added. ``full``: the round of
        a group whose every lane holds 8 elements on vector-aligned addresses, compiled with that
        count, alignment and liveness as constants (the loads', stores' and absmax's tests of a lane's
        count fold away, where the H200's ptxas kept each test's predicate in a register's bits: about
        9 instructions an element, ncu); otherwise the general round, whose lanes may hold fewer."""

        def one_round(pa, ga, ma, sa0, sa1, sa2, ca0, ca1, ca2, base, cnt, vec, quant, live, grp, sz, e, lane, pw, gw,
                      mw, w0, w1, w2, x0, x1, x2, q_s, q_u, mid_s, tb_s, pk_u, keyp, key01, key2, sc, fu, fok,
                      grad_scale, lr_t, sp, su):
            if full:
                cnt = LANE32
                vec = True
                live = True
            sc0, sc1, sc2 = load_round(pa, ga, ma, sa0, sa1, sa2, ca0, ca1, ca2, base, cnt, vec, quant, live, grp, sz,
                                       pw, gw, mw, w0, w1, w2, x0, x1, x2, q_s, q_u)
            # the element steps, on all 8 lanes' words whether they exist or not (the loads gave 0
            # past the end, and nothing is stored or summed there): no branch per element
            exact = True
            if fast:
                # the fast paths' square roots and divisions, one flag for the 8 elements; where it is
                # false the round is loaded again (the pass overwrote its words) and taken exactly
                if fast_elements(pw, gw, mw, w0, w1, w2, x0, x1, x2, e, keyp, key01, key2, sc, fu, fok):
                    exact = False
                else:
                    sc0, sc1, sc2 = load_round(pa, ga, ma, sa0, sa1, sa2, ca0, ca1, ca2, base, cnt, vec, quant, live,
                                               grp, sz, pw, gw, mw, w0, w1, w2, x0, x1, x2, q_s, q_u)
            if exact:
                for j in range(LANE):
                    xp, g = element_inputs(j, pw, gw, mw)
                    ij = add32(e, j)
                    if lamb:
                        xp, a, b, u = lamb_format_update(xp, g, x0[j], x1[j], grad_scale, sc)
                        if apply:
                            p_, m_ = _store_param(xp - lr_t * u, fc, keyp, ij, widen_param)
                            pw[j] = p_
                            mw[j] = m_
                            x0[j] = a
                            x1[j] = b
                        elif j < cnt:
                            sp += float64(xp) * float64(xp)
                            su += float64(u) * float64(u)
                    else:
                        xn, a, b, d = element_update(xp, g, x0[j], x1[j], x2[j], sc)
                        p_, m_ = _store_param(xn, fc, keyp, ij, widen_param)
                        pw[j] = p_
                        mw[j] = m_
                        x0[j] = a
                        x1[j] = b
                        x2[j] = d
                if writes and bf16_state:
                    _encode_bf16(u0, u1, u2, w0, w1, w2, x0, x1, x2, key01, key2, e)
                if writes and param_num:
                    _pack_pairs(pw)
            if not writes:
                return sp, su
            # int8: each slot's block scale is the absmax of its new values, over the warp
            if quant:
                if u0:
                    sc0 = warp_max(_lane_absmax(x0, cnt))
                if u1:
                    sc1 = warp_max(_lane_absmax(x1, cnt))
                if u2:
                    sc2 = warp_max(_lane_absmax(x2, cnt))
                if live and lane == 0:
                    if u0:
                        st(ca0 + grp * 4, sc0)
                    if u1:
                        st(ca1 + grp * 4, sc1)
                    if u2:
                        st(ca2 + grp * 4, sc2)
            # a full vector lane of a bfloat16-state round: every store under one branch, where each
            # array's own test and branch region cost about 6 instructions a round
            if one_branch and vec and cnt == LANE32:
                if param_num:
                    st_u32x4(pa + base * 2, pw[0], pw[1], pw[2], pw[3])
                else:
                    st_u32x4(pa + base * 4, pw[0], pw[1], pw[2], pw[3])
                    st_u32x4(pa + base * 4 + 16, pw[4], pw[5], pw[6], pw[7])
                if msize == 4:
                    st_u32x4(ma + base * 4, mw[0], mw[1], mw[2], mw[3])
                    st_u32x4(ma + base * 4 + 16, mw[4], mw[5], mw[6], mw[7])
                if u0:
                    _st_pairs_high(sa0 + base * 2, w0)
                if u1:
                    _st_pairs_high(sa1 + base * 2, w1)
                if u2:
                    _st_pairs_high(sa2 + base * 2, w2)
                return sp, su
            # stores
            if param_num:
                st8_16_pairs(pa + base * 2, vec, cnt, pw)
            elif psize == 2:
                st8_16(pa + base * 2, vec, cnt, pw, widen_param)
            else:
                st8_32(pa + base * 4, vec, cnt, pw)
            if msize == 4:
                st8_32(ma + base * 4, vec, cnt, mw)
            elif msize == 2:
                st8_16(ma + base * 2, vec, cnt, mw, False)
            elif msize == 1:
                if wide_rem:
                    st8_8_byte1(ma + base, vec, cnt, mw)  # the remainder in byte 1 (store_master_wide)
                else:
                    st8_8(ma + base, vec, cnt, mw)
            if sqrt_codes:
                _store_state_sqrt(u0, quant, sz, sa0 + base * sz, vec, cnt, w0, x0, sc0, sg0)
                _store_state_sqrt(u1, quant, sz, sa1 + base * sz, vec, cnt, w1, x1, sc1, sg1)
                _store_state_sqrt(u2, quant, sz, sa2 + base * sz, vec, cnt, w2, x2, sc2, sg2)
                return sp, su
            if fp8:
                _store_state_fp8(u0, quant, sz, sa0 + base * sz, vec, cnt, w0, x0, sc0)
                _store_state_fp8(u1, quant, sz, sa1 + base * sz, vec, cnt, w1, x1, sc1)
                _store_state_fp8(u2, quant, sz, sa2 + base * sz, vec, cnt, w2, x2, sc2)
                return sp, su
            # the signed map by its bucket table and midpoints, the unsigned by its packed words
            if sg0:
                _store_state(u0, quant, sz, sa0 + base * sz, vec, cnt, w0, x0, sc0, mid_s, tb_s)
            else:
                _store_state_packed(u0, quant, sz, sa0 + base * sz, vec, cnt, w0, x0, sc0, pk_u)
            if sg1:
                _store_state(u1, quant, sz, sa1 + base * sz, vec, cnt, w1, x1, sc1, mid_s, tb_s)
            else:
                _store_state_packed(u1, quant, sz, sa1 + base * sz, vec, cnt, w1, x1, sc1, pk_u)
            if sg2:
                _store_state(u2, quant, sz, sa2 + base * sz, vec, cnt, w2, x2, sc2, mid_s, tb_s)
            else:
                _store_state_packed(u2, quant, sz, sa2 + base * sz, vec, cnt, w2, x2, sc2, pk_u)
            return sp, su

        return _device(one_round)

    dealt = claim and not lamb
    full_rounds = hot or full_group_rounds(fc, family)
    full_round = make_round(True) if full_rounds else None
    part_round = make_round(False)

    def body(chunks, ptrs, tensors, nchunks, maps, tables, maddr, slots, acc, ntensors, found, seed, step, q,
             sc):
        if apply:
            j = cuda.grid(1)
            while j < 2 * ntensors + 1:
                acc[1 - q, j] = 0.0
                j += cuda.gridDim.x * cuda.blockDim.x
        if found != 0:
            if ld_u32(found) != 0:
                return  # uniform: the whole step is skipped
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        lane = u32(tid & 31)
        warp = u32(tid >> 5)
        nwarps = u32(nthreads >> 5)
        q_s = cuda.shared.array(256, float32)
        mid_s = cuda.shared.array(256, float32)
        q_u = cuda.shared.array(256, float32)
        tb_s = cuda.shared.array(TABLE_SIZE, uint8)
        pk_u = cuda.shared.array(TABLE_WIDTH, uint32)  # the unsigned map's packed words (its mid and table)
        if int8 and not sqrt_codes and not fp8:
            i = tid
            while i < 256:
                q_s[i] = maps[0, i]
                mid_s[i] = maps[1, i]
                q_u[i] = maps[2, i]
                i += nthreads
            i = tid
            while i < TABLE_SIZE:
                tb_s[i] = tables[0, i]
                if i < TABLE_WIDTH:  # the unsigned map's midpoints are all positive: one half
                    cu = tables[1, i]
                    pk_u[i] = packed_word(i, cu, maps[3, cu])
                i += nthreads
            cuda.syncthreads()
        keyp = stream_key(seed, step, 0)
        key01 = stream_key(seed, step, state_stream(0))
        key2 = stream_key(seed, step, state_stream(2))
        grad_scale = float32(0)
        if lamb:
            raw_norm = 0.0
            if sc.max_grad_norm > 0:
                raw_norm = math.sqrt(acc[q, 2 * ntensors])
            grad_scale = lamb_grad_scale(raw_norm, sc)
        fu = float32(0)
        fok = False
        if fast:
            fu, fok = fast_setup(sc)
            fu = float32(fu)
        pw = cuda.local.array(LANE, uint32)
        gw = cuda.local.array(LANE, uint32)
        mw = cuda.local.array(LANE, uint32)
        w0 = cuda.local.array(LANE, uint32)
        w1 = cuda.local.array(LANE, uint32)
        w2 = cuda.local.array(LANE, uint32)
        x0 = cuda.local.array(LANE, float32)
        x1 = cuda.local.array(LANE, float32)
        x2 = cuda.local.array(LANE, float32)
        c = cuda.blockIdx.x
        claimed = cuda.shared.array(1, int64)
        ahead = int64(0)
        if dealt and tid == 0:
            ahead = cuda.atomic.add(chunks, (nchunks, 0), 1)
        while True:
            if dealt:
                # thread 0's claim taken a chunk ahead, so that the atomic's round trip runs under a chunk
                if tid == 0:
                    claimed[0] = ahead
                    ahead = cuda.atomic.add(chunks, (nchunks, 0), 1)
                cuda.syncthreads()
                c = claimed[0]
                cuda.syncthreads()  # read by every thread before thread 0 writes the next
            if c >= nchunks:
                break
            t = chunks[c, 0]
            start = chunks[c, 1]
            n = chunks[c, 2]
            off = chunks[c, 3] + start  # flat layout index of the chunk's first element
            pa = ptrs[t, 0] + start * psize
            ga = ptrs[t, 1] + start * gsize
            small = tensors[t, 2]
            quant = int8 and (hot or small < 0)  # the same for the whole block (one chunk per block)
            if int8 and not quant:  # a small tensor's float32 state
                sbase = small + start
                sz = 4
            else:
                sbase = off
                sz = ssize
            block0 = tensors[t, 1] + (start >> 8)
            vec = ((pa | ga) & 15) == 0 and (off & 7) == 0
            # the chunk's first element's address in every array: a round adds its 32-bit offset
            # (64-bit index arithmetic per round cost about 2 instructions an element)
            ma = maddr + off * msize
            sa0 = (slots[6] if (int8 and not quant) else slots[0]) + sbase * sz
            sa1 = (slots[7] if (int8 and not quant) else slots[1]) + sbase * sz
            sa2 = (slots[8] if (int8 and not quant) else slots[2]) + sbase * sz
            ca0 = slots[3] + block0 * 4
            ca1 = slots[4] + block0 * 4
            ca2 = slots[5] + block0 * 4
            n32 = u32(n)
            off32 = u32(off)  # the flat index's low 32 bits: all the random bits take
            sp = 0.0
            su = 0.0
            lr_t = float32(0)
            if apply:
                ratio = float32(lamb_trust_ratio(math.sqrt(acc[q, t]), math.sqrt(acc[q, ntensors + t]),
                                                 float64(sc.max_trust_ratio)))
                lr_t = sc.lr * ratio
            ngroups = u32((n + GROUP - 1) >> 8)
            rounds = (ngroups + nwarps - 1) // nwarps
            # a 32-bit range (a chunk has far fewer than 2**31 groups): numba counts a range over
            # the uint32 ``rounds`` in 64 bits, an instruction a round more and 2-4 registers
            for r in range(np.int32(rounds)):
                grp = add32(warp, mul32(r, nwarps))
                base = add32(shl32(grp, 8), shl32(lane, 3))  # the lane's first element in the chunk
                e = add32(off32, base)  # flat index of the lane's first element (low 32 bits)
                # full_rounds: a group whose every lane holds 8 aligned elements (warp-uniform: every
                # group but a chunk's last, where the tensor ends or is misaligned) takes the round
                # compiled for them, with no test of a lane's count anywhere in it
                if full_rounds:
                    if hot or vec and add32(shl32(grp, 8), GROUP32) <= n32:
                        sp, su = full_round(pa, ga, ma, sa0, sa1, sa2, ca0, ca1, ca2, base, LANE32, True, quant, True,
                                            grp, sz, e, lane, pw, gw, mw, w0, w1, w2, x0, x1, x2, q_s, q_u, mid_s, tb_s,
                                            pk_u, keyp, key01, key2, sc, fu, fok, grad_scale, lr_t, sp, su)
                        continue
                cnt = min(sub32(n32, base), LANE32) if n32 > base else u32(0)
                sp, su = part_round(pa, ga, ma, sa0, sa1, sa2, ca0, ca1, ca2, base, cnt, vec, quant, grp < ngroups, grp,
                                    sz, e, lane, pw, gw, mw, w0, w1, w2, x0, x1, x2, q_s, q_u, mid_s, tb_s, pk_u, keyp,
                                    key01, key2, sc, fu, fok, grad_scale, lr_t, sp, su)
            if lamb and not apply:  # the chunk's sums (uniform over the block: every thread reaches it)
                sp = _block_sum(sp)
                su = _block_sum(su)
                if tid == 0:
                    cuda.atomic.add(acc, (q, t), sp)
                    cuda.atomic.add(acc, (q, ntensors + t), su)
            if not dealt:
                c += cuda.gridDim.x
        if dealt and tid == 0:
            cuda.threadfence()  # this block's claims are counted before it says it is done
            if cuda.atomic.add(chunks, (nchunks, 1), 1) == cuda.gridDim.x - 1:
                chunks[nchunks, 0] = 0
                chunks[nchunks, 1] = 0

    if lamb:
        kernel = body
    else:
        def kernel(chunks, ptrs, tensors, nchunks, maps, tables, maddr, slots, found, seed, step, sc):
            body(chunks, ptrs, tensors, nchunks, maps, tables, maddr, slots, _NO_ACC, 0, found, seed, step, 0, sc)

    body.__name__ = body.__qualname__ = f"formats_{mode}_{family}"
    if not lamb:
        body = _device(body)
        kernel.__name__ = kernel.__qualname__ = f"formats_step_{family}"
    return kernel


@_device
def _no_fast_setup(sc):
    return float32(0), False


@_device
def _no_fast_step(p, g, s0, s1, s2, sc, u, w):
    return p, s0, s1, s2, w


@_device
def _no_windows_ok(w):
    return False


@_device
def _store_param(x, fc, key, i, wide):
    """The new master ``x`` as (parameter word, master word); ``wide``: the bfloat16 parameter in the
    word's high half (``store_master_wide``, stored by ``pack_high16``)."""
    if wide:
        return store_master_wide(x, fc, key, i)
    return store_master(x, fc, key, i)


@_device
def _lane_absmax(x, cnt):
    """The largest |x| of the lane's ``cnt`` elements (a lane of 8 without a test per element)."""
    m = float32(0)
    if cnt == LANE32:
        for j in range(LANE):
            m = absmax_step(m, x[j])
    else:
        for j in range(LANE):
            if j < cnt:
                m = absmax_step(m, x[j])
    return m


@_device
def _load_words(usedk, sz, addr, vec, cnt, w):
    """A slot's words of the lane's 8 elements (codes, bfloat16 or float32 bits) into ``w``."""
    if not usedk:
        return
    if sz == 1:
        ld8_8(addr, vec, cnt, w)
    elif sz == 2:
        ld8_16(addr, vec, cnt, w, True)  # bfloat16 state: decoded by the widening alone
    else:
        ld8_32(addr, vec, cnt, w)


@_device
def _decode_state(usedk, quant, sz, w, x, scale, q):
    """Slot values of the lane's 8 elements as float32 into ``x`` from their words (0 for an unused slot)."""
    if not usedk:
        for j in range(LANE):
            x[j] = float32(0)
        return
    if quant:
        for j in range(LANE):
            x[j] = dequantize(w[j], scale, q)
    elif sz == 2:
        for j in range(LANE):
            x[j] = bits_f32(w[j])  # widened by the load (_widen16's reason)
    else:
        for j in range(LANE):
            x[j] = decode_state(w[j], STATE_F32)


@_device
def _store_state(usedk, quant, sz, addr, vec, cnt, w, x, scale, mid, table):
    """A slot's 8 new values of the lane, encoded: int8 codes at ``scale`` (by the map's midpoints
    ``mid`` and bucket ``table``), bfloat16 (the words ``w``, encoded by the round's path), or
    float32."""
    if not usedk:
        return
    if quant:
        # the usual block (a normal scale below 2**126: pre is 1, and the reciprocal is the GPU's fast
        # path, rcp_fast) takes the shorter bucket, which has no upper clamp: only in a lane whose 8
        # elements all exist (past the end, code 0 decodes to -scale in the signed map, and a family's
        # step may turn that into a NaN, or anything, outside the block's scale)
        if cnt == LANE32 and rcp_in_window(float32(scale)):
            inv = float32(rcp_fast(float32(scale)))  # float32(): the simulator passes Python floats
            for j in range(LANE):
                w[j] = quantize_finite(x[j], float32(1), inv, mid, table)
        else:
            pre, inv = quantize_factors(float32(scale))
            pre, inv = float32(pre), float32(inv)
            for j in range(LANE):
                w[j] = quantize(x[j], pre, inv, mid, table)
        st8_8(addr, vec, cnt, w)
    else:
        _store_plain(sz, addr, vec, cnt, w, x)


@_device
def _store_state_packed(usedk, quant, sz, addr, vec, cnt, w, x, scale, packed):
    """:func:`_store_state` for the unsigned map, by its packed words (``quantize_packed``: each code
    in the top 16 bits of its word, stored from there)."""
    if not usedk:
        return
    if quant:
        if cnt == LANE32 and rcp_in_window(float32(scale)):  # _store_state's reasons
            inv = float32(rcp_fast(float32(scale)))
            for j in range(LANE):
                w[j] = quantize_packed_finite(x[j], float32(1), inv, packed)
        else:
            pre, inv = quantize_factors(float32(scale))
            pre, inv = float32(pre), float32(inv)
            for j in range(LANE):
                w[j] = quantize_packed(x[j], pre, inv, packed)
        st8_8_byte2(addr, vec, cnt, w)
    else:
        _store_plain(sz, addr, vec, cnt, w, x)


_N = tuple(np.float32(sqrt_levels(signed)) for signed in (False, True))  # the largest code
_N2 = tuple(n * n for n in _N)  # the largest code squared


@_device
def _decode_sqrt(usedk, w, x, scale, signed):
    """A slot's square-root codes of the lane's 8 elements (bytes, one to a word) as float32 into ``x``:
    ``(c * |c|) * w``, ``w`` once per block (``sqrt_decode_factor``); a usual block's values by
    ``sqrt_value_fma`` (2 instructions an unsigned value, 3 a signed one), the others' by
    ``sqrt_value_byte``."""
    if not usedk:
        for j in range(LANE):
            x[j] = float32(0)
        return
    s = float32(scale)
    f = float32(sqrt_decode_factor(s, _N2[1] if signed else _N2[0]))
    if dividend_in_window(s):  # sqrt_value_fma's window: an integer multiply-add and an fma a value
        nf = float32(f * SQRT_FMA_BASE)
        for j in range(LANE):
            x[j] = float32(sqrt_value_fma(w[j], signed, f, nf))
    else:
        for j in range(LANE):
            x[j] = float32(sqrt_value_byte(w[j], signed, f))


@_device
def _store_state_sqrt(usedk, quant, sz, addr, vec, cnt, w, x, scale, signed):
    """:func:`_store_state` for the square-root codes: the block's factor once (``sqrt_encode_factor``),
    then each code (no table): a usual block's by ``sqrt_code_fast``, the others' by ``sqrt_code``."""
    if not usedk:
        return
    if quant:
        fast, k = sqrt_encode_factor(float32(scale), _N[1] if signed else _N[0])
        k = float32(k)
        if fast:
            for j in range(LANE):
                w[j] = sqrt_code_fast(x[j], k, signed)
        else:
            for j in range(LANE):
                w[j] = sqrt_code(x[j], k, signed)
        st8_8(addr, vec, cnt, w)
    else:
        _store_plain(sz, addr, vec, cnt, w, x)


# ---- the float8 state: a block's factors by div_fast in its windows, the codes by pairs (fp8_codes4)

_F8_MAX = np.float32(FP8_MAX)
_F8_INF = np.float32(np.inf)
_F8_DECODE_LO = np.uint32(np.float32(FP8_PRE_BELOW).view(np.uint32))  # from here on pre and post are 1


# numba.njit on both targets: the simulator calls these compiled for the cpu (div_fast is an intrinsic)
@numba.njit(error_model="numpy")
def fp8_decode_factor(scale):
    """``(fast, w, post)``: :func:`fp8_factors`' ``w`` and ``post``, ``w = scale / 448`` by ``div_fast``
    for a scale in [2**-64, 2**72) (there ``post`` is 1, the scale in div_fast's dividend window, 448
    in its divisor window) and 0 for a zero scale (a block of zeros: common, as an embedding row no
    batch has reached), ``fast`` for both; by :func:`fp8_factors` elsewhere (tiny, huge, inf, NaN)."""
    s = np.float32(scale)
    if sub32(f32_bits(s), _F8_DECODE_LO) <= sub32(DIVIDEND_HI, _F8_DECODE_LO):
        return True, div_fast(s, _F8_MAX), np.float32(1)
    if s == 0:
        return True, np.float32(0), np.float32(1)
    _, _, w, post = fp8_factors(s)
    return False, w, post


@numba.njit(error_model="numpy")
def fp8_encode_factor(scale):
    """``(fast, pre, k)``: :func:`fp8_factors`' ``pre`` and ``k``, ``k = 448 / scale`` by ``div_fast`` for a
    scale in [2**-51, 2**49) (``fast``: there ``pre`` is 1, the scale in div_fast's divisor window),
    by :func:`fp8_factors` elsewhere."""
    s = np.float32(scale)
    if divisor_in_window(s):
        return True, np.float32(1), div_fast(_F8_MAX, s)
    pre, k, _, _ = fp8_factors(s)
    return False, pre, k


@_device
def _load_code_words(usedk, addr, vec, cnt, w):
    """A slot's 8 one-byte codes of the lane as two words into ``w[0]``, ``w[1]`` (elements 0-3 and 4-7,
    the first in the low byte; 0 past the end)."""
    if not usedk:
        return
    if vec and cnt == LANE32:
        w[0], w[1] = ld_u32x2(addr)
    else:
        a = u32(0)
        b = u32(0)
        for j in range(LANE):
            if j < cnt:
                c = shl32(ld_u8(addr + j), 8 * (j & 3))
                if j < 4:
                    a = or32(a, c)
                else:
                    b = or32(b, c)
        w[0] = a
        w[1] = b


@_device
def st8_8_words(addr, vec, cnt, a, b):
    """8 one-byte codes held 4 to a word (``a``: elements 0-3, the first in the low byte): one 8-byte
    store, or a byte each where the lane is not a full aligned one."""
    if vec and cnt == LANE32:
        st_u32x2(addr, a, b)
    else:
        for j in range(LANE):
            if j < cnt:
                st_u8(addr + j, shr32(a if j < 4 else b, 8 * (j & 3)))


@_device
def _decode_fp8(usedk, w, x, scale):
    """A slot's float8 codes of the lane's 8 elements (``w[0]``, ``w[1]``: 4 to a word) as float32 into
    ``x``: ``(v * w) * post``, the factors once a block (:func:`fp8_decode_factor`); a usual block's
    (``post`` 1, left out) ``v * w`` with ``v`` by ``fp8_values4``'s conversions."""
    if not usedk:
        for j in range(LANE):
            x[j] = float32(0)
        return
    fast, f, post = fp8_decode_factor(float32(scale))
    f, post = float32(f), float32(post)
    if fast:
        a0, a1, a2, a3 = fp8_values4(w[0])
        b0, b1, b2, b3 = fp8_values4(w[1])
        x[0], x[1], x[2], x[3] = a0 * f, a1 * f, a2 * f, a3 * f
        x[4], x[5], x[6], x[7] = b0 * f, b1 * f, b2 * f, b3 * f
    else:
        # the other blocks by the shared fp8_value: a branch of its own (the same short products in
        # both branches were merged by selects, which held both sets live: 127 registers uncapped
        # where this takes 113, static SASS of bf16 + remainder8)
        for j in range(LANE):
            x[j] = (fp8_value(and32(shr32(w[j >> 2], 8 * (j & 3)), 0xFF)) * f) * post


@_device
def _store_state_fp8(usedk, quant, sz, addr, vec, cnt, w, x, scale):
    """:func:`_store_state` for the float8 state: the block's factors once (:func:`fp8_encode_factor`),
    then the codes of ``(x * pre) * k`` (a usual block's ``pre`` is 1 and left out) four to a word by
    ``fp8_codes4``, which is the contract's code for every finite value: every value of a block whose
    scale (their absmax) is finite is. A block of an inf or NaN scale codes each value by ``fp8_code``
    (a NaN's 0x7F); lanes past the end are coded but never stored."""
    if not usedk:
        return
    if quant:
        s = float32(scale)
        fast, pre, k = fp8_encode_factor(s)
        pre, k = float32(pre), float32(k)
        if fast:
            w[0] = fp8_codes4(x[0] * k, x[1] * k, x[2] * k, x[3] * k)
            w[1] = fp8_codes4(x[4] * k, x[5] * k, x[6] * k, x[7] * k)
        elif s < _F8_INF:  # 0, tiny (pre 2**64) or outside the division's window: (x * 1) * k is x * k
            w[0] = fp8_codes4((x[0] * pre) * k, (x[1] * pre) * k, (x[2] * pre) * k, (x[3] * pre) * k)
            w[1] = fp8_codes4((x[4] * pre) * k, (x[5] * pre) * k, (x[6] * pre) * k, (x[7] * pre) * k)
        else:  # inf or NaN (pre is 1)
            for j in range(LANE):
                w[j] = fp8_code(x[j] * k)
            a = _pack8(w[0], w[1], w[2], w[3])
            w[1] = _pack8(w[4], w[5], w[6], w[7])
            w[0] = a
        st8_8_words(addr, vec, cnt, w[0], w[1])
    else:
        _store_plain(sz, addr, vec, cnt, w, x)


@_device
def _store_plain(sz, addr, vec, cnt, w, x):
    """A slot's 8 new values as bfloat16 (the words ``w``, encoded by the round's path) or float32
    words."""
    if sz == 2:
        st8_16(addr, vec, cnt, w, True)
    else:
        for j in range(LANE):
            w[j] = f32_bits(x[j])
        st8_32(addr, vec, cnt, w)


@_device
def _encode_bf16(u0, u1, u2, w0, w1, w2, x0, x1, x2, key01, key2, e):
    """The lane's new bfloat16 state words (high halves) from the values ``x0``-``x2``, rounded
    stochastically: slots 0 and 1 by the halves of one hash per element (``key01``'s stream), slot 2
    by its own stream's ``key2``."""
    for j in range(LANE):
        ij = add32(e, j)
        if u0 or u1:
            r = rand32(key01, ij)
            if u0:
                w0[j] = bf16_stochastic_wide(x0[j], slot_bits(r, 0))
            if u1:
                w1[j] = bf16_stochastic_wide(x1[j], slot_bits(r, 1))
        if u2:
            w2[j] = bf16_stochastic_wide(x2[j], rand32(key2, ij))
