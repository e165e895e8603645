"""The opencl backend's ``formats`` capability: 16-bit parameters, compact masters and state.

The kernels are ``optirs/backends/common/kernels/optirs_formats.cl`` (+ ``optirs_formats.h``, the
contract's encodings, and ``optirs_formats_step.h``, one kernel per elementwise family), built
once per context and format: the format's codes are compile-time defines, so a launch has no
branch on the format. A step is one chunked launch per group of at most ``SLOTS`` distinct
parameter and gradient buffers, as the float32 step: numpy inputs are packed into one buffer
(one launch for the model), pyopencl arrays are stepped in place. LAMB is its two passes (plus
two for global gradient clipping), reusing the float32 step's trust-ratio kernels.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from optirs.backends.common.int8_buckets import bucket_table
from optirs.backends.common.opencl_source import expand_includes, program_source
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import GpuOptimError, InvalidParameterError, UnsupportedOperationError
from optirs.core.formats import (FORMAT_FAMILIES, FormatState, StepFormat, dtype_name, dynamic_map,
                                 map_midpoints)
from optirs.plugin.hookspecs import Staged

KERNEL_FILE = "optirs_formats.cl"
STEP_TEMPLATE = "optirs_formats_step.h"
# The state slots of each family in kernel order (adam and adamw share theirs).
FAMILY_SLOTS = {d.kernel: d.slot_names() for d in DEFINITIONS.values()}
# fmt_offsets and fmt_step of optirs_formats.cl, passed by value.
OFFSETS = np.dtype([(n, "<i8") for n in ("m", "s0", "s1", "s2", "c0", "c1", "c2", "l0", "l1", "l2", "skip")])
STEP = np.dtype([("seed", "<u4"), ("step", "<u4"), ("used", "<i4"), ("signed_mask", "<i4")])
_HALF = ("bfloat16", "float16")

# OpenCL context wrapper -> its format programs, maps and zero flag; dies with the context.
_built: "weakref.WeakKeyDictionary[Any, Dict[Any, Any]]" = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------- programs


def format_source(families: Sequence[str]) -> str:
    """The program text: optirs_formats.cl, then one format step kernel per elementwise family."""
    step = expand_includes(f'#include "{STEP_TEMPLATE}"')
    return "\n".join([program_source(KERNEL_FILE)] + [f"#define OPT {f}\n{step}\n#undef OPT" for f in families])


def format_defines(fmt: StepFormat) -> List[str]:
    c = fmt.codes
    return [f"-DOPTIRS_FMT_PARAM={c.param}", f"-DOPTIRS_FMT_GRAD={c.grad}", f"-DOPTIRS_FMT_MASTER={c.master}",
            f"-DOPTIRS_FMT_STATE={c.state}", f"-DOPTIRS_FMT_SR={int(c.stochastic)}"]


class _Program(NamedTuple):
    kernels: Dict[str, Any]


def _cache(ctx: Any) -> Dict[Any, Any]:
    hit = _built.get(ctx)
    if hit is None:
        hit = _built[ctx] = {}
    return hit


def _program(ctx: Any, fmt: StepFormat) -> _Program:
    """The kernels of ``fmt``'s program, built once per context and format codes."""
    from optirs.backends.opencl.context import ELEMENTWISE, build_program

    cache = _cache(ctx)
    key = ("program", fmt.codes)
    hit = cache.get(key)
    if hit is not None:
        return hit
    with ctx.lock:
        hit = cache.get(key)
        if hit is not None:
            return hit
        options = [o for o in ctx.build_options] + format_defines(fmt)
        program = build_program(ctx.context, ctx.device, format_source(ELEMENTWISE), options,
                                f"formats.{fmt.param_dtype}-{fmt.master}-{fmt.state_dtype}{'-sr' if fmt.stochastic else ''}")
        u32, i32 = np.uint32, np.int32
        off, st = OFFSETS, STEP
        slots = [None] * 32
        buffers = [None] * 11 + [off]  # M, S0-2, C0-2, L0-2, maps, offsets
        table = [None, None, None, u32]
        types: Dict[str, list] = {"fmt_struct_sizes": [None], "fmt_check": slots + table + [None],
                                  "fmt_lamb_grad_sumsq": slots + table + [None]}
        for fam in ELEMENTWISE:
            types[f"{fam}_fmt"] = slots + buffers + table + [None, st, ctx.records[fam]]
        lamb = ctx.records["lamb"]
        types["fmt_lamb_norms"] = slots + buffers + table + [None, i32, None, st, lamb]
        types["fmt_lamb_apply"] = slots + buffers + table + [None, i32, None, None, st, lamb]
        kernels = {}
        for name, arg_types in types.items():
            kernel = ctx.cl.Kernel(program, name)
            if kernel.num_args != len(arg_types):
                raise GpuOptimError(f"OpenCL kernel {name} takes {kernel.num_args} arguments, the host passes "
                                    f"{len(arg_types)}: optirs_formats.cl and opencl/formats.py disagree")
            kernel.set_arg_types(arg_types)
            kernels[name] = kernel
        _check_structs(ctx, kernels["fmt_struct_sizes"])
        hit = cache[key] = _Program(kernels)
    return hit


def _check_structs(ctx: Any, kernel: Any) -> None:
    cl = ctx.cl
    out = np.zeros(3, np.int32)
    buf = cl.Buffer(ctx.context, cl.mem_flags.WRITE_ONLY, out.nbytes)
    kernel(ctx.queue, (1,), None, buf)
    cl.enqueue_copy(ctx.queue, out, buf)
    want = (OFFSETS.itemsize, STEP.itemsize, ctx.acc_bytes)
    if tuple(int(x) for x in out) != want:
        raise GpuOptimError(f"OpenCL format structs (fmt_offsets, fmt_step, acc_t) are {tuple(out)} bytes, the host's "
                            f"records {want}: optirs_formats.cl and opencl/formats.py disagree")


def _maps(ctx: Any) -> Any:
    """[signed q, signed mid, unsigned q, unsigned mid] (mid padded with +inf to 256), then the signed
    and the unsigned bucket tables as floats (int8_buckets; the kernels keep them as bytes), on the
    device once."""
    cache = _cache(ctx)
    buf = cache.get("maps")
    if buf is None:
        parts = []
        for signed in (True, False):
            parts += [dynamic_map(signed), map_midpoints(signed), np.array([np.inf], np.float32)]
        parts += [bucket_table(True).astype(np.float32), bucket_table(False).astype(np.float32)]
        host = np.concatenate(parts).astype(np.float32)
        cl = ctx.cl
        buf = cache["maps"] = cl.Buffer(ctx.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
    return buf


def _zero_flag(ctx: Any) -> Any:
    cache = _cache(ctx)
    buf = cache.get("zero")
    if buf is None:
        cl = ctx.cl
        buf = cache["zero"] = cl.Buffer(ctx.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                        hostbuf=np.zeros(4, np.int32))
    return buf


# ---------------------------------------------------------------- staging


def _host_bits(a: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """A numpy array of ``dtype`` as the words the kernels read: float32, or uint16 bits."""
    if dtype == "float32":
        if a.dtype != np.float32:
            raise InvalidParameterError(f"{what} has dtype {a.dtype}, expected float32")
        return a
    if a.dtype == np.uint16 or dtype_name(a.dtype) == dtype:
        return a.view(np.uint16)
    raise InvalidParameterError(f"{what} has dtype {a.dtype}, expected {dtype} (or its uint16 bits)")


def _device_dtype_ok(a: Any, dtype: str) -> bool:
    if dtype == "float32":
        return a.dtype == np.float32
    return a.dtype.itemsize == 2 and (a.dtype == np.uint16 or dtype_name(a.dtype) == dtype)


class _Packed(list):
    """Per-tensor views into one flat device array at the layout's offsets."""

    flat: Any = None


def _stage_numpy(ctx: Any, params: List[np.ndarray], grads: List[np.ndarray], fmt: StepFormat) -> Staged:
    p_host = [_host_bits(np.asarray(p), fmt.param_dtype, f"params[{i}]") for i, p in enumerate(params)]
    g_host = [_host_bits(np.asarray(g), fmt.grad_dtype, f"grads[{i}]") for i, g in enumerate(grads)]
    sizes = tuple(int(p.size) for p in p_host)
    total = int(sum(sizes))
    if total == 0:
        return Staged(list(params), list(grads))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    cache = _cache(ctx)
    key = ("staging", sizes, p_host[0].dtype.str, g_host[0].dtype.str)
    area = cache.get(key)
    if area is None:
        for old in [k for k in cache if isinstance(k, tuple) and k[0] == "staging"][:-3]:
            cache.pop(old)  # a few models at a time
        area = []
        for dt in (p_host[0].dtype, g_host[0].dtype):
            views = _Packed()
            views.flat = ctx.empty(total, dt)
            views.extend(views.flat[int(o): int(o) + n] for o, n in zip(offsets, sizes))
            area.append(views)
        cache[key] = area
    pv, gv = area
    cl, q = ctx.cl, ctx.queue
    try:
        cl.enqueue_copy(q, pv.flat.base_data, np.concatenate([a.reshape(-1) for a in p_host]), is_blocking=True)
        cl.enqueue_copy(q, gv.flat.base_data, np.concatenate([a.reshape(-1) for a in g_host]), is_blocking=True)
    except cl.Error as exc:
        raise ctx.translate(exc, f"uploading {total} parameters") from exc

    def finish() -> None:
        host = np.empty(total, pv.flat.dtype)
        cl.enqueue_copy(q, host, pv.flat.base_data, is_blocking=True)
        for a, o, n in zip(p_host, offsets, sizes):
            np.copyto(a.reshape(-1), host[int(o): int(o) + n])

    return Staged(pv, gv, finish)


# ---------------------------------------------------------------- launch planning


class _Plan:
    """The tensor table and launch groups for one list of arrays (cached while the same objects come)."""

    def __init__(self, ctx: Any, params: List[Any], grads: List[Any], layout: Any, table: Optional[np.ndarray],
                 s_offs: Tuple[int, ...], tables: Any):
        from optirs.backends.opencl.context import SlotGrouper

        self.refs = [weakref.ref(a) for a in params] + [weakref.ref(a) for a in grads]
        self.key = (table is not None and bool((table[:, 1] >= 0).any()), s_offs)
        ntens = len(layout)
        tens = np.zeros((ntens, 8), np.int64)
        grouper = SlotGrouper(tables)
        s_off, l_off = s_offs[:3] + s_offs[6:], s_offs[3:6]  # values/codes and master; small float32 state
        for t in range(ntens):
            n = int(layout.sizes[t])
            if n == 0:
                continue
            p, g = params[t], grads[t]
            ps, gs = grouper.add(t, p.base_data.int_ptr, g.base_data.int_ptr, t, t)
            po, go = p.offset // p.dtype.itemsize, g.offset // g.dtype.itemsize
            lay = int(layout.offsets[t])
            block, small = (int(table[t, 1]), int(table[t, 2])) if table is not None else (-1, -1)
            starts = [po, go] + [lay + o for o in s_off] + ([small + o for o in l_off] if small >= 0 else [])
            aligned = all(x % 8 == 0 for x in starts)  # every 8-element group is one vector access
            tens[t] = (po, go, lay, n, block, small, ps | gs << 8 | int(aligned) << 16, 0)
        self.groups = grouper.finish(ntens)
        cl = ctx.cl
        self.tens = cl.Buffer(ctx.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=tens)

    def matches(self, params: List[Any], grads: List[Any], key: Tuple[Any, ...]) -> bool:
        refs = self.refs
        if self.key != key or len(refs) != len(params) + len(grads):
            return False
        return all(r() is a for r, a in zip(refs, list(params) + list(grads)))


def _plan(ctx: Any, name: str, params, grads, layout, table: Optional[np.ndarray],
          s_offs: Tuple[int, ...]) -> Tuple[_Plan, Any]:
    """The cached plan ``name`` ("step", "check") of this layout for these arrays."""
    from optirs.backends.opencl.context import _layout_tables

    tables = _layout_tables(ctx, layout)
    cache = layout.cache.setdefault(("opencl-formats", id(ctx)), {})
    plan = cache.get(name)
    key = (table is not None and bool((table[:, 1] >= 0).any()), s_offs)
    if plan is None or not plan.matches(params, grads, key):
        plan = cache[name] = _Plan(ctx, params, grads, layout, table, s_offs, tables)
    return plan, tables


# ---------------------------------------------------------------- the step's buffers


def _part(ctx: Any, a: Any) -> Tuple[Any, int]:
    """(cl buffer, element offset) of a device array, the dummy buffer for None or an empty array."""
    if a is None or not a.size:
        return ctx.dummy, 0
    return a.base_data, a.offset // a.dtype.itemsize


def _state_args(ctx: Any, family: str, state: Dict[str, Any], fs: FormatState, found_inf: Any):
    """The kernel's buffer arguments (M, S0-2, C0-2, L0-2, maps), the offsets record, the used and
    signed masks, and the state offsets the alignment flag depends on."""
    names = FAMILY_SLOTS[family]
    signed = {s.name: bool(getattr(s, "signed", False)) for s in fs.slots}
    unknown = [n for n in fs.slot_names if n not in names]
    if unknown:
        raise InvalidParameterError(f"state slots {unknown} are not slots of the {family} family {list(names)}")
    m_buf, m_off = _part(ctx, state.get(fs.master_buffer()) if fs.master_buffer() else None)
    s_bufs, c_bufs, l_bufs, offs = [], [], [], {"m": m_off}
    used = signed_mask = 0
    for k in range(3):
        name = names[k] if k < len(names) else None
        present = name is not None and name in fs.slot_names
        if present:
            used |= 1 << k
            signed_mask |= int(signed[name]) << k
        parts = fs.slot_buffers(name) if present else ()
        arrays = [state[b] for b in parts] + [None] * (3 - len(parts))
        for dest, key, a in zip((s_bufs, c_bufs, l_bufs), ("s", "c", "l"), arrays):
            buf, off = _part(ctx, a)
            dest.append(buf)
            offs[f"{key}{k}"] = off
    if found_inf is not None:
        skip_buf, offs["skip"] = _part(ctx, found_inf)
    else:
        skip_buf, offs["skip"] = _zero_flag(ctx), 0
    record = np.array(tuple(offs[n] for n in OFFSETS.names), OFFSETS)
    s_offs = tuple(offs[f"s{k}"] for k in range(3)) + tuple(offs[f"l{k}"] for k in range(3)) + (m_off,)
    return [m_buf, *s_bufs, *c_bufs, *l_bufs, _maps(ctx)], record, used, signed_mask, skip_buf, s_offs


# ---------------------------------------------------------------- the plugin


class OpenclFormats:
    """The step formats of the opencl backend (``optirs_step`` with a format calls them)."""

    def _formats_stage(self, ctx: Any, params: List[Any], grads: List[Any], fmt: StepFormat) -> Staged:
        from optirs.backends.opencl.device import OpenclDevice

        if all(isinstance(a, np.ndarray) for a in params):
            if not all(isinstance(a, np.ndarray) for a in grads):
                raise InvalidParameterError("grads mix numpy and device arrays, expected numpy arrays like params")
            return _stage_numpy(ctx, params, grads, fmt)
        for what, arrays, dtype in (("params", params, fmt.param_dtype), ("grads", grads, fmt.grad_dtype)):
            for i, a in enumerate(arrays):
                if not isinstance(a, np.ndarray) and hasattr(a, "dtype") and not _device_dtype_ok(a, dtype):
                    raise InvalidParameterError(f"{what}[{i}] has dtype {a.dtype}, expected {dtype}"
                                                + (" (or its uint16 bits)" if dtype in _HALF else ""))
        return OpenclDevice._stage(self, ctx, params, grads)  # in place, with the float32 step's checks

    def _formats_step(self, ctx, request) -> None:
        family, params, grads, state, layout = (request.definition.kernel, request.params, request.grads,
                                                request.state, request.layout)
        format_state, fmt, scalars = request.format_state, request.fmt, request.scalars
        seed, step, found_inf = request.controls.seed, request.controls.step, request.controls.found_inf
        if family not in FORMAT_FAMILIES or family not in FAMILY_SLOTS:
            raise UnsupportedOperationError(f"the opencl formats step runs the families {list(FORMAT_FAMILIES)}, "
                                            f"got {family!r}")
        n = layout.total
        if n == 0:
            return
        prog = _program(ctx, fmt)
        bufs, offs, used, signed_mask, skip, s_offs = _state_args(ctx, family, state, format_state, found_inf)
        st = np.array((int(seed) & 0xFFFFFFFF, int(step) & 0xFFFFFFFF, used, signed_mask), STEP)
        rec = np.array(tuple(scalars), ctx.records[family])
        cl, q, wg = ctx.cl, ctx.queue, ctx.work_group
        with ctx.lock:
            try:
                plan, tables = _plan(ctx, "step", params, grads, layout, format_state.tensor_table(), s_offs)
                chunk = (plan.tens, tables.chunk_tensor, tables.chunk_start)
                launches = [(((g.chunk_end - g.chunk_begin) * wg,), g.buffers(ctx, params, grads), g.chunk_begin)
                            for g in plan.groups]
                if family == "lamb":
                    _lamb(ctx, prog, layout, tables, launches, bufs, offs, chunk, skip, st, rec, scalars)
                    return
                kernel = prog.kernels[f"{family}_fmt"]
                for gsize, pg, c0 in launches:
                    kernel(q, gsize, (wg,), *pg, *bufs, offs, *chunk, c0, skip, st, rec)
            except cl.Error as exc:
                raise ctx.translate(exc, f"running the {family} format step over {n} elements") from exc

    def _formats_check(self, ctx, grads, layout, fmt, flag) -> None:
        if layout.total == 0:
            return
        if flag.offset:
            raise InvalidParameterError("flag is a view at a non-zero offset, expected a 1-element int32 array")
        prog = _program(ctx, fmt)
        cl, q, wg = ctx.cl, ctx.queue, ctx.work_group
        with ctx.lock:
            try:
                # the check reads gradients only: the parameter slots hold the gradients' buffers
                plan, tables = _plan(ctx, "check", grads, grads, layout, None, (0,) * 7)
                for g in plan.groups:
                    prog.kernels["fmt_check"](q, ((g.chunk_end - g.chunk_begin) * wg,), (wg,),
                                              *g.buffers(ctx, grads, grads), plan.tens, tables.chunk_tensor,
                                              tables.chunk_start, g.chunk_begin, flag.base_data)
            except cl.Error as exc:
                raise ctx.translate(exc, f"checking {layout.total} gradients") from exc


def _lamb(ctx, prog, layout, tables, launches, bufs, offs, chunk, skip, st, rec, scalars) -> None:
    from optirs.backends.opencl.context import _lamb_scratch

    q, wg, k, kf = ctx.queue, ctx.work_group, ctx.kernels, prog.kernels
    partial_g, partial_pu, scale, ratio = _lamb_scratch(ctx, layout, tables)
    clip = np.int32(scalars.max_grad_norm > 0)
    if clip:
        for gsize, pg, c0 in launches:
            kf["fmt_lamb_grad_sumsq"](q, gsize, (wg,), *pg, *chunk, c0, partial_g)
        k["lamb_grad_scale"](q, (wg,), (wg,), partial_g, tables.total_chunks, scalars.max_grad_norm,
                                scalars.grad_factor, scale)
    for gsize, pg, c0 in launches:
        kf["fmt_lamb_norms"](q, gsize, (wg,), *pg, *bufs, offs, *chunk, c0, scale, clip, partial_pu, st, rec)
    k["lamb_trust_ratios"](q, (len(layout) * wg,), (wg,), partial_pu, tables.first_chunk, tables.nchunks,
                           scalars.max_trust_ratio, ratio)
    for gsize, pg, c0 in launches:
        kf["fmt_lamb_apply"](q, gsize, (wg,), *pg, *bufs, offs, *chunk, c0, scale, clip, ratio, skip, st, rec)
