"""Source generation for fusion plans: one kernel per group, as text in each dialect.

A group becomes a :class:`KernelSpec` (what to load, compute and store for one element of the
group's iteration domain), then source text in the dialects of
:data:`optirs.plugin.hookspecs.FUSION_DIALECTS`:

* Python for numba: the same per-element body inside a ``numba.prange`` loop
  (``numba-parallel``) or a grid-stride loop (``numba-cuda``);
* OpenCL C (``opencl-c``), whose helpers come in by ``#include``.

The texts name no sizes (the domain's dimensions and an operand's broadcast strides are
arguments), so a backend can cache compiled kernels by text: groups with the same structure
share one kernel, within a plan and across plans. Operands are loaded once per element: one
whose shape equals the domain by flat index, a one-element operand at index 0, any other
broadcast operand through its strides (0 along broadcast axes). Sums accumulate in float64 and
are rounded to the output dtype once; max keeps numpy's NaN propagation.

Reductions: over one axis, one loop iteration (thread) per output element walks the reduced
axis; over all axes, chunks are reduced in parallel into float64 partials that one final
step combines (a second, one-thread kernel ``finish_`` in the numba-cuda and opencl-c dialects).

The generated program names these functions the backend provides in its namespace:
``mul_f32``/``mul_f64`` (products never contracted into an fma), ``f32``/``f64``/``bool`` (casts),
``math``, ``np``, ``prange`` (numba-parallel) and ``cuda`` (numba-cuda).

Compiling and running the texts is the backends' ``fusion`` capability; this module only writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from optirs.analysis.fusion.graph import FusionGraph, FusionOp, OpKind
from optirs.analysis.fusion.ops import OPENCL_HEADERS, OPENCL_HEADERS_FP64, OPS
from optirs.analysis.fusion.planner import FusionGroup, FusionPlan
from optirs.plugin.hookspecs import FusedGroupSource, FusedKernelText

NUMBA_PARALLEL, NUMBA_CUDA, OPENCL_C = "numba-parallel", "numba-cuda", "opencl-c"
# Elements per chunk of an all-axes reduction: enough work per chunk to hide the loop's cost.
REDUCE_CHUNK = 1 << 16


# ================================================================ the language-neutral spec


@dataclass(frozen=True)
class Load:
    value: str
    dtype: np.dtype
    mode: str  # "full", "scalar" or "strided"
    strides: Tuple[int, ...]  # element strides along the domain's axes (strided mode)


@dataclass(frozen=True)
class Step:
    out: str  # value name computed
    op: str  # vocabulary op
    args: Tuple[Any, ...]  # value names or constants
    dtype: np.dtype  # result dtype
    compute: np.dtype  # dtype the operands are cast to


@dataclass(frozen=True)
class Reduce:
    out: str
    kind: str  # "sum" or "max"
    arg: str
    dtype: np.dtype


@dataclass(frozen=True)
class KernelSpec:
    domain: Tuple[int, ...]
    loads: Tuple[Load, ...]
    steps: Tuple[Step, ...]
    stores: Tuple[str, ...]  # elementwise values written at the element's flat index
    reduces: Tuple[Reduce, ...]
    layout: Optional[Tuple[int, int, int]]  # (A, K, B) for a one-axis reduction
    dtypes: Dict[str, np.dtype]


def kernel_spec(graph: FusionGraph, group: FusionGroup) -> KernelSpec:
    """What one element of ``group`` loads, computes and stores."""
    domain = tuple(group.domain)
    dtypes = {v: graph.dtype(v) for v in group.inputs + group.ops}
    loads = []
    for v in group.inputs:
        shape = graph.shape(v)
        size = math.prod(shape)
        if size == 1:
            mode = "scalar"
        elif size == math.prod(domain) and tuple(np.broadcast_shapes(shape, domain)) == domain:
            mode = "full"  # equal up to size-1 axes, so flat indices coincide
        else:
            mode = "strided"
        aligned = (1,) * (len(domain) - len(shape)) + tuple(shape)
        c_strides = [0] * len(aligned)
        acc = 1
        for k in reversed(range(len(aligned))):
            c_strides[k] = 0 if aligned[k] == 1 else acc
            acc *= aligned[k]
        loads.append(Load(v, graph.dtype(v), mode, tuple(c_strides)))
    steps, reduces = [], []
    for name in group.ops:
        op: FusionOp = graph[name]
        if op.kind is OpKind.REDUCTION:
            reduces.append(Reduce(name, op.op, op.inputs[0], op.dtype))
        elif op.kind is OpKind.BROADCAST:
            steps.append(Step(name, "copy", (op.inputs[0],), op.dtype, op.dtype))
        else:
            spec = OPS[op.op]
            named = [graph.dtype(v) for v in op.inputs[(1 if spec.typing == "select" else 0):] if isinstance(v, str)]
            compute = np.result_type(*named)
            steps.append(Step(name, op.op, tuple(op.inputs), op.dtype, compute))
    stores = tuple(v for v in group.outputs if graph[v].kind is not OpKind.REDUCTION)
    layout = None
    if reduces:
        axes = group.reduce_axes
        if len(axes) == len(domain):
            layout = None  # all axes: chunked
        else:
            (ax,) = axes
            layout = (math.prod(domain[:ax]), domain[ax], math.prod(domain[ax + 1:]))
    return KernelSpec(domain, tuple(loads), tuple(steps), stores, tuple(reduces), layout, dtypes)


# ================================================================ per-element bodies


class _Lang:
    """How one language spells literals, casts and statements."""

    py: bool

    def literal(self, x: float, dt: np.dtype) -> str: ...
    def cast(self, expr: str, dt: np.dtype) -> str: ...
    def assign(self, var: str, expr: str, dt: np.dtype) -> str: ...


class _Py(_Lang):
    py = True

    def literal(self, x, dt):
        f = {"f": "f64" if dt == np.float64 else "f32"}.get(dt.kind)
        x = float(dt.type(x))
        if math.isnan(x):
            body = "math.nan"
        elif math.isinf(x):
            body = "math.inf" if x > 0 else "-math.inf"
        else:
            body = repr(x)
        return f"{f}({body})"

    def cast(self, expr, dt):
        return f"{ {'f': 'f64' if dt == np.float64 else 'f32', 'b': 'bool'}[dt.kind]}({expr})"

    def assign(self, var, expr, dt):
        return f"{var} = {expr}"


class _Cl(_Lang):
    py = False

    @staticmethod
    def ctype(dt: np.dtype) -> str:
        return {"float32": "float", "float64": "double", "bool": "int"}[str(dt)]

    def literal(self, x, dt):
        x = float(dt.type(x))
        suffix = "f" if dt == np.float32 else ""
        if math.isnan(x):
            return f"(({self.ctype(dt)})NAN)"
        if math.isinf(x):
            return f"(({self.ctype(dt)})({'' if x > 0 else '-'}INFINITY))"
        return f"(({self.ctype(dt)}){float.hex(x)}{suffix})"

    def cast(self, expr, dt):
        return f"(({self.ctype(dt)})({expr}))"

    def assign(self, var, expr, dt):
        return f"{self.ctype(dt)} {var} = {expr};"


def _body(spec: KernelSpec, lang: _Lang, idx: str) -> Tuple[List[str], Dict[str, str]]:
    """Statements computing every value of one element; returns them and value -> variable."""
    lines: List[str] = []
    var: Dict[str, str] = {}
    strided = [ld for ld in spec.loads if ld.mode == "strided"]
    if strided:
        nd = len(spec.domain)
        # unravel the flat index into coordinates, last axis fastest (C order); every name is
        # assigned once (numba's parfor pass rejects reassigning a name derived from the index)
        q = idx
        for k in reversed(range(nd)):
            d = f"dims[{k}]" if lang.py else f"d{k}"
            if k == 0:
                lines.append(f"c0_ = {q}" if lang.py else f"long c0_ = {q};")
            else:
                lines.append(f"c{k}_ = {q} % {d}" if lang.py else f"long c{k}_ = {q} % {d};")
                lines.append(f"q{k}_ = {q} // {d}" if lang.py else f"long q{k}_ = {q} / {d};")
                q = f"q{k}_"
    for j, ld in enumerate(spec.loads):
        name = f"in{j}"
        if ld.mode == "full":
            at = idx
        elif ld.mode == "scalar":
            at = "0"
        else:
            terms = [f"c{k}_ * {('st%d[%d]' % (j, k)) if lang.py else ('s%d_%d' % (j, k))}"
                     for k in range(len(spec.domain)) if ld.strides[k] != 0]
            at = " + ".join(terms) or "0"
        expr = f"{name}[{at}]"
        if not lang.py and ld.dtype.kind == "b":
            expr = f"({expr} != 0)"
        var[ld.value] = f"x{j}"
        lines.append(lang.assign(f"x{j}", expr, ld.dtype))
    for k, st in enumerate(spec.steps):
        out = f"t{k}"
        if st.op == "copy":
            lines.append(lang.assign(out, var[st.args[0]], st.dtype))
            var[st.out] = out
            continue
        opspec = OPS[st.op]
        args = []
        for pos, a in enumerate(st.args):
            if isinstance(a, str):
                dt = spec.dtypes[a]
                want = np.dtype(np.bool_) if (opspec.typing == "select" and pos == 0) else st.compute
                args.append(var[a] if dt == want else _tmp_cast(lines, lang, var[a], want, f"{out}_a{pos}"))
            else:
                args.append(lang.literal(a, st.compute))
        lines.extend(_apply(opspec, args, st.compute, st.dtype, lang, out))
        var[st.out] = out
    return lines, var


def _tmp_cast(lines: List[str], lang: _Lang, src: str, dt: np.dtype, name: str) -> str:
    lines.append(lang.assign(name, lang.cast(src, dt), dt))
    return name


def _apply(opspec, args: List[str], compute: np.dtype, result: np.dtype, lang: _Lang, out: str) -> List[str]:
    """Statements assigning ``out`` = op(args); composite ops expand into their steps."""
    fill = {"zero": lang.literal(0.0, compute), "one": lang.literal(1.0, compute),
            "T": "float" if compute == np.float32 else "double",
            "mul": "mul_f32" if compute == np.float32 else "mul_f64"}
    if opspec.steps:
        lines, prev = [], None
        for s, (name, picks) in enumerate(opspec.steps):
            sub = [prev if p == -1 else args[p] for p in picks]
            tmp = out if s == len(opspec.steps) - 1 else f"{out}_s{s}"
            lines.extend(_apply(OPS[name], sub, compute, compute, lang, tmp))
            prev = tmp
        return lines
    template = opspec.numba if lang.py else opspec.opencl
    return [lang.assign(out, template.format(*args, **fill), result)]


# ================================================================ numba (cpu and cuda)


def _py_source(spec: KernelSpec, dialect: str) -> Tuple[str, List[str]]:
    """(source of a function named ``kernel_``, its parameter names)."""
    params = ["n"]
    strided = [j for j, ld in enumerate(spec.loads) if ld.mode == "strided"]
    if strided:
        params.append("dims")
        params += [f"st{j}" for j in strided]
    params += [f"in{j}" for j in range(len(spec.loads))]
    params += [f"out{j}" for j in range(len(spec.stores))]
    params += [f"red{j}" for j in range(len(spec.reduces))]

    def element(ind: str, idx: str) -> List[str]:
        lines, var = _body(spec, _Py(), idx)
        lines += [f"out{j}[{idx}] = {var[v]}" for j, v in enumerate(spec.stores)]
        return [ind + ln for ln in lines], var

    def acc_init(r: Reduce) -> str:
        return "f64(0.0)" if r.kind == "sum" else "-math.inf"

    def acc_update(j: int, r: Reduce, val: str) -> str:
        if r.kind == "sum":
            return f"acc{j} += f64({val})"
        return f"acc{j} = {val} if ({val} > acc{j} or {val} != {val}) else acc{j}"

    def final(j: int, r: Reduce) -> str:
        return f"{'f64' if r.dtype == np.float64 else 'f32'}(acc{j})"

    src: List[str] = []
    extra: List[str] = []
    if dialect == NUMBA_PARALLEL:
        if not spec.reduces:
            src += ["    for i in prange(n):"]
            src += element("        ", "i")[0]
        elif spec.layout is not None:
            src += ["    A_, K_, B_ = layout", "    for o in prange(A_ * B_):", "        a_ = o // B_", "        b_ = o - a_ * B_"]
            src += [f"        acc{j} = {acc_init(r)}" for j, r in enumerate(spec.reduces)]
            src += ["        for k_ in range(K_):", "            i = (a_ * K_ + k_) * B_ + b_"]
            lines, var = element("            ", "i")
            src += lines
            src += [f"            {acc_update(j, r, var[r.arg])}" for j, r in enumerate(spec.reduces)]
            src += [f"        red{j}[o] = {final(j, r)}" for j, r in enumerate(spec.reduces)]
            params.insert(1, "layout")
        else:
            src += ["    nchunk = (n + chunk - 1) // chunk"]
            src += [f"    part{j} = np.empty(max(nchunk, 1), np.float64)" for j in range(len(spec.reduces))]
            src += [f"    part{j}[0] = {acc_init(r)}" for j, r in enumerate(spec.reduces)]
            src += ["    for c_ in prange(nchunk):", "        lo_ = c_ * chunk", "        hi_ = min(lo_ + chunk, n)"]
            src += [f"        acc{j} = {acc_init(r)}" for j, r in enumerate(spec.reduces)]
            src += ["        for i in range(lo_, hi_):"]
            lines, var = element("            ", "i")
            src += lines
            src += [f"            {acc_update(j, r, var[r.arg])}" for j, r in enumerate(spec.reduces)]
            src += [f"        part{j}[c_] = acc{j}" for j in range(len(spec.reduces))]
            src += [f"    acc{j} = part{j}[0]" for j in range(len(spec.reduces))]
            src += ["    for c_ in range(1, nchunk):"]
            src += [f"        p{j}_ = part{j}[c_]\n        {acc_update(j, r, f'p{j}_')}" for j, r in enumerate(spec.reduces)]
            src += [f"    red{j}[0] = {final(j, r)}" for j, r in enumerate(spec.reduces)]
            params.insert(1, "chunk")
        head = f"def kernel_({', '.join(params)}):"
        return "\n".join([head] + src) + "\n", params
    # numba-cuda: grid-stride loops
    if not spec.reduces:
        src += ["    for i in range(cuda.grid(1), n, cuda.gridsize(1)):"]
        src += element("        ", "i")[0]
    elif spec.layout is not None:
        params.insert(1, "layout")
        src += ["    A_, K_, B_ = layout", "    for o in range(cuda.grid(1), A_ * B_, cuda.gridsize(1)):",
                "        a_ = o // B_", "        b_ = o - a_ * B_"]
        src += [f"        acc{j} = {acc_init(r)}" for j, r in enumerate(spec.reduces)]
        src += ["        for k_ in range(K_):", "            i = (a_ * K_ + k_) * B_ + b_"]
        lines, var = element("            ", "i")
        src += lines
        src += [f"            {acc_update(j, r, var[r.arg])}" for j, r in enumerate(spec.reduces)]
        src += [f"        red{j}[o] = {final(j, r)}" for j, r in enumerate(spec.reduces)]
    else:
        # one thread per chunk into float64 partials; finish_ combines them with one thread
        params.insert(1, "chunk")
        params += [f"part{j}" for j in range(len(spec.reduces))]
        src += ["    nchunk = (n + chunk - 1) // chunk", "    for c_ in range(cuda.grid(1), nchunk, cuda.gridsize(1)):",
                "        lo_ = c_ * chunk", "        hi_ = min(lo_ + chunk, n)"]
        src += [f"        acc{j} = {acc_init(r)}" for j, r in enumerate(spec.reduces)]
        src += ["        for i in range(lo_, hi_):"]
        lines, var = element("            ", "i")
        src += lines
        src += [f"            {acc_update(j, r, var[r.arg])}" for j, r in enumerate(spec.reduces)]
        src += [f"        part{j}[c_] = acc{j}" for j in range(len(spec.reduces))]
        fin = ["def finish_(nchunk, " + ", ".join([f"part{j}" for j in range(len(spec.reduces))] +
                                                  [f"red{j}" for j in range(len(spec.reduces))]) + "):",
               "    if cuda.grid(1) == 0:"]
        fin += [f"        acc{j} = {acc_init(r)}" for j, r in enumerate(spec.reduces)]
        fin += ["        for c_ in range(nchunk):"]
        fin += [f"            p{j}_ = part{j}[c_]\n            {acc_update(j, r, f'p{j}_')}" for j, r in enumerate(spec.reduces)]
        fin += [f"        red{j}[0] = {final(j, r)}" for j, r in enumerate(spec.reduces)]
        extra = fin
    head = f"def kernel_({', '.join(params)}):"
    text = "\n".join([head] + src) + "\n"
    if extra:
        text += "\n\n" + "\n".join(extra) + "\n"
    return text, params


# ================================================================ OpenCL


def opencl_source(spec: KernelSpec) -> Tuple[str, List[Tuple[str, str]]]:
    """OpenCL C source of kernels ``kernel_`` (and ``finish_``) and the kernel's (kind, name) args."""
    lang = _Cl()
    fp64 = any(dt == np.float64 for dt in spec.dtypes.values()) or bool(spec.reduces)
    nd = len(spec.domain)
    args: List[Tuple[str, str]] = [("long", "n")]
    strided = [j for j, ld in enumerate(spec.loads) if ld.mode == "strided"]
    if spec.layout is not None:
        args += [("long", "A_"), ("long", "K_"), ("long", "B_")]
    elif spec.reduces:
        args += [("long", "chunk")]
    if strided:
        args += [("long", f"d{k}") for k in range(nd)]
        args += [("long", f"s{j}_{k}") for j in strided for k in range(nd)]

    def buf(dt):
        return "uchar" if dt.kind == "b" else lang.ctype(dt)

    args += [(f"__global const {buf(ld.dtype)}*", f"in{j}") for j, ld in enumerate(spec.loads)]
    args += [(f"__global {buf(spec.dtypes[v])}*", f"out{j}") for j, v in enumerate(spec.stores)]
    args += [(f"__global {lang.ctype(r.dtype)}*", f"red{j}") for j, r in enumerate(spec.reduces)]
    if spec.reduces and spec.layout is None:
        args += [("__global double*", f"part{j}") for j in range(len(spec.reduces))]

    def element(ind: str) -> Tuple[List[str], Dict[str, str]]:
        lines, var = _body(spec, lang, "i")
        for j, v in enumerate(spec.stores):
            dt = spec.dtypes[v]
            lines.append(f"out{j}[i] = {'(uchar)' if dt.kind == 'b' else ''}{var[v]};")
        return [ind + ln for ln in lines], var

    def upd(j, r, val):
        if r.kind == "sum":
            return f"acc{j} += (double)({val});"
        return f"acc{j} = optirs_fmax_double((double)({val}), acc{j});"

    init = {"sum": "0.0", "max": "-INFINITY"}
    body: List[str] = []
    if not spec.reduces:
        body += ["  for (long i = get_global_id(0); i < n; i += get_global_size(0)) {"]
        body += element("    ")[0] + ["  }"]
    elif spec.layout is not None:
        body += ["  for (long o = get_global_id(0); o < A_ * B_; o += get_global_size(0)) {",
                 "    long a_ = o / B_; long b_ = o - a_ * B_;"]
        body += [f"    double acc{j} = {init[r.kind]};" for j, r in enumerate(spec.reduces)]
        body += ["    for (long k_ = 0; k_ < K_; ++k_) {", "      long i = (a_ * K_ + k_) * B_ + b_;"]
        lines, var = element("      ")
        body += lines + [f"      {upd(j, r, var[r.arg])}" for j, r in enumerate(spec.reduces)] + ["    }"]
        body += [f"    red{j}[o] = ({lang.ctype(r.dtype)})acc{j};" for j, r in enumerate(spec.reduces)] + ["  }"]
    else:
        body += ["  long nchunk = (n + chunk - 1) / chunk;",
                 "  for (long c_ = get_global_id(0); c_ < nchunk; c_ += get_global_size(0)) {",
                 "    long lo_ = c_ * chunk; long hi_ = min(lo_ + chunk, n);"]
        body += [f"    double acc{j} = {init[r.kind]};" for j, r in enumerate(spec.reduces)]
        body += ["    for (long i = lo_; i < hi_; ++i) {"]
        lines, var = element("      ")
        body += lines + [f"      {upd(j, r, var[r.arg])}" for j, r in enumerate(spec.reduces)] + ["    }"]
        body += [f"    part{j}[c_] = acc{j};" for j in range(len(spec.reduces))] + ["  }"]
    headers = OPENCL_HEADERS + (OPENCL_HEADERS_FP64 if fp64 else ())
    text = "".join(f'#include "{h}"\n' for h in headers)
    text += "\n__kernel void kernel_(" + ", ".join(f"{t} {n}" for t, n in args) + ") {\n" + "\n".join(body) + "\n}\n"
    if spec.reduces and spec.layout is None:
        fa = ["long nchunk"] + [f"__global const double* part{j}" for j in range(len(spec.reduces))]
        fa += [f"__global {lang.ctype(r.dtype)}* red{j}" for j, r in enumerate(spec.reduces)]
        fb = [f"  double acc{j} = {init[r.kind]};" for j, r in enumerate(spec.reduces)]
        fb += ["  for (long c_ = 0; c_ < nchunk; ++c_) {"]
        fb += [f"    double p{j}_ = part{j}[c_]; {upd(j, r, f'p{j}_')}" for j, r in enumerate(spec.reduces)] + ["  }"]
        fb += [f"  red{j}[0] = ({lang.ctype(r.dtype)})acc{j};" for j, r in enumerate(spec.reduces)]
        text += "\n__kernel void finish_(" + ", ".join(fa) + ") {\n" + "\n".join(fb) + "\n}\n"
    return text, args


# ================================================================ the record a backend compiles


def group_source(graph: FusionGraph, group: FusionGroup) -> FusedGroupSource:
    """The kernels of one (non-opaque) group in every dialect, with its dtypes and sizes."""
    spec = kernel_spec(graph, group)
    kernels = []
    for dialect in (NUMBA_PARALLEL, NUMBA_CUDA):
        text, params = _py_source(spec, dialect)
        kernels.append(FusedKernelText(dialect, text, tuple(params)))
    text, args = opencl_source(spec)
    kernels.append(FusedKernelText(OPENCL_C, text, tuple(name for _, name in args)))
    outputs = list(spec.stores) + [r.out for r in spec.reduces]
    return FusedGroupSource(
        group=group.index,
        input_names=tuple(ld.value for ld in spec.loads),
        output_names=tuple(outputs),
        domain=tuple(spec.domain),
        input_dtypes=tuple(ld.dtype for ld in spec.loads),
        input_strides=tuple(ld.strides for ld in spec.loads),
        output_dtypes=tuple(spec.dtypes[v] for v in outputs),
        output_sizes=tuple(math.prod(graph.shape(v)) for v in outputs),
        reductions=tuple(r.kind for r in spec.reduces),
        layout=spec.layout,
        chunk=REDUCE_CHUNK,
        kernels=tuple(kernels),
    )


def cuda_source(plan: FusionPlan, group: FusionGroup) -> str:
    """The numba.cuda source generated for one group (for inspection)."""
    return _py_source(kernel_spec(plan.graph, group), NUMBA_CUDA)[0]


def cpu_source(plan: FusionPlan, group: FusionGroup) -> str:
    """The numba.njit source generated for one group."""
    return _py_source(kernel_spec(plan.graph, group), NUMBA_PARALLEL)[0]


def opencl_group_source(plan: FusionPlan, group: FusionGroup) -> str:
    """The OpenCL C source generated for one group (headers not yet inlined)."""
    return opencl_source(kernel_spec(plan.graph, group))[0]
