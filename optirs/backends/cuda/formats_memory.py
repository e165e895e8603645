"""Raw-address access to 8-, 16- and 32-bit words for the formats kernels (imports numba.cuda).

The formats kernels move 8 elements per lane: 8 bfloat16/float16 values are one 16-byte load
(``ld.global.v4.u32``), 8 int8 codes or remainders one 8-byte load (``ld.global.v2.u32``), 8
float32 two 16-byte loads (:func:`optirs.backends.cuda.kernels.ld4`). Words are loaded as uint32
and split with shifts (little endian: element 0 is the low half), so no 16-bit vector type has to
survive NVPTX legalisation. Under numba's simulator device memory is host memory and the same
names read and write through ctypes, as the float32 primitives of ``kernels`` do.
"""

from __future__ import annotations

import ctypes

import numpy as np

from optirs.backends.cuda.kernels import SIMULATOR

_U32 = np.uint32

if SIMULATOR:

    def ld_u8(addr):
        return _U32(ctypes.c_uint8.from_address(int(addr)).value)

    def st_u8(addr, x):
        ctypes.c_uint8.from_address(int(addr)).value = int(x) & 0xFF

    def ld_u16(addr):
        return _U32(ctypes.c_uint16.from_address(int(addr)).value)

    def st_u16(addr, x):
        ctypes.c_uint16.from_address(int(addr)).value = int(x) & 0xFFFF

    def ld_u32(addr):
        return _U32(ctypes.c_uint32.from_address(int(addr)).value)

    def st_u32(addr, x):
        ctypes.c_uint32.from_address(int(addr)).value = int(x) & 0xFFFFFFFF

    def ld_u32x2(addr):
        v = (ctypes.c_uint32 * 2).from_address(int(addr))
        return _U32(v[0]), _U32(v[1])

    def st_u32x2(addr, a, b):
        v = (ctypes.c_uint32 * 2).from_address(int(addr))
        v[0], v[1] = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF

    def ld_u32x4(addr):
        v = (ctypes.c_uint32 * 4).from_address(int(addr))
        return _U32(v[0]), _U32(v[1]), _U32(v[2]), _U32(v[3])

    def st_u32x4(addr, a, b, c, d):
        v = (ctypes.c_uint32 * 4).from_address(int(addr))
        v[0], v[1], v[2], v[3] = (int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF, int(c) & 0xFFFFFFFF,
                                  int(d) & 0xFFFFFFFF)

else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    _GLOBAL = 1  # NVPTX global address space (plain ld.global / st.global)
    _I32 = ir.IntType(32)

    def _loader(bits: int, lanes: int):
        """An intrinsic loading ``lanes`` words of ``bits`` bits at an aligned address, each widened to uint32."""
        elt = ir.IntType(bits)
        vec = ir.VectorType(elt, lanes) if lanes > 1 else elt
        ret = types.UniTuple(types.uint32, lanes) if lanes > 1 else types.uint32
        align = bits // 8 * lanes

        @intrinsic
        def load(typingctx, addr):
            def codegen(context, builder, sig, args):
                v = builder.load(builder.inttoptr(args[0], ir.PointerType(vec, _GLOBAL)), align=align)
                if lanes == 1:
                    return builder.zext(v, _I32) if bits < 32 else v
                vals = [builder.extract_element(v, ir.Constant(_I32, i)) for i in range(lanes)]
                return context.make_tuple(builder, ret, vals)

            return ret(types.int64), codegen

        return load

    def _fit(builder, value, elt):
        width = value.type.width
        if width > elt.width:
            return builder.trunc(value, elt)
        return builder.zext(value, elt) if width < elt.width else value

    def _storer(bits: int, lanes: int):
        """An intrinsic storing ``lanes`` integers, each cut to its low ``bits`` bits, at an aligned address."""
        elt = ir.IntType(bits)
        vec = ir.VectorType(elt, lanes) if lanes > 1 else elt
        align = bits // 8 * lanes

        def codegen(context, builder, sig, args):
            vals = [_fit(builder, a, elt) for a in args[1:]]
            v = vals[0]
            if lanes > 1:
                v = ir.Constant(vec, ir.Undefined)
                for i, x in enumerate(vals):
                    v = builder.insert_element(v, x, ir.Constant(_I32, i))
            builder.store(v, builder.inttoptr(args[0], ir.PointerType(vec, _GLOBAL)), align=align)
            return context.get_dummy_value()

        def typer(*values):
            if not all(isinstance(t, types.Integer) for t in values):
                return None
            return types.void(types.int64, *values), codegen

        # numba's intrinsic takes a fixed arity: one typer per vector width
        if lanes == 1:
            return intrinsic(lambda typingctx, addr, a: typer(a))
        if lanes == 2:
            return intrinsic(lambda typingctx, addr, a, b: typer(a, b))
        return intrinsic(lambda typingctx, addr, a, b, c, d: typer(a, b, c, d))

    ld_u8, st_u8 = _loader(8, 1), _storer(8, 1)
    ld_u16, st_u16 = _loader(16, 1), _storer(16, 1)
    ld_u32, st_u32 = _loader(32, 1), _storer(32, 1)
    ld_u32x2, st_u32x2 = _loader(32, 2), _storer(32, 2)
    ld_u32x4, st_u32x4 = _loader(32, 4), _storer(32, 4)
