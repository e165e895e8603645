"""Kernel generation for fusion plans: one kernel per group, for cpu, cuda and opencl.

A group becomes a :class:`KernelSpec` (what to load, compute and store for one element of the
group's iteration domain), then source text in one of two languages:

* Python for numba: the same per-element body inside a ``numba.prange`` loop
  (``numba.njit(parallel=True)``, backend ``cpu``) or a grid-stride loop (``numba.cuda.jit``,
  backend ``cuda``);
* OpenCL C (backend ``opencl``, through pyopencl).

Kernels are cached per source text: the text names no sizes (the domain's dimensions and an
operand's broadcast strides are arguments), so groups with the same structure share one
compiled kernel, within a plan and across plans. Operands are loaded once per element: one
whose shape equals the domain by flat index, a one-element operand at index 0, any other
broadcast operand through its strides (0 along broadcast axes). Sums accumulate in float64 and
are rounded to the output dtype once; max keeps numpy's NaN propagation.

Reductions: over one axis, one loop iteration (thread) per output element walks the reduced
axis; over all axes, chunks are reduced in parallel into float64 partials that one final
step combines (a second, one-thread kernel on cuda and opencl).
"""

from __future__ import annotations

import linecache
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.analysis.fusion import FusionGroup, FusionOp, FusionPlan, OpKind, _call_opaque
from optirs.analysis.fusion_ops import OPENCL_HELPERS, OPENCL_HELPERS_FP64, OPS

BACKENDS = ("cpu", "cuda", "opencl")
# Elements per chunk of an all-axes reduction: enough work per chunk to hide the loop's cost.
REDUCE_CHUNK = 1 << 16
# CUDA / OpenCL work-group size; 256 keeps any register budget of these small kernels resident.
BLOCK = 256

_CACHE: Dict[Tuple[str, str], Any] = {}
_CACHE_LOCK = threading.Lock()


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


def kernel_spec(plan: FusionPlan, group: FusionGroup) -> KernelSpec:
    graph = plan.graph
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


def _py_source(spec: KernelSpec, target: str) -> Tuple[str, List[str]]:
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
    if target == "cpu":
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
    # cuda: grid-stride loops
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


def _exec_source(text: str, tag: str, namespace: Dict[str, Any]) -> Dict[str, Any]:
    filename = f"<optirs-fusion-{tag}-{abs(hash(text)):x}>"
    # registered so that numba and tracebacks can show the generated lines
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(compile(text, filename, "exec"), namespace)
    return namespace


def _numba_types(spec: KernelSpec, params: Sequence[str]):
    from numba import types, typeof

    nd = len(spec.domain)
    sig = []
    for p in params:
        if p in ("n", "chunk"):
            sig.append(types.int64)
        elif p == "layout":
            sig.append(types.UniTuple(types.int64, 3))
        elif p == "dims" or p.startswith("st"):
            sig.append(types.UniTuple(types.int64, nd))
        else:
            j = int(re.sub(r"^[a-z]+", "", p))  # in3 -> 3
            if p.startswith("in"):
                dt = spec.loads[j].dtype
            elif p.startswith("out"):
                dt = spec.dtypes[spec.stores[j]]
            elif p.startswith("red"):
                dt = spec.reduces[j].dtype
            else:
                dt = np.dtype(np.float64)
            sig.append(typeof(np.empty(1, dt)))
    return tuple(sig)


def _cached(key: Tuple[str, ...], build) -> Any:
    """The compiled kernel cached under ``key``, built (outside the lock) on first use."""
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is None:
        hit = build()
        with _CACHE_LOCK:
            hit = _CACHE.setdefault(key, hit)
    return hit


def _cpu_kernel(spec: KernelSpec):
    text, params = _py_source(spec, "cpu")

    def build():
        import numba

        mul = numba.njit(_product)
        ns = _exec_source(text, "cpu", {"np": np, "math": math, "prange": numba.prange, "mul_f32": mul,
                                         "mul_f64": mul, "f32": np.float32, "f64": np.float64, "bool": bool})
        fn = numba.njit(parallel=True, error_model="numpy", fastmath=False)(ns["kernel_"])
        fn.compile(_numba_types(spec, params))  # compile now, not on the first run
        return fn, params, text

    return _cached(("cpu", text), build)


class _SimMath:
    """``math`` for kernels run by numba's CUDA simulator, which executes them as Python.

    Python's math raises on sqrt(-1) or log(0) where the device returns NaN or -inf; numpy's
    scalar functions give the IEEE results the compiled kernel does, in the operand's dtype.
    """

    nan, inf = math.nan, math.inf

    def __getattr__(self, name):
        fn = getattr(np, {"pow": "power"}.get(name, name))

        def ieee(*args):
            with np.errstate(all="ignore"):
                return fn(*args)

        return ieee


def _product(a, b):
    return a * b


def _cuda_products(simulator: bool) -> Dict[str, object]:
    """Products NVVM cannot contract into an fma with a following add (see fusion_ops)."""
    if simulator:  # kernels run as Python: a plain product is already rounded on its own
        return {"mul_f32": _product, "mul_f64": _product}
    from numba.cuda import libdevice

    return {"mul_f32": libdevice.fmul_rn, "mul_f64": libdevice.dmul_rn}


def _cuda_namespace(simulator: bool) -> Dict[str, object]:
    """The globals a generated numba.cuda kernel sees (simulator: IEEE numpy math, plain products)."""
    import numba
    from numba import cuda

    return {"np": np, "math": _SimMath() if simulator else math, "cuda": cuda, **_cuda_products(simulator),
            "f32": numba.float32, "f64": numba.float64, "bool": numba.boolean}


def _cuda_launch(kernel, work: int) -> Tuple[int, int]:
    """(grid, block) from the occupancy plugin (the launch-configuration hook), else 256-thread
    blocks; the kernels loop grid-stride, so any grid computes every element."""
    from numba import cuda

    from optirs.plugin.registry import REGISTRY

    config = REGISTRY.launch_config(kernel, cuda.get_current_device(), work)
    if config is not None:
        return int(config[0]), int(config[1])
    return max(1, min(-(-work // BLOCK), 8192)), BLOCK


def _cuda_kernel(spec: KernelSpec):
    text, params = _py_source(spec, "cuda")

    def build():
        from numba import config, cuda

        ns = _exec_source(text, "cuda", _cuda_namespace(bool(config.ENABLE_CUDASIM)))
        fin = cuda.jit(ns["finish_"]) if "finish_" in ns else None
        return cuda.jit(ns["kernel_"]), fin, params, text

    return _cached(("cuda", text), build)


def cuda_source(plan: FusionPlan, group: FusionGroup) -> str:
    """The numba.cuda source generated for one group (for inspection and PTX compilation)."""
    return _py_source(kernel_spec(plan, group), "cuda")[0]


def cpu_source(plan: FusionPlan, group: FusionGroup) -> str:
    """The numba.njit source generated for one group."""
    return _py_source(kernel_spec(plan, group), "cpu")[0]


def compile_ptx(plan: FusionPlan, group: FusionGroup, cc: Tuple[int, int] = (9, 0)) -> str:
    """PTX of one group's CUDA kernel for compute capability ``cc`` (no GPU needed)."""
    from numba import cuda

    spec = kernel_spec(plan, group)
    text, params = _py_source(spec, "cuda")
    ns = _exec_source(text, "cuda-ptx", _cuda_namespace(False))
    sig = _numba_types(spec, params)
    ptx, _ = cuda.compile_ptx(ns["kernel_"], sig, cc=cc)
    return ptx


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
    text = OPENCL_HELPERS + (OPENCL_HELPERS_FP64 if fp64 else "")
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


def _cl_queue():
    """The OpenCL backend's context and queue (its device choice and options apply here too)."""
    from optirs.core.errors import BackendUnavailableError
    from optirs.plugin.registry import REGISTRY

    try:
        ctx = REGISTRY.get_backend("opencl").ctx
    except BackendUnavailableError as exc:
        raise UnsupportedOperationError(f"fusion backend 'opencl' is unavailable: {exc}") from exc
    return ctx.context, ctx.queue


def _cl_kernel(spec: KernelSpec):
    ctx, _ = _cl_queue()  # first: it says why when pyopencl or a device is missing
    import pyopencl as cl

    text, args = opencl_source(spec)
    key = ("opencl", str(id(ctx)), text)  # programs belong to one context (kept alive by the entry)

    def build():
        if "cl_khr_fp64" in text and "cl_khr_fp64" not in ctx.devices[0].extensions:
            raise UnsupportedOperationError(
                f"fusion backend 'opencl': device {ctx.devices[0].name!r} lacks cl_khr_fp64, which this group needs "
                "(float64 values or float64 reduction accumulators)"
            )
        # Division and sqrt are only correctly rounded (as numpy's are) with this option; OpenCL
        # otherwise allows 2.5 and 3 ulp. Devices that cannot honour it get the default.
        dev = ctx.devices[0]
        exact = bool(dev.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT)
        prg = cl.Program(ctx, text).build(options=["-cl-fp32-correctly-rounded-divide-sqrt"] if exact else [])
        kern = prg.kernel_  # looked up once: prg.<name> builds a new wrapper each time
        fin = prg.finish_ if "finish_" in text else None
        return kern, fin, args, ctx, text

    return _cached(key, build)


# ================================================================ compiled plans


class CompiledPlan:
    """A plan with one compiled kernel per group on one backend; :meth:`run` executes it."""

    def __init__(self, plan: FusionPlan, backend: str):
        self.plan = plan
        self.backend = backend
        self.specs: List[Optional[KernelSpec]] = []
        self.kernels: List[Any] = []
        for g in plan.groups:
            if g.opaque:
                self.specs.append(None)
                self.kernels.append(None)
                continue
            spec = kernel_spec(plan, g)
            self.specs.append(spec)
            self.kernels.append({"cpu": _cpu_kernel, "cuda": _cuda_kernel, "opencl": _cl_kernel}[backend](spec))

    def sources(self) -> List[Optional[str]]:
        """The generated source of each group's kernel (None for opaque groups)."""
        return [None if k is None else k[-1] for k in self.kernels]

    @property
    def kernel_count(self) -> int:
        return sum(k is not None for k in self.kernels)

    def run(self, inputs: Mapping[str, Any], out: Optional[Mapping[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
        """Execute the graph; numpy arrays in (shapes and dtypes as declared), numpy arrays out.

        :param out: optional preallocated arrays for some graph outputs (C-contiguous, of the
            output's shape and dtype); they are filled and returned instead of new arrays.
        """
        graph = self.plan.graph
        host = graph.check_inputs(inputs)
        out = self._check_out(out or {})
        run = {"cpu": self._run_cpu, "cuda": self._run_cuda, "opencl": self._run_opencl}[self.backend]
        result = run(host, out)
        for v, a in out.items():
            if result[v] is not a:  # device backends: copy the downloaded result into place
                a[...] = result[v]
                result[v] = a
        return result

    def _check_out(self, out: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        graph = self.plan.graph
        for v, a in out.items():
            if v not in graph.outputs:
                raise InvalidParameterError(f"out names {v!r}, which is not a graph output; outputs are {list(graph.outputs)}")
            shape, dt = graph.shape(v), graph.dtype(v)
            if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dt:
                raise ShapeMismatchError(f"out[{v!r}]: {getattr(a, 'shape', type(a).__name__)} "
                                         f"{getattr(a, 'dtype', '')}, expected a numpy array of shape {shape} dtype {dt}")
            if not (a.flags.c_contiguous and a.flags.writeable):
                raise ShapeMismatchError(f"out[{v!r}] must be C-contiguous and writeable")
        return dict(out)

    # ---------------------------------------------------------------- argument lists

    def _args(self, spec: KernelSpec, params: Sequence[str], env, alloc):
        """Arguments for a group's kernel and the arrays it will write (value -> array)."""
        graph = self.plan.graph
        n = math.prod(spec.domain)
        outs = {v: alloc(v, math.prod(graph.shape(v)), spec.dtypes[v]) for v in spec.stores}
        reds = {r.out: alloc(r.out, max(1, math.prod(graph.shape(r.out))), r.dtype) for r in spec.reduces}
        vals = []
        for p in params:
            if p == "n":
                vals.append(np.int64(n))
            elif p == "chunk":
                vals.append(np.int64(REDUCE_CHUNK))
            elif p == "layout":
                vals.append(tuple(np.int64(x) for x in spec.layout))
            elif p == "dims":
                vals.append(tuple(np.int64(d) for d in spec.domain))
            elif p.startswith("st"):
                vals.append(tuple(np.int64(s) for s in spec.loads[int(p[2:])].strides))
            elif p.startswith("in"):
                vals.append(env[spec.loads[int(p[2:])].value])
            elif p.startswith("out"):
                vals.append(outs[spec.stores[int(p[3:])]])
            elif p.startswith("red"):
                vals.append(reds[spec.reduces[int(p[3:])].out])
        return vals, {**outs, **reds}

    # ---------------------------------------------------------------- cpu

    def _run_cpu(self, host: Dict[str, np.ndarray], out: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        graph = self.plan.graph
        env = {k: np.ascontiguousarray(v).reshape(-1) for k, v in host.items()}
        flat_out = {v: a.reshape(-1) for v, a in out.items()}  # views: the kernels write into them
        for g, spec, kern in zip(self.plan.groups, self.specs, self.kernels):
            if spec is None:
                env.update(self._opaque(g, env))
                continue
            fn, params, _ = kern
            vals, made = self._args(spec, params, env, lambda v, size, dt: flat_out[v] if v in flat_out else np.empty(size, dt))
            fn(*vals)
            env.update(made)
        for g in self.plan.groups:  # an opaque op's result lands in its out array too
            if g.opaque and g.ops[0] in out:
                out[g.ops[0]][...] = env[g.ops[0]].reshape(out[g.ops[0]].shape)
        return {v: out[v] if v in out else env[v].reshape(graph.shape(v)) for v in graph.outputs}

    def _opaque(self, g: FusionGroup, env, to_host=lambda a: a, to_dev=lambda a: a):
        graph = self.plan.graph
        (name,) = g.ops
        op = graph[name]
        args = [to_host(env[v]).reshape(graph.shape(v)) for v in op.inputs]
        out = _call_opaque(op, args)
        return {name: to_dev(np.ascontiguousarray(out).reshape(-1))}

    # ---------------------------------------------------------------- cuda

    def _run_cuda(self, host: Dict[str, np.ndarray], out: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        from numba import cuda

        graph = self.plan.graph
        env = {k: cuda.to_device(np.ascontiguousarray(v).reshape(-1)) for k, v in host.items()}
        for g, spec, kern in zip(self.plan.groups, self.specs, self.kernels):
            if spec is None:
                env.update(self._opaque(g, env, lambda a: a.copy_to_host(), cuda.to_device))
                continue
            fn, fin, params, _ = kern
            ps = list(params)
            vals, made = self._args(spec, ps, env, lambda v, size, dt: cuda.device_array(size, dt))
            n = math.prod(spec.domain)
            if spec.reduces and spec.layout is None:
                nchunk = max(1, -(-n // REDUCE_CHUNK))
                # chunk 0's partial starts as the identity: it is what finish_ sees when n == 0
                parts = [cuda.to_device(np.full(nchunk, 0.0 if r.kind == "sum" else -np.inf)) for r in spec.reduces]
                work = nchunk
                vals += parts
            elif spec.layout is not None:
                work = spec.layout[0] * spec.layout[2]
            else:
                work = n
            if work > 0:
                grid, block = _cuda_launch(fn, work)
                fn[grid, block](*vals)
            if fin is not None:
                fin[1, 1](np.int64(max(1, -(-n // REDUCE_CHUNK))), *parts, *[made[r.out] for r in spec.reduces])
            env.update(made)
        cuda.synchronize()
        return {v: env[v].copy_to_host().reshape(graph.shape(v)) for v in graph.outputs}

    # ---------------------------------------------------------------- opencl

    def _run_opencl(self, host: Dict[str, np.ndarray], out: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        import pyopencl.array as cla

        ctx, queue = _cl_queue()
        graph = self.plan.graph

        def dev(a):
            a = np.ascontiguousarray(a).reshape(-1)
            if a.dtype == np.bool_:
                a = a.view(np.uint8)
            return cla.to_device(queue, a if a.size else np.zeros(1, a.dtype))

        def alloc(size, dt):
            return cla.empty(queue, max(size, 1), np.uint8 if np.dtype(dt) == np.bool_ else dt)

        def back(a, v):
            out = a.get()[: math.prod(graph.shape(v))]
            return out.view(np.bool_) if graph.dtype(v) == np.bool_ else out

        env = {k: dev(v) for k, v in host.items()}
        for g, spec, kern in zip(self.plan.groups, self.specs, self.kernels):
            if spec is None:
                (name,) = g.ops
                env.update({name: dev(self._opaque(g, {v: back(env[v], v) for v in graph[name].inputs})[name])})
                continue
            fn, fin, args, _, _ = kern
            n = math.prod(spec.domain)
            outs = {v: alloc(math.prod(graph.shape(v)), spec.dtypes[v]) for v in spec.stores}
            reds = {r.out: alloc(math.prod(graph.shape(r.out)), r.dtype) for r in spec.reduces}
            nchunk = max(1, -(-n // REDUCE_CHUNK))
            parts = []
            if spec.reduces and spec.layout is None:
                parts = [cla.to_device(queue, np.full(nchunk, 0.0 if r.kind == "sum" else -np.inf)) for r in spec.reduces]
            vals = []
            for t, name in args:
                if name == "n":
                    vals.append(np.int64(n))
                elif name in ("A_", "K_", "B_"):
                    vals.append(np.int64(spec.layout[{"A_": 0, "K_": 1, "B_": 2}[name]]))
                elif name == "chunk":
                    vals.append(np.int64(REDUCE_CHUNK))
                elif name.startswith("d") and name[1:].isdigit():
                    vals.append(np.int64(spec.domain[int(name[1:])]))
                elif name.startswith("s") and "_" in name:
                    j, k = name[1:].split("_")
                    vals.append(np.int64(spec.loads[int(j)].strides[int(k)]))
                elif name.startswith("in"):
                    vals.append(env[spec.loads[int(name[2:])].value].data)
                elif name.startswith("out"):
                    vals.append(outs[spec.stores[int(name[3:])]].data)
                elif name.startswith("red"):
                    vals.append(reds[spec.reduces[int(name[3:])].out].data)
                elif name.startswith("part"):
                    vals.append(parts[int(name[4:])].data)
            work = nchunk if (spec.reduces and spec.layout is None) else (spec.layout[0] * spec.layout[2] if spec.layout else n)
            if work > 0:
                groups = max(1, min(-(-work // BLOCK), 8192))
                fn(queue, (groups * BLOCK,), (BLOCK,), *vals)
            if fin is not None:
                fin(queue, (1,), (1,), np.int64(nchunk), *[p.data for p in parts], *[reds[r.out].data for r in spec.reduces])
            env.update(outs)
            env.update(reds)
        queue.finish()
        return {v: back(env[v], v).reshape(graph.shape(v)) for v in graph.outputs}


def compile_plan(plan: FusionPlan, backend: str) -> CompiledPlan:
    if backend not in BACKENDS:
        raise UnsupportedOperationError(f"fusion backend {backend!r} is not supported; expected one of {list(BACKENDS)}")
    if backend == "cuda":
        try:
            from numba import cuda
        except ImportError as exc:
            raise UnsupportedOperationError(f"fusion backend 'cuda' needs numba.cuda, which is not importable: {exc}") from exc
        if not cuda.is_available():
            raise UnsupportedOperationError("fusion backend 'cuda': no CUDA device (set NUMBA_ENABLE_CUDASIM=1 for the simulator)")
    return CompiledPlan(plan, backend)
