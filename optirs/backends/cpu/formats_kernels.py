"""The cpu backend's format loops (imported on the first format step: this imports numba).

One ``prange`` over the chunk table per pass. Chunks start at multiples of the chunk size inside
each tensor, a multiple of the int8 block (256), so every block lies in one chunk. Each loop is
compiled per format (:class:`~optirs.core.formats.FormatCodes`, used slots): the codes are
constants of the loop (a variant, :mod:`optirs.backends.common.variants`), so the branches of the
shared element step (:func:`optirs.backends.common.formats.format_element`) fold away. float32 / bfloat16 state is
decoded and encoded inside the element loop over arrays sliced to the chunk; int8 blocks keep
their new values in scratch until the block's scale (the absmax of its new values) is known.
State arrays come with their own dtype (float32 values, bfloat16 bits, int8 codes); numba caches
every loop on disk.
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from optirs.backends.common.bits32 import add32, and32, shl32, shr32
from optirs.backends.common.elementwise import element_update, lamb_grad_scale
from optirs.backends.common.variants import variant
from optirs.backends.common.formats import (absmax_update, bf16_stochastic_wide_num, bits_f32, decode16,
                                            decode_state, decode_value, encode_state, f32_bits, fp8_code,
                                            fp8_factors, fp8_value, lamb_format_update,
                                            load_master, load_master_wide, quantize_factors, rand32, remainder_word,
                                            slot_bits, sqrt_code_of_root, sqrt_factors, sqrt_value, state_stream,
                                            store_master, store_master_num, store_master_wide, store_master_wide_num,
                                            stream_key)
from optirs.backends.cpu.claims import claim, counter, loops
from optirs.backends.cpu.int8_native import DECODE, ENCODE, decode_block, encode_block, encoder_key
from optirs.backends.cpu.kernels import _sum_add, _sum_squares, chunk_trust_ratios
from optirs.core.compile_cache import cached_njit
from optirs.core.errors import InvalidParameterError
from optirs.core.formats import (BF16, BLOCK, F32, MASTER_F32, MASTER_NONE, MASTER_R16, MASTER_R8, STATE_BF16,
                                 STATE_F32, STATE_FP8, STATE_INT8_SQRT, INT8_STATE_CODES, FormatCodes)

# Only the parallel entry points are cached on disk. A function loaded from numba's cache is
# linked into a new caller as object code, which LLVM cannot inline: a loop compiled in a later
# process would call each element's helpers and not vectorize (2-4x slower, measured). The
# helpers and the per-variant loops they make up compile with their entry point, inlined.
_jit = njit(cache=False, error_model="numpy")
_pjit = cached_njit(parallel=True, error_model="numpy")
# An int8 block's decode, element loop and encode are inlined into the block loop by numba: as
# calls, each took its arrays as exploded structs on the stack (about 80 stores a call, five calls
# a block of 256) and LLVM judged them too large to inline (measured: 0.2-0.4 ns a parameter).
_inline = njit(cache=False, error_model="numpy", inline="always")


@intrinsic
def _span(typingctx, a, start, stop):
    """``a[start:stop]`` of a 1-D contiguous array (0 <= start <= stop <= len(a), not checked) as a
    view that holds no reference to ``a``'s memory: the caller keeps ``a`` alive (an argument, or a
    scratch array passed to :func:`_hold` after the view's last use: numba frees an array right
    after its own last use, and a view of freed memory writes into the heap).

    A slice takes a reference (an atomic increment of the array's count, and a decrement when it
    dies): per int8 block, the loop's slices of (and calls with) the arrays every thread shares
    made about 16 reference calls, atomic operations on the same few cache lines."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"):
        return None
    sig = a(a, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        out = context.make_array(sig.return_type)(context, builder)
        start, stop = args[1], args[2]
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype)))
        populate_array(out, data=builder.gep(src.data, [start]), shape=[builder.sub(stop, start)],
                       strides=[itemsize], itemsize=itemsize, meminfo=None)
        return out._getvalue()

    return sig, codegen


@intrinsic
def _hold(typingctx, a):
    """A use of ``a`` that does nothing: ``a`` (a scratch array viewed by :func:`_span`) lives up to here."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.none(a), codegen


@intrinsic
def _wide_vectors(typingctx):
    """Ask LLVM for 512-bit vectors in the function that calls this (its ``prefer-vector-width``
    attribute; a cpu without AVX-512 keeps its widest). LLVM's tuning for the Intel cores with
    AVX-512 prefers 256 bits and sizes a loop's vectors by the widest type the loop loads, stores
    or reduces: the loops of 16-bit words ran 16 lanes, those over a float32 word 8, and 16 measured
    5-50% faster there (docs/benchmarks.md, "512-bit vectors for the cpu format loops"). Only these
    loops ask (:func:`_wide`): other code numba compiles in the process keeps its target's choice."""
    def codegen(context, builder, sig, args):
        # llvmlite's attribute set takes only flag attributes; this one is a key and value
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


@_jit
def _target_vectors():
    """The target's own vector width (:func:`_wide_vectors`' alternative: nothing)."""


@_jit
def _all(a):
    """All of ``a`` as a view without a reference (:func:`_span`)."""
    return _span(a, 0, a.shape[0])


@_inline
def _decode_block(w, q, s, o, n, buf):
    """``n`` int8 codes at ``o`` of a block of scale ``s`` -> float32 values in ``buf`` (the map in
    registers where the cpu has AVX-512: :mod:`optirs.backends.cpu.int8_native`)."""
    decode_block(w, q, s, o, n, buf)


@_inline
def _decode_sqrt(w, lv, s, o, n, buf):
    """``n`` square-root codes at ``o`` of a block of scale ``s`` -> float32 values in ``buf``
    (``lv``: the slot's levels, [largest code, signed]). Arithmetic alone: vectorized."""
    _, f = sqrt_factors(s, lv[0])
    c = _span(w, o, o + n)  # indexed from 0: an offset index costs the vector loop its wrap-around tests
    if lv[1] != 0:
        for i in range(n):
            buf[i] = sqrt_value(np.int32(np.int8(c[i])), f)
    else:
        for i in range(n):
            buf[i] = sqrt_value(np.int32(c[i]), f)


@_inline
def _encode_sqrt(w, scales, lv, blk, o, n, buf, m):
    """A block's new values ``buf`` as square-root codes, under their absmax ``m``, each root taken
    here."""
    scales[blk] = m
    k, _ = sqrt_factors(m, lv[0])
    c = _span(w, o, o + n)
    if lv[1] != 0:
        for i in range(n):
            c[i] = np.uint8(sqrt_code_of_root(np.float32(math.sqrt(abs(buf[i]))), k, buf[i], True) & 0xFF)
    else:
        for i in range(n):
            c[i] = np.uint8(sqrt_code_of_root(np.float32(math.sqrt(buf[i])), k, buf[i], False) & 0xFF)


@_inline
def _decode_fp8(w, lv, s, o, n, buf):
    """``n`` float8 codes at ``o`` of a block of scale ``s`` -> float32 values in ``buf`` (``lv`` unused:
    a float8 code carries its sign). Integer arithmetic and one or two products: vectorized."""
    _, _, f, post = fp8_factors(s)
    c = _span(w, o, o + n)
    if post == np.float32(1):  # every usual block: the product by 1 left out
        for i in range(n):
            buf[i] = fp8_value(np.uint32(c[i])) * f
    else:
        for i in range(n):
            buf[i] = (fp8_value(np.uint32(c[i])) * f) * post


@_inline
def _encode_fp8(w, scales, blk, o, n, buf, m):
    """A block's new values ``buf`` as float8 codes under their absmax ``m``."""
    scales[blk] = m
    pre, k, _, _ = fp8_factors(m)
    c = _span(w, o, o + n)
    if pre == np.float32(1):
        for i in range(n):
            c[i] = np.uint8(fp8_code(buf[i] * k) & 0xFF)
    else:
        for i in range(n):
            c[i] = np.uint8(fp8_code((buf[i] * pre) * k) & 0xFF)


# each one-byte state's block decoder (the dynamic map's otherwise)
_BLOCK_DECODERS = {STATE_INT8_SQRT: _decode_sqrt, STATE_FP8: _decode_fp8}


@_inline
def _encode_roots(w, scales, lv, blk, o, n, roots, m):
    """:func:`_encode_sqrt` of an unsigned slot whose roots the element loop took (``roots``: where
    the family's step takes the same root, LLVM keeps one of the two)."""
    scales[blk] = m
    k, _ = sqrt_factors(m, lv[0])
    c = _span(w, o, o + n)
    for i in range(n):
        c[i] = np.uint8(sqrt_code_of_root(roots[i], k, roots[i], False) & 0xFF)


@_jit
def _word_in(v, i, kind, usedk):
    """State value ``i`` as float32: from a float32 array, or bfloat16 bits (0 for an unused slot)."""
    if not usedk:
        return np.float32(0)
    if kind == STATE_BF16:
        return decode_state(v[i], STATE_BF16)
    return np.float32(v[i])


@_jit
def _word_in_num(v, i, kind, usedk):
    """:func:`_word_in` without the NaN test (:func:`_decode_num`)."""
    if not usedk:
        return np.float32(0)
    if kind == STATE_BF16:
        return bits_f32(shl32(np.uint32(v[i]), 16))
    return np.float32(v[i])


@_jit
def _word_out_num(v, i, kind, usedk, x, r):
    """:func:`_word_out` of a non-NaN ``x``."""
    if usedk:
        if kind == STATE_BF16:
            v[i] = shr32(bf16_stochastic_wide_num(x, r), 16)
        else:
            v[i] = x


@_jit
def _slot_random(kind, key, idx, k):
    """Slot ``k``'s random bits at flat index ``idx`` (bfloat16 state; 0 otherwise, unused)."""
    if kind == STATE_BF16:
        return slot_bits(rand32(key, idx), k)
    return np.uint32(0)


@_jit
def _word_out(v, i, kind, usedk, x, r):
    """Store state value ``x`` at ``i``: float32, or bfloat16 rounded stochastically with random bits ``r``."""
    if usedk:
        if kind == STATE_BF16:
            v[i] = encode_state(x, STATE_BF16, r)
        else:
            v[i] = x


@_jit
def _block_absmax(buf, n):
    """The absmax of ``buf[:n]``, as :func:`_block_absmax_lanes` returns it.

    The magnitudes' bit patterns order as the values do, so their integer maximum is the absmax:
    one vectorized integer reduction, where the float comparisons ran scalar. A NaN orders above
    inf, and then :func:`_block_absmax_lanes` is asked which NaN the block's scale is."""
    top = np.uint32(0)
    for i in range(n):
        top = max(top, and32(f32_bits(buf[i]), 0x7FFFFFFF))
    return _absmax_of_top(top, buf, n)


@_jit
def _absmax_of_top(top, buf, n):
    """The absmax of ``buf[:n]`` from ``top``, the integer maximum of its magnitudes' bits
    (:func:`_block_absmax`; the int8 block loop takes it from the element loop)."""
    if top > np.uint32(0x7F800000):
        return _block_absmax_lanes(buf, n)
    return bits_f32(top)


@_jit
def _block_absmax_lanes(buf, n):
    """The absmax of ``buf[:n]`` as 8 running maxima (lane ``i & 7``) folded in lane order.

    ``absmax_update`` propagates NaN, so the result is the block's max |x| (NaN when any value is
    NaN: the first NaN of the first lane holding one, the scale's bits since these loops began).
    Runs scalar (the float compare-and-select chains do not vectorize): only blocks with a NaN come
    here."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(0)
    n8 = n - n % 8
    for j in range(0, n8, 8):
        m0 = absmax_update(m0, buf[j])
        m1 = absmax_update(m1, buf[j + 1])
        m2 = absmax_update(m2, buf[j + 2])
        m3 = absmax_update(m3, buf[j + 3])
        m4 = absmax_update(m4, buf[j + 4])
        m5 = absmax_update(m5, buf[j + 5])
        m6 = absmax_update(m6, buf[j + 6])
        m7 = absmax_update(m7, buf[j + 7])
    r = n - n8  # a short last block: lanes 0 .. r-1 take one more value each
    if r > 0:
        m0 = absmax_update(m0, buf[n8])
    if r > 1:
        m1 = absmax_update(m1, buf[n8 + 1])
    if r > 2:
        m2 = absmax_update(m2, buf[n8 + 2])
    if r > 3:
        m3 = absmax_update(m3, buf[n8 + 3])
    if r > 4:
        m4 = absmax_update(m4, buf[n8 + 4])
    if r > 5:
        m5 = absmax_update(m5, buf[n8 + 5])
    if r > 6:
        m6 = absmax_update(m6, buf[n8 + 6])
    m = absmax_update(np.float32(0), m0)
    m = absmax_update(m, m1)
    m = absmax_update(m, m2)
    m = absmax_update(m, m3)
    m = absmax_update(m, m4)
    m = absmax_update(m, m5)
    m = absmax_update(m, m6)
    return absmax_update(m, m7)


@_inline
def _encode_scaled(w, scales, mid, tbl, tree, blk, o, n, buf, ix, m):
    """An int8 block's new values ``buf`` under their absmax ``m``: the scale is ``m``, then each
    one's code (:func:`optirs.backends.cpu.int8_native.encode_block`: ``tree`` is the encoder's
    table, :func:`~optirs.backends.cpu.int8_native.encoder_key`, ``ix`` uint32 scratch of a block;
    ``buf`` may be overwritten)."""
    scales[blk] = m
    pre, inv = quantize_factors(m)
    encode_block(buf, n, pre, inv, tree, mid, tbl, w, o, ix)


@_jit
def _trees(d0, t0, d1, t1, d2, t2, u0, u1, u2):
    """The used slots' encoder tables (:func:`optirs.backends.cpu.int8_native.encoder_key`: the
    byte planes encoder's tables, the packed words or the midpoints in search order), built once per
    launch."""
    return encoder_key(d0, t0, u0), encoder_key(d1, t1, u1), encoder_key(d2, t2, u2)


@_jit
def _master_word(mbuf, idx, has_master):
    return np.uint32(np.int64(mbuf[idx]) & 0xFFFFFFFF) if has_master else np.uint32(0)


# ---- the element step without NaN tests (bfloat16 state: each element's first try, _run_fast)
#
# Every bfloat16 decode and encode of the contract sets a NaN apart (the quiet NaN with its sign):
# in the vectorized loop four instructions each (a mask, a compare, the sign, a masked or), five to
# seven of them a value. These forms leave the tests out and give the contract's bits wherever no
# new value of the element (master, state) is NaN: an encode differs only for a NaN; a decode only
# for a NaN word (its payload), and a NaN that reaches no new value reached it only through
# comparisons, which see no payload (a NaN in arithmetic makes the result NaN). The loop stores
# only the elements whose new values are all finite (their sum times 0 is 0) and marks the others,
# which _run_fast then runs by the contract's forms, their words untouched.


@_jit
def _decode_num(raw, kind):
    """:func:`~optirs.backends.common.formats.decode_value` of a word whose NaN payload nobody sees."""
    if kind == F32:
        return bits_f32(raw)
    if kind == BF16:
        return bits_f32(shl32(raw, 16))
    return decode16(raw, kind)


# ---- the remainder masters by sums and shifts
#
# The loops store a parameter word into a uint16 array and a master word into an int16 / int8 one:
# the store keeps the low bits, so the words need neither the split's mask nor its sign extension.
# The cuda kernels' wide words (load_master_wide, store_master_wide) are such words: the master is
# the bfloat16 word in the high half plus the remainder sign-extended, and the new words, shifted
# down to where the loops store them, are the split's low bits. The same words as remainder16_split /
# remainder8_split and their joins, two to four fewer operations an element.


@_jit
def _join_remainder(praw, mraw, fc):
    """The float32 master of a remainder format (``mraw``: the remainder as :func:`_master_word`
    reads it)."""
    return load_master_wide(shl32(praw, 16), remainder_word(mraw, fc.master))


@_jit
def _load_master_cpu(praw, mraw, fc):
    """:func:`~optirs.backends.common.formats.load_master` with the remainder masters by their sum."""
    if fc.param != F32 and (fc.master == MASTER_R16 or fc.master == MASTER_R8):
        return _join_remainder(praw, mraw, fc)
    return load_master(praw, mraw, fc)


@_jit
def _store_master_cpu(x, fc, key, i, num):
    """:func:`~optirs.backends.common.formats.store_master` (``num``: :func:`store_master_num`, for an
    ``x`` known not to be NaN) with the remainder masters' words as the loops store them (their low
    16 / 8 bits are the split's)."""
    if fc.param != F32 and (fc.master == MASTER_R16 or fc.master == MASTER_R8):
        pw, mw = store_master_wide_num(x, fc, key, i) if num else store_master_wide(x, fc, key, i)
        return shr32(pw, 16), shr32(mw, 8) if fc.master == MASTER_R8 else mw
    return store_master_num(x, fc, key, i) if num else store_master(x, fc, key, i)


@_inline
def _format_element_cpu(praw, mraw, g, s0, s1, s2, sc, fc, key, i):
    """:func:`~optirs.backends.common.formats.format_element` of the decoded gradient ``g`` by
    :func:`_load_master_cpu` and :func:`_store_master_cpu` (the same words as the loops store them)."""
    p, s0, s1, s2 = element_update(_load_master_cpu(praw, mraw, fc), g, s0, s1, s2, sc)
    pw, mw = _store_master_cpu(p, fc, key, i, False)
    return pw, mw, s0, s1, s2


@_jit
def _load_master_num(praw, mraw, fc):
    """:func:`~optirs.backends.common.formats.load_master` by :func:`_decode_num`."""
    if fc.param == F32:
        return bits_f32(praw)
    if fc.master == MASTER_F32:
        return bits_f32(mraw) if mraw != 0 else _decode_num(praw, fc.param)
    if fc.master == MASTER_R16 or fc.master == MASTER_R8:
        return _join_remainder(praw, mraw, fc)
    return _decode_num(praw, fc.param)


@_inline
def _format_element_num(praw, mraw, graw, s0, s1, s2, sc, fc, key, i):
    """:func:`~optirs.backends.common.formats.format_element` by the forms above; also returns the new
    master (its words are the contract's where it and the new state values are not NaN)."""
    p, s0, s1, s2 = element_update(_load_master_num(praw, mraw, fc), _decode_num(graw, fc.grad), s0, s1, s2, sc)
    pw, mw = _store_master_cpu(p, fc, key, i, True)
    return pw, mw, s0, s1, s2, p


# One compiled loop per (FormatCodes, used slots): the codes are constants of the loop, so the
# per-element branches on the format fold away and the block loops vectorize where they can. The
# loops are templates whose constants are bound per variant (optirs.backends.common.variants), so
# numba caches each variant on disk. The module's values of the constants are placeholders.
FC = FormatCodes(F32, F32, MASTER_NONE, STATE_F32, False)
U0 = U1 = U2 = HAS_MASTER = INT8 = SQRT = FP8 = TOPS = FAST = R0 = R1 = R2 = GRAD_NUM = False
SKIND = STATE_F32
GRAD16 = False
RUN_WORDS = RUN_FAST = RUN_SUBS = RUN_BLOCK = RUN_BLOCK_NUM = CHUNK = DECODE = LAMB_SUMS = LAMB_WRITE = LAMB_ELEMENTS = None
WRITE = False
VECTORS = _target_vectors
# a bfloat16-state chunk's sub-block (_run_fast): its marks stay in the L1 cache
SUB = 4096

_POINTWISE: dict = {}
# bfloat16 state's NaN-free first try (_run_fast); False compiles the contract's forms alone (the
# tests compare the two; loops already made keep their form)
FAST_BF16 = True
# an int8 block's bfloat16 gradients by their shift where the block holds no NaN word (RUN_BLOCK_NUM);
# False: the contract's decode everywhere (the tests compare the two)
GRAD_SHIFT = True


# OPTIRS_CPU_VECTORS=target leaves every loop at the target's own tuning (for measuring the 512-bit
# vectors on a cpu whose cores may clock down under them: the same results)
WIDE_VECTORS = os.environ.get("OPTIRS_CPU_VECTORS", "512")
if WIDE_VECTORS not in ("512", "target"):
    raise InvalidParameterError(f"OPTIRS_CPU_VECTORS={WIDE_VECTORS!r}: expected 512 or target")


def _wide(fc):
    """Whether the loops of codes ``fc`` move a 32-bit word (a float32 parameter, gradient, master or
    state value, or an int8 block's float32 scratch), and so ask for 512-bit vectors
    (:func:`_wide_vectors`). A loop of 16- and 8-bit words alone takes 16 lanes under the 256-bit
    tuning already, and took 32 with 512, no faster."""
    if WIDE_VECTORS == "target":
        return False
    return F32 in (fc.param, fc.grad) or fc.master == MASTER_F32 or fc.state != STATE_BF16


def _first_try(fc):
    """Whether the loop of codes ``fc`` runs bfloat16 state's NaN-free first try (``_run_fast``):
    bfloat16 parameters with a float32 master or none. Measured on Intel cores (the 2-core Xeon;
    the H200 host's is one) against the contract's forms alone, both loops as wide as each other:
    5-8% less time over float32 masters (the fresh master's parameter decode, the nearest
    parameter's encode: the most NaN selects), 2-11% with stochastic rounding; over float32
    parameters -3% to +19%, over the remainder masters and float16 parameters (whose masters and
    decode need no NaN select) -6% to +8%: those keep the contract's forms."""
    return FAST_BF16 and fc.state == STATE_BF16 and fc.param == BF16 and fc.master != MASTER_R16 and \
        fc.master != MASTER_R8


def pointwise(fc, used, unsigned=0):
    """The pointwise format loop for codes ``fc``, slot mask ``used`` and the mask of its unsigned
    slots ``unsigned`` (see :func:`_pointwise_format`)."""
    roots = int(used) & int(unsigned) if fc.state == STATE_INT8_SQRT else 0
    key = (tuple(fc), int(used), roots)
    k = _POINTWISE.get(key)
    if k is None:
        k = _POINTWISE[key] = _make_pointwise(FormatCodes(*fc), int(used), roots)
    return k


def _make_pointwise(fc, used, roots=0):
    int8 = fc.state in INT8_STATE_CODES
    constants = dict(FC=fc, U0=bool(used & 1), U1=bool(used & 2), U2=bool(used & 4),
                     HAS_MASTER=fc.param != F32 and fc.master != MASTER_NONE, INT8=int8,
                     SQRT=fc.state == STATE_INT8_SQRT, FP8=fc.state == STATE_FP8,
                     # a block's codes to values (square-root codes: q0..q2 are the slots' levels)
                     DECODE=_BLOCK_DECODERS.get(fc.state, _decode_block),
                     SKIND=STATE_F32 if int8 else fc.state)  # a small int8 tensor's state is float32 values
    # the int8 forms chosen at import (int8_native): in the variant's name, so that a loop cached with
    # one form never loads under another
    constants["INT8_FORMS"] = (ENCODE, DECODE)
    constants["VECTORS"] = _wide_vectors if _wide(fc) else _target_vectors
    label = "_".join(map(str, tuple(fc))) + f"_u{used}" + (f"_r{roots}" if roots else "")
    # an unsigned slot of square-root codes: its roots taken in the int8 block's element loop (R0-R2)
    constants.update(R0=bool(roots & 1), R1=bool(roots & 2), R2=bool(roots & 4))
    no_roots = dict(R0=False, R1=False, R2=False)
    constants["RUN_WORDS"] = _jit(variant(_run_words, label, dict(constants, **no_roots)))
    # bfloat16 state: each sub-block first by the NaN-free forms, redone by RUN_WORDS where a new
    # value is NaN (or inf), where that was measured to win (_first_try)
    constants["FAST"] = fast = _first_try(fc)
    constants["RUN_FAST"] = _jit(variant(_run_words, label + "_fast", dict(constants, FAST=True, **no_roots))) \
        if fast else None
    # an int8 block's element loop also takes the maxima of its new values' magnitude bits (the
    # blocks' absmax, vectorized beside the element math: no pass of its own over the block)
    constants["RUN_BLOCK"] = _inline(variant(_run_words, label + "_tops", dict(constants, TOPS=int8, FAST=False)))
    # and for a block of bfloat16 gradients without a NaN word (one maximum of their magnitudes'
    # bits says so), the same loop with the gradients decoded by their shift alone: the contract's
    # decode differs from it only for a NaN word (its test cost the remainder8 + int8_sqrt step
    # 0.09 of 1.22 ns a parameter on a Zen 4 core: diag_cpu_format_parts.py)
    constants["GRAD16"] = grad16 = GRAD_SHIFT and int8 and fc.grad == BF16
    constants["RUN_BLOCK_NUM"] = _inline(variant(_run_words, label + "_tops_num", dict(
        constants, TOPS=True, FAST=False, GRAD_NUM=True))) if grad16 else None
    # the chunk is its own (serial) function: numba's parfor lowering of a body this size
    # optimizes it far worse (measured 2-10x) than the ordinary pipeline does
    if fast:
        constants["RUN_SUBS"] = _jit(variant(_run_fast, label, constants))
    constants["CHUNK"] = _jit(variant(_chunk, label, constants))
    return _pjit(variant(_pointwise_format, label, constants))


def _run_words(p, g, mb, v0, v1, v2, sc, keyp, k01, k2, o, mk, r0, r1, r2):
    VECTORS()
    # with TOPS, the integer maximum of each slot's new magnitudes' bits (see _block_absmax); with
    # FAST, the NaN-free forms (_format_element_num): an element whose new values hold a NaN or inf
    # (the sum of them times 0 is not 0) keeps its words (masked stores) and is marked in ``mk``, for
    # _run_fast to redo by the contract's forms (_marked says whether any was: a reduction in this
    # loop held LLVM to 8 lanes where it takes 16)
    t0 = t1 = t2 = np.uint32(0)
    for i in range(p.shape[0]):
        # the random bits take the flat index's low 32 bits: computed in 32 bits, the vector loop
        # carries no 64-bit index lanes to narrow
        idx = add32(o, i)
        if FAST:
            x0 = _word_in_num(v0, i, SKIND, U0)
            x1 = _word_in_num(v1, i, SKIND, U1)
            x2 = _word_in_num(v2, i, SKIND, U2)
            pw, mw, x0, x1, x2, y = _format_element_num(np.uint32(p[i]), _master_word(mb, i, HAS_MASTER),
                                                        np.uint32(g[i]), x0, x1, x2, sc, FC, keyp, idx)
            if U0:
                y = y + x0
            if U1:
                y = y + x1
            if U2:
                y = y + x2
            nf = and32(f32_bits(y * np.float32(0)), 0x7FFFFFFF)
            mk[i] = np.uint8(1) if nf != 0 else np.uint8(0)
            if nf == 0:
                p[i] = pw
                if HAS_MASTER:
                    mb[i] = mw
                r01 = rand32(k01, idx) if U0 or U1 else np.uint32(0)
                _word_out_num(v0, i, SKIND, U0, x0, slot_bits(r01, 0))
                _word_out_num(v1, i, SKIND, U1, x1, slot_bits(r01, 1))
                _word_out_num(v2, i, SKIND, U2, x2, _slot_random(SKIND, k2, idx, 2))
        else:
            x0 = _word_in(v0, i, SKIND, U0)
            x1 = _word_in(v1, i, SKIND, U1)
            x2 = _word_in(v2, i, SKIND, U2)
            # with GRAD_NUM, bfloat16 gradients of a block that holds no NaN word: the shift alone
            gv = _decode_num(np.uint32(g[i]), FC.grad) if GRAD_NUM else decode_value(np.uint32(g[i]), FC.grad)
            pw, mw, x0, x1, x2 = _format_element_cpu(np.uint32(p[i]), _master_word(mb, i, HAS_MASTER), gv, x0, x1,
                                                     x2, sc, FC, keyp, idx)
            p[i] = pw
            if HAS_MASTER:
                mb[i] = mw
            # one hash for slots 0 and 1 (its low and high halves)
            r01 = rand32(k01, idx) if (U0 or U1) and SKIND == STATE_BF16 else np.uint32(0)
            _word_out(v0, i, SKIND, U0, x0, slot_bits(r01, 0))
            _word_out(v1, i, SKIND, U1, x1, slot_bits(r01, 1))
            _word_out(v2, i, SKIND, U2, x2, _slot_random(SKIND, k2, idx, 2))
        # with R0-R2, the square roots of the slots' new values (an unsigned slot of square-root codes:
        # the code's root, the same operation on the same value as a family's own root of it, so
        # LLVM takes it once)
        if R0:
            r0[i] = math.sqrt(x0)
        if R1:
            r1[i] = math.sqrt(x1)
        if R2:
            r2[i] = math.sqrt(x2)
        if TOPS:
            if U0:
                t0 = max(t0, and32(f32_bits(x0), 0x7FFFFFFF))
            if U1:
                t1 = max(t1, and32(f32_bits(x1), 0x7FFFFFFF))
            if U2:
                t2 = max(t2, and32(f32_bits(x2), 0x7FFFFFFF))
    return t0, t1, t2


@_jit
def _bf16_words_hold_nan(g):
    """Whether bfloat16 words ``g`` hold a NaN (a magnitude above inf's): one maximum of the
    magnitudes, vectorized."""
    top = np.uint32(0)
    for i in range(g.shape[0]):
        top = max(top, and32(np.uint32(g[i]), 0x7FFF))
    return top > np.uint32(0x7F80)


@_jit
def _marked(mk, n):
    """Whether any of ``mk[:n]`` is set (an or of every byte: vectorized, where a loop that stops at
    the first would run one byte at a time)."""
    acc = np.uint8(0)
    for i in range(n):
        acc |= mk[i]
    return acc != 0


def _run_fast(p, g, mb, v0, v1, v2, sc, keyp, k01, k2, o):
    VECTORS()
    # RUN_WORDS' results by sub-blocks: each by the NaN-free forms (RUN_FAST), then its marked
    # elements (a NaN or inf new value, their words untouched) one by one by the contract's forms
    # (RUN_WORDS). Views without references (_span). Measured and not kept: copying a sub-block's
    # words to redo it whole cost what the forms save (copy loops), or stopped the loop vectorizing
    # (the copies in the element loop: LLVM's run-time alias checks of five more arrays)
    n = p.shape[0]
    marks = np.empty(min(n, SUB), np.uint8)
    mk = _all(marks)
    for b in range(0, n, SUB):
        m = min(SUB, n - b)
        sm = _span(mb, b, b + m) if HAS_MASTER else mb
        s0 = _span(v0, b, b + m) if U0 else v0
        s1 = _span(v1, b, b + m) if U1 else v1
        s2 = _span(v2, b, b + m) if U2 else v2
        RUN_FAST(_span(p, b, b + m), _span(g, b, b + m), sm, s0, s1, s2, sc, keyp, k01, k2, add32(o, b), mk, mk, mk,
                 mk)
        if _marked(mk, m):
            for i in range(m):
                if mk[i] != 0:
                    j = b + i
                    RUN_WORDS(_span(p, j, j + 1), _span(g, j, j + 1), _span(mb, j, j + 1) if HAS_MASTER else mb,
                              _span(v0, j, j + 1) if U0 else v0, _span(v1, j, j + 1) if U1 else v1,
                              _span(v2, j, j + 1) if U2 else v2, sc, keyp, k01, k2, add32(o, j), mk, mk, mk, mk)
    _hold(marks)


def _chunk(p, g, mbuf, w0, c0, m0, w1, c1, m1, w2, c2, m2, q0, d0, t0, q1, d1, t1, q2, d2, t2, e0, e1, e2, off,
           blk0, so, s, e, sc, keyp, k01, k2):
    VECTORS()
    if not INT8 or so >= 0:
        # float32 / bfloat16 words (or a small tensor's float32 state): decoded and encoded in
        # the element loop itself, every array sliced to the chunk so that one index addresses
        # them all (LLVM then vectorizes the loop; scratch blocks or offset indices cost 3-10x)
        n = e - s
        o = off + s
        mb = mbuf[o : o + n] if HAS_MASTER else mbuf
        if INT8:  # a small tensor: float32 values
            v0 = m0[so + s : so + e] if U0 else m0
            v1 = m1[so + s : so + e] if U1 else m1
            v2 = m2[so + s : so + e] if U2 else m2
        else:
            v0 = w0[o : o + n] if U0 else w0
            v1 = w1[o : o + n] if U1 else w1
            v2 = w2[o : o + n] if U2 else w2
        if FAST:
            RUN_SUBS(p[s:e], g[s:e], mb, v0, v1, v2, sc, keyp, k01, k2, o)
        else:
            RUN_WORDS(p[s:e], g[s:e], mb, v0, v1, v2, sc, keyp, k01, k2, o, g, g, g, g)
        return
    # int8 blocks: a block's scale is the absmax of its new values, so they wait in scratch.
    # Each block in three loops: the codes decoded (lookups in registers, int8_native), the element
    # loop over the float32 scratch (the same vectorized loop as float32 state, which also returns
    # the integer maxima of the new magnitudes: the block's absmax), the new codes (_encode_scaled)
    s0 = np.zeros(BLOCK, np.float32)
    s1 = np.zeros(BLOCK, np.float32)
    s2 = np.zeros(BLOCK, np.float32)
    si = np.zeros(BLOCK, np.uint32)
    rs = np.zeros((3, BLOCK) if R0 or R1 or R2 else (3, 0), np.float32)  # the unsigned slots' roots
    # every array the blocks read as a view without references (_span), so that no block's calls
    # and slices count references to the arrays all threads share; the scratch is held to the end
    p, g, mbuf, a0, a1, a2, ix = _all(p), _all(g), _all(mbuf), _all(s0), _all(s1), _all(s2), _all(si)
    w0, c0, q0, d0, t0, e0 = _all(w0), _all(c0), _all(q0), _all(d0), _all(t0), _all(e0)
    w1, c1, q1, d1, t1, e1 = _all(w1), _all(c1), _all(q1), _all(d1), _all(t1), _all(e1)
    w2, c2, q2, d2, t2, e2 = _all(w2), _all(c2), _all(q2), _all(d2), _all(t2), _all(e2)
    r0, r1, r2 = _all(rs[0]), _all(rs[1]), _all(rs[2])
    for b in range(s, e, BLOCK):
        n = min(BLOCK, e - b)
        blk = blk0 + b // BLOCK
        o = off + b
        if U0:
            DECODE(w0, q0, c0[blk], o, n, a0)
        if U1:
            DECODE(w1, q1, c1[blk], o, n, a1)
        if U2:
            DECODE(w2, q2, c2[blk], o, n, a2)
        # views without references (_span): the same loop as over slices
        mb = _span(mbuf, o, o + n) if HAS_MASTER else mbuf
        if GRAD16 and not _bf16_words_hold_nan(_span(g, b, b + n)):
            top0, top1, top2 = RUN_BLOCK_NUM(_span(p, b, b + n), _span(g, b, b + n), mb,
                                             _span(a0, 0, n) if U0 else a0, _span(a1, 0, n) if U1 else a1,
                                             _span(a2, 0, n) if U2 else a2, sc, keyp, k01, k2, o, a0,
                                             _span(r0, 0, n) if R0 else r0, _span(r1, 0, n) if R1 else r1,
                                             _span(r2, 0, n) if R2 else r2)
        else:
            top0, top1, top2 = RUN_BLOCK(_span(p, b, b + n), _span(g, b, b + n), mb, _span(a0, 0, n) if U0 else a0,
                                         _span(a1, 0, n) if U1 else a1, _span(a2, 0, n) if U2 else a2, sc, keyp, k01,
                                         k2, o, a0, _span(r0, 0, n) if R0 else r0, _span(r1, 0, n) if R1 else r1,
                                         _span(r2, 0, n) if R2 else r2)
        if SQRT:
            if R0:
                _encode_roots(w0, c0, q0, blk, o, n, r0, _absmax_of_top(top0, a0, n))
            elif U0:
                _encode_sqrt(w0, c0, q0, blk, o, n, a0, _absmax_of_top(top0, a0, n))
            if R1:
                _encode_roots(w1, c1, q1, blk, o, n, r1, _absmax_of_top(top1, a1, n))
            elif U1:
                _encode_sqrt(w1, c1, q1, blk, o, n, a1, _absmax_of_top(top1, a1, n))
            if R2:
                _encode_roots(w2, c2, q2, blk, o, n, r2, _absmax_of_top(top2, a2, n))
            elif U2:
                _encode_sqrt(w2, c2, q2, blk, o, n, a2, _absmax_of_top(top2, a2, n))
        elif FP8:
            if U0:
                _encode_fp8(w0, c0, blk, o, n, a0, _absmax_of_top(top0, a0, n))
            if U1:
                _encode_fp8(w1, c1, blk, o, n, a1, _absmax_of_top(top1, a1, n))
            if U2:
                _encode_fp8(w2, c2, blk, o, n, a2, _absmax_of_top(top2, a2, n))
        else:
            if U0:
                _encode_scaled(w0, c0, d0, t0, e0, blk, o, n, a0, ix, _absmax_of_top(top0, a0, n))
            if U1:
                _encode_scaled(w1, c1, d1, t1, e1, blk, o, n, a1, ix, _absmax_of_top(top1, a1, n))
            if U2:
                _encode_scaled(w2, c2, d2, t2, e2, blk, o, n, a2, ix, _absmax_of_top(top2, a2, n))
    _hold(s0)
    _hold(s1)
    _hold(s2)
    _hold(si)
    _hold(rs)


def _pointwise_format(ps, gs, mbuf, w0, c0, m0, w1, c1, m1, w2, c2, m2, q0, d0, t0, q1, d1, t1, q2, d2, t2, table,
                      chunk_tensor, chunk_start, chunk_stop, sc, seed, step):
    """A pointwise family's format step over the chunk table.

    ``ps``/``gs``: typed lists of each tensor's parameter / gradient words (uint32 views of
    float32, or uint16). ``mbuf``: the master buffer (uint32 view of float32, int16 or int8
    remainders; empty without masters). Slot k: words ``wk`` (uint32 view, uint16 bfloat16
    bits or uint8 codes), int8 scales ``ck`` and small-tensor values ``mk``, its map ``qk``,
    padded midpoints ``dk`` and bucket table ``tk`` (square-root codes: ``qk`` is the slot's levels,
    float32 [largest code, signed]). ``table``: FormatState.tensor_table().
    """
    keyp = stream_key(seed, step, 0)
    k01, k2 = stream_key(seed, step, state_stream(0)), stream_key(seed, step, state_stream(2))
    dyn = INT8 and not SQRT and not FP8  # the dynamic map's encoder tables
    e0, e1, e2 = _trees(d0, t0, d1, t1, d2, t2, U0 and dyn, U1 and dyn, U2 and dyn)  # read by every chunk
    # each thread claims the next chunk until none is left (claims: a thread held up by the scheduler
    # delays the step by one chunk, not by a static share)
    nchunks = chunk_tensor.shape[0]
    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            t = chunk_tensor[c]
            CHUNK(ps[t], gs[t], mbuf, w0, c0, m0, w1, c1, m1, w2, c2, m2, q0, d0, t0, q1, d1, t1, q2, d2, t2, e0,
                  e1, e2, table[t, 0], table[t, 1], table[t, 2], chunk_start[c], chunk_stop[c], sc, keyp, k01, k2)
            c = claim(next_chunk)


@_jit
def _grad_sum_squares(g, kind):
    """The float64 sum of the squares of a chunk's gradient words (``g`` sliced to the chunk)."""
    total = 0.0
    for i in range(g.shape[0]):
        x = np.float64(decode_value(np.uint32(g[i]), kind))
        total = _sum_add(total, x * x)
    return total


_LAMB: dict = {}


def lamb(fc):
    """LAMB's format step for codes ``fc`` (one variant each, as :func:`pointwise`)."""
    key = tuple(fc)
    k = _LAMB.get(key)
    if k is None:
        fc = FormatCodes(*fc)
        int8 = fc.state in INT8_STATE_CODES
        constants = dict(FC=fc, INT8=int8, SQRT=fc.state == STATE_INT8_SQRT, FP8=fc.state == STATE_FP8,
                         HAS_MASTER=fc.param != F32 and fc.master != MASTER_NONE,
                         DECODE=_BLOCK_DECODERS.get(fc.state, _decode_block),
                         SKIND=STATE_F32 if int8 else fc.state,  # an int8 block's scratch, a small tensor's state
                         INT8_FORMS=(ENCODE, DECODE))  # as in _make_pointwise
        label = "_".join(map(str, key))
        # each pass's chunk a serial function of its own, as the pointwise CHUNK (numba's parfor
        # lowering optimizes a body this size worse); pass 1 sums, pass 2 writes; the element loop
        # (LAMB_ELEMENTS) inlined into each
        for name, write in (("LAMB_SUMS", False), ("LAMB_WRITE", True)):
            # pass 1 writes its values into float32 scratch: 512-bit vectors in every format
            c = dict(constants, WRITE=write, TOPS=write and int8,
                     VECTORS=_wide_vectors if _wide(fc) or (not write and WIDE_VECTORS == "512") else _target_vectors)
            c["LAMB_ELEMENTS"] = _inline(variant(_lamb_elements, f"{label}_{name.lower()}", c))
            constants[name] = _jit(variant(_lamb_chunk, f"{label}_{name.lower()}", c))
        k = _LAMB[key] = _pjit(variant(_lamb_format, label, constants))
    return k


def _lamb_elements(p, g, mb, v0, v1, grad_scale, lr_t, sc, keyp, k01, o, sx, su):
    # LAMB's element loop over arrays sliced alike (state words, or an int8 block's float32 scratch).
    # Pass 1 (WRITE False) returns the float64 sums of the masters' and the directions' squares and
    # writes nothing but its scratch ``sx``, ``su``: the float32 values go there and _sum_squares
    # sums them per vector lane, so that the element math vectorizes 8 float32 lanes wide where a
    # float64 sum in the same loop held it to 4 (1.04-1.6x faster, measured). Pass 2
    # recomputes the same values and writes the parameter, its master and the moments, and with
    # TOPS returns the integer maxima of the new moments' magnitude bits (an int8 block's absmax, as
    # the pointwise RUN_BLOCK)
    t0 = t1 = np.uint32(0)
    for i in range(p.shape[0]):
        idx = add32(o, i)
        x, m, v, u = lamb_format_update(_load_master_cpu(np.uint32(p[i]), _master_word(mb, i, HAS_MASTER), FC),
                                        decode_value(np.uint32(g[i]), FC.grad), _word_in(v0, i, SKIND, True),
                                        _word_in(v1, i, SKIND, True), grad_scale, sc)
        if WRITE:
            pw, mw = _store_master_cpu(x - lr_t * u, FC, keyp, idx, False)
            p[i] = pw
            if HAS_MASTER:
                mb[i] = mw
            r01 = rand32(k01, idx) if SKIND == STATE_BF16 else np.uint32(0)  # one hash, both slots
            _word_out(v0, i, SKIND, True, m, slot_bits(r01, 0))
            _word_out(v1, i, SKIND, True, v, slot_bits(r01, 1))
            if TOPS:
                t0 = max(t0, and32(f32_bits(m), 0x7FFFFFFF))
                t1 = max(t1, and32(f32_bits(v), 0x7FFFFFFF))
        else:
            sx[i] = x
            su[i] = u
    if WRITE:
        return 0.0, 0.0, t0, t1
    n = p.shape[0]
    return _sum_squares(_span(sx, 0, n)), _sum_squares(_span(su, 0, n)), t0, t1


def _lamb_chunk(p, g, mbuf, w0, c0, m0, q0, d0, t0, e0, w1, c1, m1, q1, d1, t1, e1, off, blk0, so, s, e,
                grad_scale, lr_t, sc, keyp, k01):
    VECTORS()
    # one chunk of LAMB's format step: pass 1 (WRITE False) returns the chunk's float64 sums of p^2
    # and u^2 and writes nothing; pass 2 recomputes the same values and writes the parameter, its
    # master and the moments. Float32 / bfloat16 words (and a small tensor's float32 state under
    # int8) are decoded and encoded in the element loop over the chunk's slices (pass 1 by
    # sub-blocks of SUB, the size of its scratch); int8 blocks are decoded into scratch, and pass 2
    # codes each block under the absmax of its new values
    if not INT8 or so >= 0:
        n = e - s
        o = off + s
        mb = mbuf[o : o + n] if HAS_MASTER else mbuf
        if INT8:
            v0, v1 = m0[so + s : so + e], m1[so + s : so + e]
        else:
            v0, v1 = w0[o : o + n], w1[o : o + n]
        if WRITE:
            ps_c, us_c, _, _ = LAMB_ELEMENTS(p[s:e], g[s:e], mb, v0, v1, grad_scale, lr_t, sc, keyp, k01, o, mb, mb)
            return ps_c, us_c
        xs = np.empty(min(n, SUB), np.float32)
        ys = np.empty(min(n, SUB), np.float32)
        sx, su = _all(xs), _all(ys)
        ps_c, us_c = 0.0, 0.0
        for b in range(0, n, SUB):
            k = min(SUB, n - b)
            ps_b, us_b, _, _ = LAMB_ELEMENTS(_span(p, s + b, s + b + k), _span(g, s + b, s + b + k),
                                             _span(mb, b, b + k) if HAS_MASTER else mb, _span(v0, b, b + k),
                                             _span(v1, b, b + k), grad_scale, lr_t, sc, keyp, k01, add32(o, b),
                                             sx, su)
            ps_c += ps_b
            us_c += us_b
        _hold(xs)
        _hold(ys)
        return ps_c, us_c
    s0 = np.zeros(BLOCK, np.float32)
    s1 = np.zeros(BLOCK, np.float32)
    si = np.zeros(BLOCK if WRITE else 0, np.uint32)  # the dynamic map's encode
    sxb = np.zeros(BLOCK if not WRITE else 0, np.float32)
    sub = np.zeros(BLOCK if not WRITE else 0, np.float32)
    # views without references (_span), as the pointwise CHUNK's; the scratch held to the end
    p, g, mbuf, a0, a1, ix = _all(p), _all(g), _all(mbuf), _all(s0), _all(s1), _all(si)
    sxa, sua = _all(sxb), _all(sub)
    w0, c0, q0, d0, t0, e0 = _all(w0), _all(c0), _all(q0), _all(d0), _all(t0), _all(e0)
    w1, c1, q1, d1, t1, e1 = _all(w1), _all(c1), _all(q1), _all(d1), _all(t1), _all(e1)
    ps_c, us_c = 0.0, 0.0
    for b in range(s, e, BLOCK):
        n = min(BLOCK, e - b)
        blk = blk0 + b // BLOCK
        o = off + b
        DECODE(w0, q0, c0[blk], o, n, a0)
        DECODE(w1, q1, c1[blk], o, n, a1)
        mb = _span(mbuf, o, o + n) if HAS_MASTER else mbuf
        ps_b, us_b, top0, top1 = LAMB_ELEMENTS(_span(p, b, b + n), _span(g, b, b + n), mb, _span(a0, 0, n),
                                               _span(a1, 0, n), grad_scale, lr_t, sc, keyp, k01, o, sxa, sua)
        ps_c += ps_b
        us_c += us_b
        if WRITE:
            if SQRT:
                _encode_sqrt(w0, c0, q0, blk, o, n, a0, _absmax_of_top(top0, a0, n))
                _encode_sqrt(w1, c1, q1, blk, o, n, a1, _absmax_of_top(top1, a1, n))
            elif FP8:
                _encode_fp8(w0, c0, blk, o, n, a0, _absmax_of_top(top0, a0, n))
                _encode_fp8(w1, c1, blk, o, n, a1, _absmax_of_top(top1, a1, n))
            else:
                _encode_scaled(w0, c0, d0, t0, e0, blk, o, n, a0, ix, _absmax_of_top(top0, a0, n))
                _encode_scaled(w1, c1, d1, t1, e1, blk, o, n, a1, ix, _absmax_of_top(top1, a1, n))
    _hold(s0)
    _hold(s1)
    _hold(si)
    _hold(sxb)
    _hold(sub)
    return ps_c, us_c


def _lamb_format(ps, gs, mbuf, w0, c0, m0, w1, c1, m1, q0, d0, t0, q1, d1, t1, table, chunk_tensor, chunk_start,
                 chunk_stop, ntensors, sc, seed, step):
    """LAMB's format step: the global gradient norm (with max_grad_norm), pass 1 (the per-tensor
    float64 sums of p^2 and u^2, nothing written), the trust ratios, pass 2 (the same values
    recomputed; parameter, master and moments written). Slots as :func:`pointwise` (exp_avg, exp_avg_sq)."""
    nchunks = chunk_tensor.shape[0]
    norm = 0.0  # unused without clipping: the scale is then the gradient factor alone
    if sc.max_grad_norm > 0:
        partial = np.zeros(nchunks, dtype=np.float64)
        next_chunk = counter()
        for _loop in prange(loops(nchunks)):
            c = claim(next_chunk)
            while c < nchunks:
                partial[c] = _grad_sum_squares(gs[chunk_tensor[c]][chunk_start[c] : chunk_stop[c]], FC.grad)
                c = claim(next_chunk)
        norm = np.sqrt(partial.sum())
    grad_scale = lamb_grad_scale(norm, sc)  # the gradient factor times the clip of the factored norm
    p_sq = np.zeros(nchunks, dtype=np.float64)
    u_sq = np.zeros(nchunks, dtype=np.float64)
    keyp = stream_key(seed, step, 0)
    k01 = stream_key(seed, step, state_stream(0))
    dyn = INT8 and not SQRT and not FP8  # the dynamic map's encoder tables
    e0, e1, _ = _trees(d0, t0, d1, t1, d1, t1, dyn, dyn, False)  # read by every chunk
    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            t = chunk_tensor[c]
            p_sq[c], u_sq[c] = LAMB_SUMS(ps[t], gs[t], mbuf, w0, c0, m0, q0, d0, t0, e0, w1, c1, m1, q1, d1, t1, e1,
                                         table[t, 0], table[t, 1], table[t, 2], chunk_start[c], chunk_stop[c],
                                         grad_scale, sc.lr, sc, keyp, k01)
            c = claim(next_chunk)
    ratio = chunk_trust_ratios(p_sq, u_sq, chunk_tensor, ntensors, sc.max_trust_ratio)
    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            t = chunk_tensor[c]
            LAMB_WRITE(ps[t], gs[t], mbuf, w0, c0, m0, q0, d0, t0, e0, w1, c1, m1, q1, d1, t1, e1, table[t, 0],
                       table[t, 1], table[t, 2], chunk_start[c], chunk_stop[c], grad_scale, sc.lr * ratio[t], sc,
                       keyp, k01)
            c = claim(next_chunk)


@_pjit
def check(gs, chunk_tensor, chunk_start, chunk_stop, kind, flags):
    """flags[c] = 1 where chunk c holds a gradient that is not finite."""
    for c in prange(chunk_tensor.shape[0]):
        g = gs[chunk_tensor[c]]
        bad = 0
        for i in range(chunk_start[c], chunk_stop[c]):
            if not math.isfinite(decode_value(np.uint32(g[i]), kind)):
                bad = 1
        flags[c] = bad
