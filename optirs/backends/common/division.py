"""``a / b`` for a divisor that is the same for every element of a launch: the GPU's division
with its reciprocal taken once, the same correctly rounded quotient.

A GPU has no division instruction: ``div.rn.f32`` compiles to a reciprocal approximation refined
by fused multiply-adds, a range check (``FCHK``) and a branch to a slow path where the check
fails, about 11 instructions an element with the branch region's own. Where the divisor is
uniform (Adam's ``sqrt(v) / sqrt(1 - beta2**t)``) the reciprocal's approximation and refinement
are the same for every element and leave the loop; what stays is the compiler's own correction
(``q = a * y``, ``r = fma(-b, q, a)``, ``q + r * y`` fused) and a select: 5 instructions.

The quotient is the compiler's fast path's, operation for operation, so it is the correctly
rounded quotient wherever the range check would have passed. The dividends here are square
roots of non-negative floats (0, or 2**-75 to 2**64, or inf or NaN) and the divisors bias
corrections in (0, 1]; 0, inf and NaN (where the correction itself would make NaN, or lose the
sign of -0) take ``a * y``, which is exact for them. On the H200 the quotient is the division's
for the square root of every non-negative float32 and ten divisors
(tests/test_formats_cuda.py); other dividends can differ (below 2**-100 the residual is
subnormal, beyond 2**64 the quotient may overflow). The cpu divides.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from optirs.backends.common.half_native import _is_cuda


def _reciprocal(builder, den):
    """The refined reciprocal of ``den`` (NVVM IR): ``rcp.approx.ftz`` and one Newton step, fused."""
    f = ir.FloatType()
    fma = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
    neg_den = builder.fsub(ir.Constant(f, -0.0), den)  # NVVM's IR predates LLVM's fneg
    y0 = builder.asm(ir.FunctionType(f, [f]), "rcp.approx.ftz.f32 $0, $1;", "=f,f", [den], side_effect=False)
    return builder.call(fma, [builder.call(fma, [neg_den, y0, ir.Constant(f, 1.0)]), y0, y0])


def _corrected(builder, num, den, y):
    """``(q, q + r * y)`` with ``q = num * y`` and ``r = fma(-den, q, num)`` (NVVM IR)."""
    f = ir.FloatType()
    fma = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
    q = builder.fmul(num, y)
    r = builder.call(fma, [builder.fsub(ir.Constant(f, -0.0), den), q, num])
    return q, builder.call(fma, [r, y, q])


def _select_finite(builder, num, q, corrected):
    f = ir.FloatType()
    finite = builder.and_(builder.fcmp_ordered(">", num, ir.Constant(f, 0.0)),
                          builder.fcmp_ordered("<", num, ir.Constant(f, float("inf"))))
    return builder.select(finite, corrected, q)


@intrinsic
def divide_by_uniform(typingctx, a, b):
    """``a / b`` (float32) for ``b`` in (0, 1], the same for every element, and ``a`` a square root
    of a non-negative float or 0, inf or NaN (the module says why the quotient is the division's)."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        num, den = args
        if not _is_cuda(context):
            return builder.fdiv(num, den)
        q, corrected = _corrected(builder, num, den, _reciprocal(builder, den))
        return _select_finite(builder, num, q, corrected)

    return types.float32(types.float32, types.float32), codegen


# The reciprocal taken once by the caller: the inline PTX of ``rcp.approx`` is not common to the
# elements as NVVM sees it, so each element's divide_by_uniform recomputed the refinement (a
# constant load and two multiply-adds an element in the formats kernels' SASS).


@intrinsic
def uniform_reciprocal(typingctx, b):
    """The reciprocal :func:`divide_by_reciprocal` takes for divisor ``b`` (a GPU's refined
    ``rcp.approx``; the cpu's is unused: it divides)."""
    if b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        if not _is_cuda(context):
            return ir.Constant(ir.FloatType(), 0.0)
        return _reciprocal(builder, args[0])

    return types.float32(types.float32), codegen


def _by_reciprocal(gpu, name: str, doc: str):
    """An intrinsic ``name(a, b, y)`` (float32, ``y = uniform_reciprocal(b)``): ``gpu(builder, a, b, y)``
    on a GPU, the division elsewhere."""

    def typer(typingctx, a, b, y):
        if a != types.float32 or b != types.float32 or y != types.float32:
            return None

        def codegen(context, builder, sig, args):
            num, den, recip = args
            if not _is_cuda(context):
                return builder.fdiv(num, den)
            return gpu(builder, num, den, recip)

        return types.float32(types.float32, types.float32, types.float32), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


divide_by_reciprocal = _by_reciprocal(
    lambda builder, num, den, recip: _corrected(builder, num, den, recip)[1], "divide_by_reciprocal",
    """``divide_by_uniform(a, b)`` for a finite positive ``a``, ``y = uniform_reciprocal(b)`` taken
    once: the corrected quotient without the select (which only 0, inf and NaN need).""")
# a times the reciprocal, within an ulp or two (no correction): the approximate step of a tuning build
times_reciprocal = _by_reciprocal(lambda builder, num, den, recip: builder.fmul(num, recip), "times_reciprocal",
                                  """``a / b`` as ``a * y`` on a GPU, the division elsewhere.""")
