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
        f = ir.FloatType()
        fma = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        neg_den = builder.fsub(ir.Constant(f, -0.0), den)  # NVVM's IR predates LLVM's fneg
        y0 = builder.asm(ir.FunctionType(f, [f]), "rcp.approx.ftz.f32 $0, $1;", "=f,f", [den], side_effect=False)
        y = builder.call(fma, [builder.call(fma, [neg_den, y0, ir.Constant(f, 1.0)]), y0, y0])
        q = builder.fmul(num, y)
        r = builder.call(fma, [neg_den, q, num])
        corrected = builder.call(fma, [r, y, q])
        finite = builder.and_(builder.fcmp_ordered(">", num, ir.Constant(f, 0.0)),
                              builder.fcmp_ordered("<", num, ir.Constant(f, float("inf"))))
        return builder.select(finite, corrected, q)

    return types.float32(types.float32, types.float32), codegen
