"""Square root and division by the GPU's fast paths, with the windows where they are the IEEE
operations: the per-element range checks and branches left to the caller, once per group of elements.

A GPU has neither instruction. ptxas expands ``sqrt.rn.f32`` to a reciprocal square root refined by
two fused multiply-adds, and ``div.rn.f32`` to a reciprocal refined by Newton's step and the
quotient corrected by its residual; each guards its fast path with a range check and a branch to a
slow path (``VIADD``/``ISETP`` for the square root, ``FCHK`` for the division, each inside a
``BSSY``/``BSYNC`` region): about 9 of the instructions an element pays for Adam's two operations.
:func:`sqrt_fast` and :func:`div_fast` are those fast paths alone, instruction for instruction, so
they are the IEEE results wherever the compiler's check would take them; a caller tests its inputs
against the windows below (two integer instructions per test, which can accumulate over many
elements into one flag) and redoes the group with the IEEE operations where a test fails (zeros,
tiny, huge and non-finite inputs).

- ``sqrt_fast(x)`` is ``sqrt.rn`` for x in [2**-101, 2**128), bits 0x0d000000 to 0x7f7fffff: the
  range of ptxas's own check (its fast path's reciprocal square root, product and residual are
  normal there). 0 is outside (the fast path gives NaN for it).
- ``div_fast(a, b)`` is ``div.rn`` for b in [2**-51, 2**49) and |a| in [2**-72, 2**72): there the
  reciprocal (2**-49 to 2**51), the quotient (2**-121 to 2**123) and every intermediate are normal
  and far from overflow, and the residual ``a - b * q`` of a quotient within an ulp is a multiple of
  at least 2**(e(a) - 48) >= 2**-120 below 2**24 of those units: exact. These are the conditions
  under which the compiler's sequence (the reciprocal within an ulp of 1 / b, the quotient's
  residual exact, the final correction by one fused multiply-add) is correctly rounded; the
  window keeps every exponent at least 3 binades inside the thresholds ``FCHK`` guards (denormal,
  zero, inf or NaN operands; quotients and residuals near underflow or overflow), so it accepts
  no pair where the compiler would take its slow path. 0 is outside (the fast path loses the sign
  of -0 / b).
- ``rcp_fast(x)`` is ``1 / x`` (``div.rn``, which ptxas expands as ``rcp.rn``) for x in [2**-126,
  2**126), bits 0x00800000 to 0x7dffffff: the range of ptxas's own check (normal, with a normal
  reciprocal). The int8 kernels take a block's reciprocal scale by it (one a block and slot, where
  the compiler's checks and branches about the reciprocal cost about 20 instructions a round).

- ``fma_rn(a, b, c)`` is the fused multiply-add, rounded once, on every target.

On the GPU tests/test_formats_cuda.py compares both against the IEEE operations (every float32 in
the square root's window; random pairs and the boundaries of the division's). The CPU compiles
plain ``sqrt`` and ``fdiv``: there the operations are IEEE everywhere and the windows only say
where a GPU agrees.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from optirs.backends.common.bits32 import f32_bits_cast, shl32, sub32
from optirs.backends.common.half_native import _is_cuda
from optirs.core.compile_cache import cached_njit, prepare_kernel_compilation

prepare_kernel_compilation()  # before the first decorator: numba picks the cache directory there

RCP_LO = np.uint32(0x00800000)  # 2**-126
RCP_HI = np.uint32(0x7DFFFFFF)  # below 2**126
SQRT_LO = np.uint32(0x0D000000)  # 2**-101
SQRT_HI = np.uint32(0x7F7FFFFF)  # the largest finite float32
DIVIDEND_LO = np.uint32(0x1B800000)  # |a| >= 2**-72
DIVIDEND_HI = np.uint32(0x637FFFFF)  # |a| < 2**72
DIVISOR_LO = np.uint32(0x26000000)  # b >= 2**-51
DIVISOR_HI = np.uint32(0x57FFFFFF)  # b < 2**49

_F = ir.FloatType()

# ptxas's expansions' fast paths (the SASS of sqrt.rn.f32 and div.rn.f32 on sm_90, in order); the
# negations fold into the multiply-adds
_SQRT_PTX = """{
.reg .f32 %fp_r, %fp_s, %fp_h, %fp_e, %fp_n;
rsqrt.approx.ftz.f32 %fp_r, $1;
mul.ftz.f32 %fp_s, $1, %fp_r;
mul.ftz.f32 %fp_h, %fp_r, 0f3F000000;
neg.f32 %fp_n, %fp_s;
fma.rn.f32 %fp_e, %fp_n, %fp_s, $1;
fma.rn.f32 $0, %fp_e, %fp_h, %fp_s;
}"""

_RCP_PTX = """{
.reg .f32 %fp_r, %fp_e, %fp_n;
rcp.approx.ftz.f32 %fp_r, $1;
fma.rn.f32 %fp_e, $1, %fp_r, 0fBF800000;
neg.f32 %fp_n, %fp_e;
fma.rn.f32 $0, %fp_r, %fp_n, %fp_r;
}"""

_DIV_PTX = """{
.reg .f32 %fp_y0, %fp_t, %fp_y, %fp_q, %fp_r, %fp_nb;
rcp.approx.ftz.f32 %fp_y0, $2;
neg.f32 %fp_nb, $2;
fma.rn.f32 %fp_t, %fp_nb, %fp_y0, 0f3F800000;
fma.rn.f32 %fp_y, %fp_y0, %fp_t, %fp_y0;
fma.rn.f32 %fp_q, $1, %fp_y, 0f00000000;
fma.rn.f32 %fp_r, %fp_nb, %fp_q, $1;
fma.rn.f32 $0, %fp_r, %fp_y, %fp_q;
}"""


def _sqrt_by(ptx: str, name: str, doc: str):
    """An intrinsic ``name(x)`` (float32): the root by ``ptx`` on a GPU, ``llvm.sqrt`` (IEEE) elsewhere."""

    def typer(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            if not _is_cuda(context):
                sqrt = builder.module.declare_intrinsic("llvm.sqrt", [_F], ir.FunctionType(_F, [_F]))
                return builder.call(sqrt, args)
            return builder.asm(ir.FunctionType(_F, [_F]), ptx, "=f,f", args, side_effect=False)

        return types.float32(types.float32), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


def _divide_by(ptx: str, name: str, doc: str):
    """An intrinsic ``name(a, b)`` (float32): the quotient by ``ptx`` on a GPU, the IEEE one elsewhere."""

    def typer(typingctx, a, b):
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, sig, args):
            if not _is_cuda(context):
                return builder.fdiv(*args)
            return builder.asm(ir.FunctionType(_F, [_F, _F]), ptx, "=f,f,f", args, side_effect=False)

        return types.float32(types.float32, types.float32), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


sqrt_fast = _sqrt_by(_SQRT_PTX, "sqrt_fast", """``sqrt(x)`` (float32) by the GPU's fast path: IEEE for x in
    the window of :func:`sqrt_in_window`.""")
# for a step whose root may be approximate (a tuning build): within a few ulps, subnormals flushed
sqrt_approx = _sqrt_by("sqrt.approx.ftz.f32 $0, $1;", "sqrt_approx", """``sqrt(x)`` (float32) by one
    ``sqrt.approx.ftz.f32`` on a GPU, the IEEE root elsewhere.""")


@intrinsic
def _rcp_fast(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        if not _is_cuda(context):
            return builder.fdiv(ir.Constant(_F, 1.0), args[0])
        return builder.asm(ir.FunctionType(_F, [_F]), _RCP_PTX, "=f,f", args, side_effect=False)

    return types.float32(types.float32), codegen


div_fast = _divide_by(_DIV_PTX, "div_fast", """``a / b`` (float32) by the GPU's fast path: IEEE for ``a`` in
    :func:`dividend_in_window`'s window and ``b`` in :func:`divisor_in_window`'s.""")
# a times the reciprocal (a tuning build): within 2 ulps for b in [2**-126, 2**126]
div_approx = _divide_by("div.approx.ftz.f32 $0, $1, $2;", "div_approx", """``a / b`` (float32) by
    ``div.approx.ftz.f32`` on a GPU, the IEEE quotient elsewhere.""")


@intrinsic
def max_nan(typingctx, a, b):
    """``max(a, b)`` (float32), NaN when either is: one ``max.NaN.f32`` on a GPU (sm_80 on), as cheap as
    the plain maximum, whose NaN operand is dropped. A fast step that tests a maximum against a window
    so tests both operands for NaN (the zeros' signs are left to the hardware: a window holds no zero)."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        x, y = args
        if not _is_cuda(context):
            pick = builder.or_(builder.fcmp_ordered(">", y, x), builder.fcmp_unordered("uno", y, y))
            return builder.select(pick, y, x)
        return builder.asm(ir.FunctionType(_F, [_F, _F]), "max.NaN.f32 $0, $1, $2;", "=f,f,f", args,
                           side_effect=False)

    return types.float32(types.float32, types.float32), codegen


@intrinsic
def fma_rn(typingctx, a, b, c):
    """``a * b + c`` (float32) rounded once: ``fma.rn.f32`` on a GPU, the cpu's fused multiply-add (or
    libm's ``fmaf``) elsewhere, the same bits on both."""
    if a != types.float32 or b != types.float32 or c != types.float32:
        return None

    def codegen(context, builder, sig, args):
        fma = builder.module.declare_intrinsic("llvm.fma", [_F], ir.FunctionType(_F, [_F, _F, _F]))
        return builder.call(fma, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def mul_rn(typingctx, a, b):
    """``a * b`` (float32) rounded on its own: ``mul.rn.f32`` on a GPU, which ptxas never contracts with
    a following add into a fused multiply-add (NVVM and ptxas do contract a plain product), the
    product elsewhere; the same bits on both."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        if not _is_cuda(context):
            return builder.fmul(*args)
        return builder.asm(ir.FunctionType(_F, [_F, _F]), "mul.rn.f32 $0, $1, $2;", "=f,f,f", args,
                           side_effect=False)

    return types.float32(types.float32, types.float32), codegen


@cached_njit(inline="always")
def sqrt_in_window(x, hi=SQRT_HI):
    """Whether ``sqrt_fast(x)`` is ``sqrt(x)``: x's bits in [SQRT_LO, hi] (``hi`` at most SQRT_HI; a
    caller may narrow the window to bound what it computes from the root). One subtraction and one
    unsigned compare: negative, zero, tiny, inf and NaN inputs all fall outside."""
    return sub32(f32_bits_cast(x), SQRT_LO) <= sub32(hi, SQRT_LO)


@cached_njit(inline="always")
def rcp_fast(x):
    """``1 / x`` (float32) by the GPU's fast path: IEEE for x in the window of :func:`rcp_in_window`
    (an ``@njit`` function, so that numba's CUDA simulator can call it from Python)."""
    return _rcp_fast(x)


@cached_njit(inline="always")
def rcp_in_window(x):
    """Whether ``rcp_fast(x)`` is ``1 / x``: x's bits in [RCP_LO, RCP_HI] (one subtraction and one
    unsigned compare: negative, zero, subnormal, huge, inf and NaN inputs fall outside)."""
    return sub32(f32_bits_cast(x), RCP_LO) <= sub32(RCP_HI, RCP_LO)


@cached_njit(inline="always")
def dividend_in_window(a):
    """Whether |a| is in [2**-72, 2**72), :func:`div_fast`'s window for the dividend (the sign bit
    shifted out; 0, inf and NaN fall outside)."""
    return sub32(shl32(f32_bits_cast(a), 1), shl32(DIVIDEND_LO, 1)) <= sub32(shl32(DIVIDEND_HI, 1), shl32(DIVIDEND_LO, 1))


@cached_njit(inline="always")
def divisor_in_window(b):
    """Whether b is in [2**-51, 2**49), :func:`div_fast`'s window for the divisor (positive only)."""
    return sub32(f32_bits_cast(b), DIVISOR_LO) <= sub32(DIVISOR_HI, DIVISOR_LO)
