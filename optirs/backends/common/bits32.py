"""32-bit unsigned integer operations for numba code on every backend.

numba types ``uint32 op uint32`` as uint64, so bit manipulation written with numpy scalars runs
in 64 bits. A GPU has no 64-bit integer unit: each 64-bit and, xor, shift or add is two
instructions and a multiply three or four, which made the format kernels issue-bound (about half
of their instructions were 64-bit). These intrinsics take any integers, truncate them to their
low 32 bits and emit the 32-bit LLVM instruction, so the result is a ``uint32`` with the same
value as the masked 64-bit arithmetic: ``mul32(a, b) == (a * b) & 0xFFFFFFFF``. Shift counts
must be below 32 (as in C). On the CPU the same narrowing doubles the lanes a vector holds.

The public names are ``@njit`` functions around the intrinsics, so that they can also be called
from Python (numba's CUDA simulator runs kernels as Python); compiled callers inline them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from optirs.core.compile_cache import cached_njit

__all__ = ["u32", "and32", "or32", "xor32", "add32", "sub32", "mul32", "shr32", "shl32", "f32_bits_cast",
           "bits_f32_cast", "lt_bit"]

_I32 = ir.IntType(32)


def _low32(builder, value, ty):
    """An integer argument of numba type ``ty`` as an LLVM i32 (its low 32 bits)."""
    width = ty.bitwidth
    if width == 32:
        return value
    if width > 32:
        return builder.trunc(value, _I32)
    return builder.sext(value, _I32) if ty.signed else builder.zext(value, _I32)


def _integers(*tys) -> bool:
    return all(isinstance(t, types.Integer) for t in tys)


@intrinsic
def _u32(typingctx, a):
    """The low 32 bits of integer ``a`` as a uint32."""
    if not _integers(a):
        return None

    def codegen(context, builder, sig, args):
        return _low32(builder, args[0], sig.args[0])

    return types.uint32(a), codegen


def _binary(op: str):
    def typer(typingctx, a, b):
        if not _integers(a, b):
            return None

        def codegen(context, builder, sig, args):
            x = _low32(builder, args[0], sig.args[0])
            y = _low32(builder, args[1], sig.args[1])
            return getattr(builder, op)(x, y)

        return types.uint32(a, b), codegen

    typer.__name__ = op
    return typer


@intrinsic
def f32_bits_cast(typingctx, x):
    """The bit pattern of float32 ``x`` as a uint32 (an LLVM bitcast: no instruction)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32_cast(typingctx, u):
    """The float32 whose bit pattern is uint32 ``u`` (an LLVM bitcast)."""
    if u != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def _is_cuda(context) -> bool:
    try:
        from numba.cuda.target import CUDATargetContext
    except ImportError:
        return False
    return isinstance(context, CUDATargetContext)


@intrinsic
def _lt_bit(typingctx, a, b):
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        if _is_cuda(context):
            # the sign of a - b: a GPU's difference is exact in sign (no flush to zero here; a == b
            # gives +0) and its NaN results are the canonical, positive NaN, so this is a < b for
            # every input; the shift then folds into the add that counts it (FADD and LEA.HI, where
            # a compare, a select and an add took three instructions). sub.rn in asm: never fused
            # with the multiply that made an operand (NVVM contracts by default, and a fused
            # a - x * y would compare with the unrounded product)
            f = ir.FloatType()
            diff = builder.asm(ir.FunctionType(f, [f, f]), "sub.rn.f32 $0, $1, $2;", "=f,f,f", args,
                               side_effect=False)
            d = builder.bitcast(diff, _I32)
            return builder.lshr(d, ir.Constant(_I32, 31))
        return builder.zext(builder.fcmp_ordered("<", *args), _I32)  # the cpu's NaN keeps its sign

    return types.uint32(types.float32, types.float32), codegen


_and = intrinsic(_binary("and_"))
_or = intrinsic(_binary("or_"))
_xor = intrinsic(_binary("xor"))
_add = intrinsic(_binary("add"))
_sub = intrinsic(_binary("sub"))
_mul = intrinsic(_binary("mul"))
_shr = intrinsic(_binary("lshr"))
_shl = intrinsic(_binary("shl"))

_jit = cached_njit(inline="always")


@_jit
def lt_bit(a, b):
    """1 where float32 ``a < b``, else 0 (a NaN compares false), as a uint32 to add to a count."""
    return _lt_bit(np.float32(a), np.float32(b))  # np.float32: the CUDA simulator's Python floats


@_jit
def u32(a):
    """The low 32 bits of integer ``a``."""
    return _u32(a)


@_jit
def and32(a, b):
    return _and(a, b)


@_jit
def or32(a, b):
    return _or(a, b)


@_jit
def xor32(a, b):
    return _xor(a, b)


@_jit
def add32(a, b):
    """``(a + b) mod 2**32``."""
    return _add(a, b)


@_jit
def sub32(a, b):
    """``(a - b) mod 2**32``."""
    return _sub(a, b)


@_jit
def mul32(a, b):
    """``(a * b) mod 2**32``."""
    return _mul(a, b)


@_jit
def shr32(a, k):
    """The low 32 bits of ``a`` shifted right (logical) by ``k`` < 32."""
    return _shr(a, k)


@_jit
def shl32(a, k):
    """The low 32 bits of ``a`` shifted left by ``k`` < 32, modulo 2**32."""
    return _shl(a, k)
