"""int8 state's map lookups by AVX-512 gathers and registers (the cpu format loops), with a portable fallback.

An int8 block decodes as ``q[code] * scale`` and encodes as the number of midpoints ``mid[k] < y``
(docs/formats.md, "int8 state"). Written as array reads, both are table lookups whose index
differs per element: LLVM keeps them scalar (it emits no gathers for Zen 4), about 1 ns per value
and moment on a Zen 4 core, most of the int8 step. With AVX-512:

- **decode**: the 256-entry float32 map is 16 zmm registers; ``vpermi2ps`` looks up 32 entries
  for 16 lanes, so 8 of them and 7 selects on the code's bits 5-7 look up 16 codes with no
  memory read. The same products as ``q[code] * scale``. (One ``vgatherdps`` from the map,
  :func:`decode_block_gathers`, is slower on Zen 4: docs/benchmarks.md.)
- **encode** (AVX-512 VBMI): the contract's ``c + (mid[c] < y)`` with buckets as wide as each
  octave's midpoints allow (436 or 464 of them, not 2947: :func:`planes_key`), so that ``c`` is 8
  zmm of bytes looked up by ``vpermi2b`` and ``mid[c]`` the decode's byte planes of the midpoints:
  no memory read but the values, about 98 instructions per 64 values
  (:func:`encode_block_planes`, on an AMD Zen). Elsewhere (or with ``OPTIRS_CPU_INT8_ENCODE=gathers``): one
  ``vpgatherdd`` per 16 values from the packed words (:func:`packed_words`: one 32-bit word per
  bucket of the value's top 16 bits and sign, the cuda kernels' unsigned-map words extended to
  negative values), and an add: the code is the sum's top 16 bits. About 12 integer instructions
  per 16 values beside the gather, which costs about a load a lane on Zen 4.
- the **search** it replaced (:func:`encode_block_registers`, kept for measuring on other cpus:
  ``OPTIRS_CPU_INT8_ENCODE=search``): a branchless binary search over the 255 midpoints (padded
  with +inf to 256) in Eytzinger order (node ``j``'s children are ``2j`` and ``2j + 1``, so the
  running node number is the index of the next level's table and, after 8 levels, 256 plus the
  code). Levels 0-4 are one register (``vpermps``), level 5 two (``vpermi2ps``), levels 6 and 7
  four and eight with selects on the node's bits. Each level compares ``t < y`` as the count does
  (a NaN compares false at every level: code 0). Four groups of 16 are searched side by side:
  each level waits on the one before it; 54 instructions per 16 values, most on the shuffle port.

The three encoders count exactly: checked equal to ``int8_buckets.quantize_table`` for all 2**32
float32 inputs of both maps (benchmarks/check_int8_native.py). :func:`decode_block` and
:func:`encode_block` compile the AVX-512 forms where numba compiles for a cpu with AVX-512F, and
the table-read loops everywhere else (the same results; the tests check both on a machine with
AVX-512). Only the cpu backend calls them (a cuda kernel never sees x86 intrinsics).
"""

from __future__ import annotations

import os
import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from optirs.backends.common.formats import bits_f32, f32_bits, quantize_bucket, quantize_code, quantize_scaled
from optirs.backends.common.int8_buckets import HI, LO, WIDTH
from optirs.core.errors import InvalidParameterError

_jit = njit(cache=False, error_model="numpy")

_F16 = ir.VectorType(ir.FloatType(), 16)
_I16 = ir.VectorType(ir.IntType(32), 16)
_B16 = ir.VectorType(ir.IntType(8), 16)
_I64 = ir.IntType(64)
_V16 = ir.VectorType(ir.IntType(1), 16)
_P8 = ir.IntType(8).as_pointer()
GROUPS = 4  # groups of 16 values searched side by side by the encoder


def _cpu_has_avx512f() -> bool:
    """Whether the cpu numba compiles for has AVX-512F (the features it is given when
    ``NUMBA_CPU_NAME`` names another cpu, as :mod:`optirs.backends.common.half_native` reads them)."""
    from numba.core import config

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return "+avx512f" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding

    try:
        return bool(binding.get_host_cpu_features().get("avx512f", False))
    except RuntimeError:  # llvmlite cannot read the features: keep the table reads
        return False


NATIVE = _cpu_has_avx512f()


def _cpu_has_vbmi() -> bool:
    """Whether that cpu also has AVX-512 VBMI (``vpermb``, ``vpermi2b``: Ice Lake and later, Zen 4)."""
    from numba.core import config

    if not NATIVE:
        return False
    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return "+avx512vbmi" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding

    try:
        return bool(binding.get_host_cpu_features().get("avx512vbmi", False))
    except RuntimeError:
        return False


VBMI = _cpu_has_vbmi()


def _cpu_gathers_slowly() -> bool:
    """Whether that cpu is an AMD Zen, whose AVX-512 gathers cost about a load a lane: there the
    encode's byte planes beat its gathers (0.30 against 0.47 ns a value on Zen 4), on the Intel Xeon
    of the H200 host the gathers win (0.31 against 0.46; docs/benchmarks.md)."""
    from numba.core import config

    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return config.CPU_NAME.startswith("znver")
    from llvmlite import binding

    return binding.get_host_cpu_name().startswith("znver")


GATHERS_SLOW = NATIVE and _cpu_gathers_slowly()


def _function(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _data(context, builder, aryty, ary):
    return context.make_array(aryty)(context, builder, ary).data


def _registers(builder, context, aryty, ary, count):
    """The first ``16 * count`` float32 of a contiguous array as ``count`` <16 x float> values."""
    p = builder.bitcast(_data(context, builder, aryty, ary), _F16.as_pointer())
    return [builder.load(builder.gep(p, [ir.Constant(_I64, k)]), align=4) for k in range(count)]


def _splat(builder, x):
    v = builder.insert_element(ir.Constant(_F16, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, v, ir.Constant(_I16, [0] * 16))


def _bit_set(builder, v, k):
    return builder.icmp_unsigned("!=", builder.and_(v, ir.Constant(_I16, [1 << k] * 16)), ir.Constant(_I16, [0] * 16))


def _lookup(builder, regs, index):
    """``regs`` (1, 2, 4 or 8 registers: 16 x len entries) looked up at the low bits of ``index``."""
    if len(regs) == 1:
        return builder.call(_function(builder, "llvm.x86.avx512.permvar.sf.512", _F16, [_F16, _I16]), [regs[0], index])
    two = _function(builder, "llvm.x86.avx512.vpermi2var.ps.512", _F16, [_F16, _I16, _F16])
    highs = [_bit_set(builder, index, bit) for bit in range(5, 5 + (len(regs) // 2).bit_length() - 1)]
    parts = [builder.call(two, [regs[2 * k], index, regs[2 * k + 1]]) for k in range(len(regs) // 2)]
    for high in highs:
        parts = [builder.select(high, parts[2 * k + 1], parts[2 * k]) for k in range(len(parts) // 2)]
    return parts[0]


def _decoder(name, width, setup, lookup):
    """An intrinsic ``(w, o, q, s, buf, m)``: ``buf[i] = q[w[o + i]] * s`` for ``i < width * m``
    (uint8 codes, float32 buf), ``width`` codes a round. ``setup(context, builder, aryty, q)`` is
    made once before the rounds (the map in registers, a base pointer); ``lookup(builder, made,
    codes)`` gives a round's ``width // 16`` vectors of ``q[code]`` for its ``<width x i8>`` codes."""

    def decode(typingctx, w, o, q, s, buf, m):
        if not (isinstance(w, types.Array) and isinstance(q, types.Array) and isinstance(buf, types.Array)):
            return None
        sig = types.void(w, types.int64, q, types.float32, buf, types.int64)
        codes_type = ir.VectorType(ir.IntType(8), width)

        def codegen(context, builder, sig, args):
            w, o, q, s, buf, m = args
            wp = builder.gep(_data(context, builder, sig.args[0], w), [o])
            bp = _data(context, builder, sig.args[4], buf)
            made = setup(context, builder, sig.args[2], q)
            sv = _splat(builder, s)
            with cgutils.for_range(builder, m) as loop:
                base = builder.mul(loop.index, ir.Constant(_I64, width))
                codes = builder.load(builder.bitcast(builder.gep(wp, [base]), codes_type.as_pointer()), align=1)
                for g, v in enumerate(lookup(builder, made, codes)):  # values 16 g .. 16 g + 15
                    at = builder.add(base, ir.Constant(_I64, 16 * g))
                    builder.store(builder.fmul(v, sv), builder.bitcast(builder.gep(bp, [at]), _F16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    decode.__name__ = decode.__qualname__ = name
    return intrinsic(decode)


# the map in 16 registers, a lookup by permutes (vpermi2ps) and selects
_decode_groups = _decoder("_decode_groups", 16, lambda context, builder, aryty, q: _registers(builder, context, aryty, q, 16),
                          lambda builder, table, codes: [_lookup(builder, table, builder.zext(codes, _I16))])


_B64 = ir.VectorType(ir.IntType(8), 64)
_W32 = ir.VectorType(ir.IntType(16), 32)


def decoder_table(q: np.ndarray) -> np.ndarray:
    """The table the decoders read for the float32 map ``q`` (256 entries): float32[512], ``q`` itself
    and then its bytes by plane (bytes ``256 j .. 256 j + 255`` of the second half: byte ``j`` of each
    entry, little-endian), which :func:`decode_block_planes` looks up. The other forms read the first
    half alone."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    if q.shape != (256,):
        raise InvalidParameterError(f"q has shape {q.shape}, expected the 256 float32 entries of an int8 map")
    planes = np.ascontiguousarray(q.view(np.uint8).reshape(256, 4).T)
    table = np.concatenate([q, planes.reshape(-1).view(np.float32)])
    table.setflags(write=False)
    return table


def _unpack(builder, a, b, lanes, high):
    """``vpunpck{l,h}{bw,wd}``: the low (or high) halves of each 128-bit lane of ``a`` and ``b``
    interleaved, ``lanes`` elements a lane."""
    half = lanes // 2
    mask = []
    for lane in range(4):
        for i in range(half):
            k = lane * lanes + i + (half if high else 0)
            mask += [k, k + 4 * lanes]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(mask)), mask))


# The codes' order before the byte lookups (one vpermb), so that the interleaving of the four byte
# planes (punpck*bw, then punpck*wd, in-lane) leaves each group of 16 values in order: byte 4k + r of
# 128-bit lane L takes code 16k + 4L + r.
_PLANE_ORDER = [16 * k + 4 * lane + r for lane in range(4) for k in range(4) for r in range(4)]


def _planes_setup(context, builder, aryty, table):
    """:func:`decoder_table`'s byte planes in 16 registers (its second half), and the byte permute."""
    tp = builder.bitcast(builder.gep(_data(context, builder, aryty, table), [ir.Constant(_I64, 256)]),
                         _B64.as_pointer())
    planes = [[builder.load(builder.gep(tp, [ir.Constant(_I64, 4 * j + r)]), align=4) for r in range(4)]
              for j in range(4)]
    return planes, _function(builder, "llvm.x86.avx512.vpermi2var.qi.512", _B64, [_B64, _B64, _B64])


def _planes_lookup(builder, made, codes):
    planes, two = made
    codes = builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(ir.IntType(32), 64), _PLANE_ORDER))
    high = builder.icmp_signed("<", codes, ir.Constant(_B64, [0] * 64))  # bit 7: entries 128-255
    b = []
    for j in range(4):
        lo = builder.call(two, [planes[j][0], codes, planes[j][1]])
        hi = builder.call(two, [planes[j][2], codes, planes[j][3]])
        b.append(builder.select(high, hi, lo))
    w01 = [builder.bitcast(_unpack(builder, b[0], b[1], 16, h), _W32) for h in (False, True)]
    w23 = [builder.bitcast(_unpack(builder, b[2], b[3], 16, h), _W32) for h in (False, True)]
    return [builder.bitcast(_unpack(builder, w01[g // 2], w23[g // 2], 8, g % 2 == 1), _F16) for g in range(4)]


# ``buf[i] = q[w[o + i]] * s`` for ``i < 64 * m`` by byte lookups in registers (AVX-512 VBMI): the
# table is decoder_table's, whose byte planes are 16 registers, so that two vpermi2b and a select on
# the code's bit 7 look up one byte of 64 entries; the four bytes are interleaved into the float32
# entries (8 unpacks) and multiplied as q[code] * s is
_decode_planes = _decoder("_decode_planes", 64, _planes_setup, _planes_lookup)


# Eytzinger order: levels 0-3 (nodes 1..15) share register 0, level 4 (nodes 16..31) register 1,
# level 5 registers 2-3, level 6 registers 4-7, level 7 registers 8-15
_LEVEL_REGS = ((0, 1), (0, 1), (0, 1), (0, 1), (1, 2), (2, 4), (4, 8), (8, 16))


def _encoder(body):
    """An intrinsic ``(buf, pre, inv, key, w, o, m)``: ``w[o + i]`` = the code of ``(buf[i] * pre) *
    inv`` for the rounds' values (float32 buf, uint8 codes), from the table ``key`` the form reads.
    ``body(context, builder, keytype, key, bp, wp, prev, invv, m)`` emits the ``m`` rounds, given the
    values' and codes' pointers and ``pre`` and ``inv`` splat."""

    def encode(typingctx, buf, pre, inv, key, w, o, m):
        if not (isinstance(buf, types.Array) and isinstance(key, types.Array) and isinstance(w, types.Array)):
            return None
        sig = types.void(buf, types.float32, types.float32, key, w, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            buf, pre, inv, key, w, o, m = args
            bp = _data(context, builder, sig.args[0], buf)
            wp = builder.gep(_data(context, builder, sig.args[4], w), [o])
            body(context, builder, sig.args[3], key, bp, wp, _splat(builder, pre), _splat(builder, inv), m)
            return context.get_dummy_value()

        return sig, codegen

    encode.__name__, encode.__qualname__, encode.__doc__ = body.__name__, body.__name__, body.__doc__
    return intrinsic(encode)


@_encoder
def _encode_groups(context, builder, keytype, tree, bp, wp, prev, invv, m):
    """``w[o + i]`` = the code of ``(buf[i] * pre) * inv`` for ``i < 16 * m``: the number of
    midpoints below it, by the binary search over ``tree`` (:func:`eytzinger`)."""
    regs = _registers(builder, context, keytype, tree, 16)
    bits = builder.bitcast(regs[0], _I16)  # tree[0]: the integer 1 (see eytzinger)
    one = builder.shuffle_vector(bits, bits, ir.Constant(_I16, [0] * 16))

    def groups(first, count):
        bases = [builder.mul(builder.add(first, ir.Constant(_I64, u)), ir.Constant(_I64, 16)) for u in range(count)]
        ys = []
        for base in bases:
            x = builder.load(builder.bitcast(builder.gep(bp, [base]), _F16.as_pointer()), align=4)
            ys.append(builder.fmul(builder.fmul(x, prev), invv))  # quantize_scaled
        nodes = [ir.Constant(_I16, [1] * 16)] * count
        for lo, hi in _LEVEL_REGS:
            for u in range(count):
                twice = builder.add(nodes[u], nodes[u])
                t = _lookup(builder, regs[lo:hi], nodes[u])
                below = builder.fcmp_ordered("<", t, ys[u])
                nodes[u] = builder.select(below, builder.add(twice, one), twice)  # one masked add
        for base, node in zip(bases, nodes):  # node = 256 + code: its low byte
            builder.store(builder.trunc(node, _B16), builder.bitcast(builder.gep(wp, [base]), _B16.as_pointer()),
                          align=1)

    unroll = ir.Constant(_I64, GROUPS)
    full = builder.udiv(m, unroll)
    with cgutils.for_range(builder, full) as loop:
        groups(builder.mul(loop.index, unroll), GROUPS)
    with cgutils.for_range(builder, builder.urem(m, unroll)) as loop:
        groups(builder.add(builder.mul(full, unroll), loop.index), 1)


@_jit
def eytzinger(mid, tree):
    """``tree`` (float32[256]) = the padded midpoints ``mid`` in Eytzinger order: node ``(1 << l) + r``
    of level ``l`` holds ``mid[(2 r + 1) * 2**(7 - l) - 1]``, the midpoint its search step compares."""
    # node 0 is never looked up: it holds the integer 1 (its float32 bits), a 1 the compiler cannot
    # see, so that the search's step ``2 node + (t < y)`` compiles to one masked add where a
    # constant 1 compiled to three instructions (a mask turned into a vector, shifted, or-ed)
    tree[0] = bits_f32(np.uint32(1))
    for level in range(8):
        half = 128 >> level
        for r in range(1 << level):
            tree[(1 << level) + r] = mid[(2 * r + 1) * half - 1]


@_jit
def decode_block_tables(w, q, s, o, n, buf):
    """The portable decode: ``buf[i] = q[w[o + i]] * s`` for ``i < n`` by table reads."""
    wb = w[o : o + n]  # indexed from 0: no negative-index wraparound per element
    for i in range(n):
        buf[i] = q[wb[i]] * s


@_jit
def encode_block_tables(buf, n, pre, inv, mid, tbl, w, o, ix):
    """The portable encode: the scaling and bucket arithmetic in a loop of their own (vectorized),
    the two table lookups in another; ``buf`` is overwritten with the scaled values, ``ix`` (uint32
    scratch of a block) with the buckets."""
    for i in range(n):
        y = quantize_scaled(buf[i], pre, inv)
        buf[i] = y
        ix[i] = quantize_bucket(y)
    wb = w[o : o + n]
    for i in range(n):
        wb[i] = quantize_code(buf[i], tbl[ix[i]], mid)


@_jit
def decode_block_registers(w, q, s, o, n, buf):
    """:func:`decode_block_tables` with the map in registers (AVX-512F only)."""
    m = n // 16
    _decode_groups(w, np.int64(o), q, s, buf, np.int64(m))
    if m * 16 < n:
        decode_block_tables(w, q, s, o + m * 16, n - m * 16, buf[m * 16 :])


@_jit
def decode_block_planes(w, q, s, o, n, buf):
    """:func:`decode_block_tables` by byte lookups (AVX-512 VBMI; ``q`` is :func:`decoder_table`'s)."""
    m = n // 64
    _decode_planes(w, np.int64(o), q, s, buf, np.int64(m))
    if m * 64 < n:
        decode_block_registers(w, q, s, o + m * 64, n - m * 64, buf[m * 64 :])


@_jit
def encode_block_registers(buf, n, pre, inv, tree, mid, tbl, w, o, ix):
    """:func:`encode_block_tables` by the register search over ``tree`` (AVX-512F only; ``buf`` is
    left as it was for the groups of 16, scaled for the rest)."""
    m = n // 16
    _encode_groups(buf, pre, inv, tree, w, np.int64(o), np.int64(m))
    if m * 16 < n:
        encode_block_tables(buf[m * 16 :], n - m * 16, pre, inv, mid, tbl, w, o + m * 16, ix)


# ---- the packed words: one table read per value
#
# The contract's count by one 32-bit word per bucket of |y| and sign (``WORDS`` of them), the
# unsigned map's packed words of :mod:`optirs.backends.common.formats` (``packed_word``) extended
# to negative values, so that one form serves both maps and every float32. With ``a`` the bits of
# |y| clamped to the buckets' range (``_LOWB`` .. ``_TOPB``: the first and last bucket hold no
# midpoint, so the clamp changes no count) and ``top`` = a >> 16:
#
# - y >= 0: word = ((c - top) << 16) + (0xFFFF - low16(mid[c])), code = (word + a) >> 16: ``c`` the
#   midpoints below the bucket, plus the carry out of the low 16 bits exactly when mid[c] < y;
# - y < 0 (and NaN, which codes as 0: the last negative bucket, no midpoint below it): word =
#   ((c + top + 1) << 16) + low16(-mid[c]) - 1, code = (word - a) >> 16: ``c`` the midpoints below
#   the bucket's lowest value (its largest magnitude, negated), plus one unless the borrow out of
#   the low 16 bits says |y| >= -mid[c], that is mid[c] >= y.
#
# (low16 taken as 0 where mid[c] lies outside the bucket.) Per 16 values: about 12 integer
# instructions and one ``vpgatherdd`` from a table of 23 KiB, against the search's 8 dependent
# levels (54 instructions, most of them on the shuffle port).
_FIRST = LO - 1
_LOWB = _FIRST << 16  # bits of bucket 0's lowest magnitude: smaller ones share its word
_TOPB = (HI + 1) << 16  # the last bucket's: larger ones, inf and NaN share it
WORDS = 2 * WIDTH


@_jit
def packed_words(mid, tbl, words):
    """``words`` (uint32[WORDS]) = the packed words of the padded midpoints ``mid`` and their bucket
    table ``tbl`` (:mod:`optirs.backends.common.int8_buckets`): positive buckets, then negative ones.
    The dynamic maps' midpoints lie above 2**-23 and below 1 in magnitude: the first and last
    buckets, into which the encoders clamp smaller and larger values, hold none."""
    for b in range(WIDTH):
        top = b + _FIRST
        c = np.int64(tbl[b])
        m = np.int64(f32_bits(mid[c]))
        low = 0xFFFF - (m & 0xFFFF) if m >> 16 == top else 0
        words[b] = np.uint32((((c - top) << 16) + low) & 0xFFFFFFFF)
        c = np.int64(tbl[WIDTH + b])
        m = np.int64(f32_bits(mid[c]))
        low = m & 0xFFFF if m >> 16 == top | 0x8000 else 0
        words[WIDTH + b] = np.uint32((((c + top + 1) << 16) + low - 1) & 0xFFFFFFFF)


def _v(x):
    return ir.Constant(_I16, [x & 0xFFFFFFFF] * 16)


@_encoder
def _encode_gathers(context, builder, keytype, words, bp, wp, prev, invv, m):
    """``w[o + i]`` = the code of ``(buf[i] * pre) * inv`` for ``i < 16 * m``, by the packed words
    ``words`` (:func:`packed_words`), one ``vpgatherdd`` per 16 values."""
    # the index's bucket offset (top - _FIRST) folded into the table's address
    base = builder.gep(_data(context, builder, keytype, words), [ir.Constant(_I64, -_FIRST)])
    base = builder.bitcast(base, _P8)
    gather = _function(builder, "llvm.x86.avx512.mask.gather.dpi.512", _I16,
                       [_I16, _P8, _I16, _V16, ir.IntType(32)])
    with cgutils.for_range(builder, m) as loop:
        at = builder.mul(loop.index, ir.Constant(_I64, 16))
        x = builder.load(builder.bitcast(builder.gep(bp, [at]), _F16.as_pointer()), align=4)
        u = builder.bitcast(builder.fmul(builder.fmul(x, prev), invv), _I16)  # quantize_scaled
        mag = builder.and_(u, _v(0x7FFFFFFF))
        # all ones for a negative value or a NaN (0x7F800000 - |u| is negative only for a NaN)
        neg = builder.ashr(builder.or_(u, builder.sub(_v(0x7F800000), mag)), _v(31))
        a = builder.select(builder.icmp_unsigned("<", mag, _v(_LOWB)), _v(_LOWB), mag)
        a = builder.select(builder.icmp_unsigned(">", a, _v(_TOPB)), _v(_TOPB), a)
        index = builder.add(builder.lshr(a, _v(16)), builder.and_(neg, _v(WIDTH)))
        signed_a = builder.sub(builder.xor(a, neg), neg)  # a, or -a for the negative words
        word = builder.call(gather, [ir.Constant(_I16, [0] * 16), base, index, ir.Constant(_V16, [1] * 16),
                                     ir.Constant(ir.IntType(32), 4)])
        code = builder.lshr(builder.add(word, signed_a), _v(16))
        builder.store(builder.trunc(code, _B16), builder.bitcast(builder.gep(wp, [at]), _B16.as_pointer()), align=1)


# ---- the byte planes: no table read at all (AVX-512 VBMI)
#
# The contract's count ``c + (mid[c] < y)`` (c the midpoints below the bucket's lowest value, the
# bucket holding at most one midpoint: then it is mid[c]) needs no 2947 buckets of 7 mantissa bits:
# an octave of |y| needs as many mantissa bits as its midpoints are dense, none (one bucket) for
# most of the dynamic maps' 24 octaves from 2**-23 to 1, at most 6 or 7 for the top ones. With the
# octave's bits chosen so (``_PLANES_SHIFT``: the mantissa's top 7 bits shifted right by 0..7), the
# buckets of both signs are 436 (signed map) and 464 (unsigned), one uint8 ``c`` each: 8 zmm of
# bytes, looked up 64 values at a time by four ``vpermi2b`` and three selects on the index's bits 7
# and 8. ``mid[c]`` is then the decode's lookup of byte planes (16 zmm of the padded midpoints'
# bytes). The index is the float's top 16 bits (sign, exponent, 7 mantissa bits) computed in 16-bit
# lanes: one ``vpermi2w`` from a 64-word table by octave and sign gives the octave's first bucket
# and shift. NaN is made -inf first (``vmaxps`` returns its second operand for a NaN): code 0.
_PLANES_OCTAVES = 24  # exponents 104..127: magnitudes from 2**-23 (smaller ones clamped into it) to 1
_PLANES_BUCKETS = 512  # c entries the eight registers hold
_PLANES_C = 128  # byte offsets in the key: the 64 octave words, c, then the midpoints' byte planes
_PLANES_MID = _PLANES_C + _PLANES_BUCKETS
PLANES_KEY = _PLANES_MID + 1024
_PLANES_SHIFT = 12  # an octave word is first bucket | shift << 12


@_jit
def _planes_bounds(sg, top):
    """(lowest, highest) value of the 16-bit bucket range ``top`` = (first, last) top-16 bits of |y|,
    sign ``sg``, with the clamped magnitudes (below 2**-23, from 1 up) counted in."""
    lo, hi = top
    small = bits_f32(np.uint32(lo << 16)) if lo > LO else np.float32(0)
    large = bits_f32(np.uint32((hi << 16) | 0xFFFF)) if hi < HI else np.float32(np.inf)
    if sg == 0:
        return small, large
    return -large, -small


@_jit
def planes_key(mid, key):
    """``key`` (uint8[PLANES_KEY]) = the byte planes encoder's table of the padded midpoints ``mid``:
    64 octave words (little-endian uint16: ``(exponent + 24 sign) % 64`` gives the octave's first
    bucket | its shift << 12), 512 bucket counts ``c``, then the bytes of ``mid`` by plane (as
    :func:`decoder_table`'s). Each octave takes the fewest buckets that hold one midpoint each."""
    key[:] = 0
    m = mid[:255]
    off = 0
    for sg in range(2):
        for ex in range(104, 104 + _PLANES_OCTAVES):
            sh = 7
            while True:
                fits = True
                for j in range(128 >> sh):
                    lo = (ex << 7) | (j << sh)
                    a, b = _planes_bounds(sg, (max(lo, LO), min(lo + (1 << sh) - 1, HI)))
                    if np.searchsorted(m, b, side="right") - np.searchsorted(m, a, side="left") > 1:
                        fits = False
                if fits or sh == 0:
                    break
                sh -= 1
            if off + (128 >> sh) > _PLANES_BUCKETS:
                raise InvalidParameterError("the midpoints need more than 512 buckets of the byte planes encoder")
            word = off | (sh << _PLANES_SHIFT)
            at = 2 * ((ex + 24 * sg) % 64)
            key[at] = word & 0xFF
            key[at + 1] = word >> 8
            for j in range(128 >> sh):
                lo = (ex << 7) | (j << sh)
                a, b = _planes_bounds(sg, (max(lo, LO), min(lo + (1 << sh) - 1, HI)))
                key[_PLANES_C + off + j] = np.searchsorted(m, a, side="left")
            off += 128 >> sh
    for k in range(256):
        u = f32_bits(mid[k])
        for b in range(4):
            key[_PLANES_MID + 256 * b + k] = (u >> (8 * b)) & 0xFF


def _w(x):
    return ir.Constant(_W32, [x & 0xFFFF] * 32)


def _b(x):
    return ir.Constant(_B64, [x & 0xFF] * 64)


@_encoder
def _encode_planes(context, builder, keytype, key, bp, wp, prev, invv, m):
    """``w[o + i]`` = the code of ``(buf[i] * pre) * inv`` for ``i < 64 * m``, by lookups in registers
    of :func:`planes_key`'s tables (no memory read but the values)."""
    kp = builder.bitcast(_data(context, builder, keytype, key), _B64.as_pointer())
    regs = [builder.load(builder.gep(kp, [ir.Constant(_I64, k)]), align=1) for k in range(26)]
    octaves = [builder.bitcast(r, _W32) for r in regs[:2]]
    counts = regs[2:10]
    planes = [[regs[10 + 4 * j + r] for r in range(4)] for j in range(4)]
    two_b = _function(builder, "llvm.x86.avx512.vpermi2var.qi.512", _B64, [_B64, _B64, _B64])
    two_w = _function(builder, "llvm.x86.avx512.vpermi2var.hi.512", _W32, [_W32, _W32, _W32])
    fmax = _function(builder, "llvm.x86.avx512.max.ps.512", _F16, [_F16, _F16, ir.IntType(32)])
    minus_inf = ir.Constant(_F16, [float("-inf")] * 16)
    with cgutils.for_range(builder, m) as loop:
        at = builder.mul(loop.index, ir.Constant(_I64, 64))
        ys = []
        for g in range(4):
            x = builder.load(builder.bitcast(builder.gep(bp, [builder.add(at, ir.Constant(_I64, 16 * g))]),
                                             _F16.as_pointer()), align=4)
            y = builder.fmul(builder.fmul(x, prev), invv)  # quantize_scaled
            # a NaN becomes -inf (the second operand): code 0, as the count gives it
            ys.append(builder.call(fmax, [y, minus_inf, ir.Constant(ir.IntType(32), 4)]))
        index = []
        for h in range(2):  # the top 16 bits of 32 values
            a, b = (builder.bitcast(v, _W32) for v in ys[2 * h : 2 * h + 2])
            t = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 32),
                                                         [2 * i + 1 for i in range(32)]))
            neg = builder.ashr(t, _w(15))
            mag = builder.and_(t, _w(0x7FFF))
            mag = builder.select(builder.icmp_unsigned("<", mag, _w(LO)), _w(LO), mag)
            mag = builder.select(builder.icmp_unsigned(">", mag, _w(HI)), _w(HI), mag)
            octave = builder.add(builder.lshr(mag, _w(7)), builder.and_(neg, _w(24)))  # taken mod 64
            word = builder.call(two_w, [octaves[0], octave, octaves[1]])
            shift = builder.and_(builder.lshr(word, _w(_PLANES_SHIFT)), _w(7))
            # the bucket in bits 0-8 (the word's shift in bits 12-14 does not reach them)
            index.append(builder.add(word, builder.lshr(builder.and_(mag, _w(127)), shift)))
        lows = builder.shuffle_vector(builder.bitcast(index[0], _B64), builder.bitcast(index[1], _B64),
                                      ir.Constant(ir.VectorType(ir.IntType(32), 64), [2 * i for i in range(64)]))
        b8 = [builder.icmp_unsigned("!=", builder.and_(v, _w(256)), _w(0)) for v in index]
        b8 = builder.shuffle_vector(b8[0], b8[1], ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(64))))
        b7 = builder.icmp_signed("<", lows, _b(0))
        parts = [builder.call(two_b, [counts[2 * k], lows, counts[2 * k + 1]]) for k in range(4)]
        c = builder.select(b8, builder.select(b7, parts[3], parts[2]), builder.select(b7, parts[1], parts[0]))
        mids = _planes_lookup(builder, (planes, two_b), c)
        above = [builder.fcmp_ordered("<", mv, y) for mv, y in zip(mids, ys)]
        above = [builder.shuffle_vector(above[2 * h], above[2 * h + 1],
                                        ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32))))
                 for h in range(2)]
        above = builder.shuffle_vector(above[0], above[1],
                                       ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(64))))
        code = builder.add(c, builder.zext(above, _B64))
        builder.store(code, builder.bitcast(builder.gep(wp, [at]), _B64.as_pointer()), align=1)


@_jit
def encode_block_planes(buf, n, pre, inv, key, mid, tbl, w, o, ix):
    """:func:`encode_block_tables` by lookups in registers of :func:`planes_key`'s tables (AVX-512
    VBMI; ``buf`` is left as it was for the groups of 64, scaled for the rest)."""
    m = n // 64
    _encode_planes(buf, pre, inv, key, w, np.int64(o), np.int64(m))
    if m * 64 < n:
        encode_block_tables(buf[m * 64 :], n - m * 64, pre, inv, mid, tbl, w, o + m * 64, ix)


def _gathers_setup(context, builder, aryty, q):
    gather = _function(builder, "llvm.x86.avx512.mask.gather.dps.512", _F16, [_F16, _P8, _I16, _V16, ir.IntType(32)])
    return builder.bitcast(_data(context, builder, aryty, q), _P8), gather


# _decode_groups by one vgatherdps from q per 16 codes
_decode_gathers = _decoder(
    "_decode_gathers", 16, _gathers_setup,
    lambda builder, made, codes: [builder.call(made[1], [ir.Constant(_F16, [0.0] * 16), made[0], builder.zext(codes, _I16),
                                                         ir.Constant(_V16, [1] * 16), ir.Constant(ir.IntType(32), 4)])])


@_jit
def encode_block_gathers(buf, n, pre, inv, words, mid, tbl, w, o, ix):
    """:func:`encode_block_tables` by the packed words ``words`` (:func:`packed_words`), one gather per
    16 values (AVX-512F only; ``buf`` is left as it was for the groups of 16, scaled for the rest)."""
    m = n // 16
    _encode_gathers(buf, pre, inv, words, w, np.int64(o), np.int64(m))
    if m * 16 < n:
        encode_block_tables(buf[m * 16 :], n - m * 16, pre, inv, mid, tbl, w, o + m * 16, ix)


@_jit
def decode_block_gathers(w, q, s, o, n, buf):
    """:func:`decode_block_tables` by gathers (AVX-512F only)."""
    m = n // 16
    _decode_gathers(w, np.int64(o), q, s, buf, np.int64(m))
    if m * 16 < n:
        decode_block_tables(w, q, s, o + m * 16, n - m * 16, buf[m * 16 :])


# The forms the cpu loops use. With AVX-512F the decode keeps the map in registers and the encode
# reads the packed words by gathers; with VBMI the decode looks up byte planes in registers, and so
# does the encode where gathers are slow (docs/benchmarks.md: the byte-plane decode is the fastest
# on Zen 4 and on the H200 host's Xeon; the gathered encode is faster than the search on both, the
# byte planes' faster than the gathers on Zen 4 and slower on the Xeon). OPTIRS_CPU_INT8_ENCODE and
# OPTIRS_CPU_INT8_DECODE pick the others on a cpu where they may win (for measuring: the codes and
# values are the same).
ENCODE = (os.environ.get("OPTIRS_CPU_INT8_ENCODE", "planes" if VBMI and GATHERS_SLOW else "gathers")
          if NATIVE else "tables")
DECODE = (os.environ.get("OPTIRS_CPU_INT8_DECODE", "planes" if VBMI else "registers") if NATIVE else "tables")
if ENCODE not in ("planes", "gathers", "search", "tables") or DECODE not in (
        "planes", "registers", "gathers", "tables") or ("planes" in (ENCODE, DECODE) and not VBMI):
    raise InvalidParameterError(f"OPTIRS_CPU_INT8_ENCODE={ENCODE!r}, OPTIRS_CPU_INT8_DECODE={DECODE!r}: expected "
                                "planes (a cpu with AVX-512 VBMI), gathers, search or tables, and planes, "
                                "registers, gathers or tables")

if DECODE == "planes":
    decode_block = decode_block_planes
elif DECODE == "registers":
    decode_block = decode_block_registers
elif DECODE == "gathers":
    decode_block = decode_block_gathers
else:
    decode_block = decode_block_tables

@_jit
def _fill_planes(mid, tbl, key):
    planes_key(mid, key)


@_jit
def _fill_words(mid, tbl, key):
    packed_words(mid, tbl, key)


@_jit
def _fill_tree(mid, tbl, key):
    eytzinger(mid, key)


def _key_maker(entries, dtype, fill):
    @_jit
    def encoder_key(mid, tbl, used):
        """The table the encode reads, made from the padded midpoints ``mid`` and the bucket table
        ``tbl`` of a map (empty for an unused slot)."""
        key = np.zeros(entries if used else 0, dtype)
        if used:
            fill(mid, tbl, key)
        return key

    return encoder_key


# each AVX-512 encoder's table: the byte planes encoder's, the packed words, the midpoints in search order
ENCODER_KEYS = {"planes": _key_maker(PLANES_KEY, np.uint8, _fill_planes),
                "gathers": _key_maker(WORDS, np.uint32, _fill_words),
                "search": _key_maker(256, np.float32, _fill_tree)}


def encoder_keys(mid: np.ndarray, tbl: np.ndarray) -> dict:
    """Every encoder's table for one map, by form (for checks and benchmarks that run each form)."""
    return {form: make(np.asarray(mid, np.float32), tbl, True) for form, make in ENCODER_KEYS.items()}


encoder_key = ENCODER_KEYS["search" if ENCODE == "tables" else ENCODE]  # the tables' encode reads none
if ENCODE == "planes":
    encode_block = encode_block_planes
elif ENCODE == "gathers":
    encode_block = encode_block_gathers
elif ENCODE == "search":
    encode_block = encode_block_registers
else:

    @_jit
    def encode_block(buf, n, pre, inv, key, mid, tbl, w, o, ix):
        encode_block_tables(buf, n, pre, inv, mid, tbl, w, o, ix)
