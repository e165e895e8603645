"""The fusion planner's op vocabulary: what each op means, once per language.

Every elementwise op has three spellings that must agree:

* ``numpy``: the reference meaning, applied array by array (the unfused evaluation);
* ``numba``: a Python expression for one element, used by the generated CPU (``numba.njit``)
  and CUDA (``numba.cuda``) kernels;
* ``opencl``: an OpenCL C expression for one element.

Templates see only names of already-computed scalars (``{0}``, ``{1}``, ``{2}``), never nested
expressions, so repeating an operand in a template is cheap and side-effect free. ``{zero}`` and
``{one}`` are typed literals of the op's compute dtype (a bare ``0.0`` would promote float32
arithmetic to float64 in numba); ``{T}`` is its C type name in OpenCL. ``maximum``/``minimum`` are spelt out so that NaN and signed
zeros come out exactly as numpy's ufuncs give them (``a if a > b or a != a else b``), which
neither Python's ``max`` nor OpenCL's ``fmax`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import numpy as np


@dataclass(frozen=True)
class OpSpec:
    """One op of the vocabulary."""

    name: str
    arity: int
    numpy: Callable
    numba: str
    opencl: str
    # "float": float operands -> their promoted float dtype; "compare": float operands -> bool;
    # "select": (bool, float, float) -> promoted float of the last two.
    typing: str = "float"
    # Correctly rounded in IEEE arithmetic (the fused result equals numpy's bit for bit);
    # the others call a libm function whose last bit may differ between implementations.
    exact: bool = True
    # A composite op is a sequence of other ops: (op, operand indices), where -1 names the
    # previous step's result; its numba/opencl templates are then unused.
    steps: tuple = ()


def _relu(x):
    return np.maximum(x, x.dtype.type(0))


def _sigmoid(x):
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


def _muladd(a, b, c):
    return a * b + c


def _clip(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


# numba templates multiply through ``mul_f32``/``mul_f64`` (a plain product on the CPU;
# libdevice's fmul_rn/dmul_rn on CUDA, where NVVM would otherwise contract a * b + c into an fma
# that rounds once, unlike numpy op by op). The backend that compiles a kernel puts them in its namespace.
_MAX_NB = "({0} if ({0} > {1} or {0} != {0}) else {1})"
_MIN_NB = "({0} if ({0} < {1} or {0} != {0}) else {1})"
_MAX_CL = "optirs_fmax_{T}({0}, {1})"
_MIN_CL = "optirs_fmin_{T}({0}, {1})"

OPS: Dict[str, OpSpec] = {
    s.name: s
    for s in (
        # ---- unary
        OpSpec("neg", 1, np.negative, "(-{0})", "(-{0})"),
        OpSpec("abs", 1, np.abs, "abs({0})", "fabs({0})"),
        OpSpec("square", 1, np.square, "{mul}({0}, {0})", "({0} * {0})"),
        OpSpec("reciprocal", 1, np.reciprocal, "({one} / {0})", "({one} / {0})"),
        OpSpec("sqrt", 1, np.sqrt, "math.sqrt({0})", "sqrt({0})"),
        OpSpec("relu", 1, _relu, "({0} if ({0} > {zero} or {0} != {0}) else {zero})", "optirs_fmax_{T}({0}, {zero})"),
        OpSpec("exp", 1, np.exp, "math.exp({0})", "exp({0})", exact=False),
        OpSpec("log", 1, np.log, "math.log({0})", "log({0})", exact=False),
        OpSpec("tanh", 1, np.tanh, "math.tanh({0})", "tanh({0})", exact=False),
        OpSpec("sin", 1, np.sin, "math.sin({0})", "sin({0})", exact=False),
        OpSpec("cos", 1, np.cos, "math.cos({0})", "cos({0})", exact=False),
        OpSpec("sigmoid", 1, _sigmoid, "({one} / ({one} + math.exp(-{0})))", "({one} / ({one} + exp(-{0})))", exact=False),
        # ---- binary
        OpSpec("add", 2, np.add, "({0} + {1})", "({0} + {1})"),
        OpSpec("sub", 2, np.subtract, "({0} - {1})", "({0} - {1})"),
        OpSpec("mul", 2, np.multiply, "{mul}({0}, {1})", "({0} * {1})"),
        OpSpec("div", 2, np.divide, "({0} / {1})", "({0} / {1})"),
        OpSpec("maximum", 2, np.maximum, _MAX_NB, _MAX_CL),
        OpSpec("minimum", 2, np.minimum, _MIN_NB, _MIN_CL),
        OpSpec("pow", 2, np.power, "math.pow({0}, {1})", "pow({0}, {1})", exact=False),
        OpSpec("greater", 2, np.greater, "({0} > {1})", "({0} > {1})", typing="compare"),
        OpSpec("less", 2, np.less, "({0} < {1})", "({0} < {1})", typing="compare"),
        OpSpec("equal", 2, np.equal, "({0} == {1})", "({0} == {1})", typing="compare"),
        # ---- ternary
        OpSpec("where", 3, np.where, "({1} if {0} else {2})", "({0} ? {1} : {2})", typing="select"),
        # a * b + c with two roundings, as numpy op by op computes it (not a single-rounding fma).
        OpSpec("muladd", 3, _muladd, "({mul}({0}, {1}) + {2})", "({0} * {1} + {2})"),
        OpSpec("clip", 3, _clip, "", "", steps=(("maximum", (0, 1)), ("minimum", (-1, 2)))),
    )
}

# The OpenCL templates call optirs_fmax_<T>/optirs_fmin_<T>, defined (with FP_CONTRACT OFF, since
# numpy rounds a * b + c twice) in the headers the generated programs include:
OPENCL_HEADERS = ("optirs_fusion.h",)
OPENCL_HEADERS_FP64 = ("optirs_fusion_fp64.h",)  # kernels that use float64 (cl_khr_fp64)

REDUCTIONS = ("sum", "max")
UNARY = tuple(n for n, s in OPS.items() if s.arity == 1)
BINARY = tuple(n for n, s in OPS.items() if s.arity == 2)
TERNARY = tuple(n for n, s in OPS.items() if s.arity == 3)
DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.bool_))
