"""The opencl backend's ``formats`` capability: 16-bit parameters, compact masters and state.

The kernels are ``optirs/backends/common/kernels/optirs_formats.cl`` (+ ``optirs_formats.h``, the
contract's encodings, and ``optirs_formats_step.h``, one kernel per elementwise family), built
once per context, format, family and set of state slots: the format's codes and the slots in use
are compile-time defines, so a launch has no branch on either and an absent slot costs nothing.
A step is one launch per group of at most ``ctx.slots`` distinct parameter and gradient buffers
(:mod:`optirs.backends.opencl.slots`), as the float32 step: numpy inputs are packed into one
buffer (one launch for the model), pyopencl arrays are stepped in place. Each launch is a resident
grid: as many work-groups as the compute units keep at once, each taking chunks from the
context's counter until none are left (the CUDA formats kernels' shape; one work-group per chunk
left every work-group's start and tail unhidden). LAMB is its two passes (plus two for global
gradient clipping), reusing the float32 step's trust-ratio kernels, over the float32 step's chunks
and work-group size so that its norms are summed in the same order.
"""

from __future__ import annotations

import itertools
import operator
import os
import warnings
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from optirs.backends.common.int8_buckets import bucket_table
from optirs.backends.common.opencl_source import expand_includes, program_source
from optirs.backends.common.register_cap import formats_register_cap
from optirs.backends.opencl.slots import SlotGrouper, check_argument_space, deal, resident_groups, slot_macros
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import GpuOptimError, InvalidParameterError, UnsupportedOperationError
from optirs.core.formats import (FORMAT_FAMILIES, INT8_STATES, FormatState, StepFormat, dtype_name, dynamic_map,
                                 map_midpoints)
from optirs.core.layout import aligned_offsets, pack_into
from optirs.plugin.hookspecs import Staged

KERNEL_FILE = "optirs_formats.cl"
STEP_TEMPLATE = "optirs_formats_step.h"
# The state slots of each family in kernel order (adam and adamw share theirs).
FAMILY_SLOTS = {d.kernel: d.slot_names() for d in DEFINITIONS.values()}
# fmt_offsets and fmt_step of optirs_formats.cl, passed by value.
OFFSETS = np.dtype([(n, "<i8") for n in ("m", "s0", "s1", "s2", "c0", "c1", "c2", "l0", "l1", "l2", "skip")])
STEP = np.dtype([("seed", "<u4"), ("step", "<u4")])
_HALF = ("bfloat16", "float16")
# Elements per chunk of the pointwise kernels and the gradient check (OPTIRS_OPENCL_FORMATS_CHUNK):
# a multiple of 256 (an int8 block) and of 8 x the work-group; small, so that a launch's last
# chunks end close together.
FMT_CHUNK = 2048
# Work-items per work-group of those kernels (OPTIRS_OPENCL_FORMATS_WG): small groups of these
# register-heavy kernels keep more of them resident (the CUDA formats kernels' 128-thread blocks).
WORK_GROUP = 128
# Work-items per compute unit of the grid (slots.RESIDENT unless set).
RESIDENT_VARIABLE = "OPTIRS_OPENCL_FORMATS_RESIDENT"



# ---------------------------------------------------------------- programs


def format_source(family: Optional[str], slots: int) -> str:
    """The program text: the slot macros, optirs_formats.cl, then the format step kernel of
    ``family`` when it is an elementwise family (LAMB's passes and the gradient check are in
    optirs_formats.cl)."""
    text = slot_macros(slots) + program_source(KERNEL_FILE)
    if family is None or family == "lamb":
        return text
    step = expand_includes(f'#include "{STEP_TEMPLATE}"')
    return f"{text}\n#define OPT {family}\n{step}\n#undef OPT"


def format_defines(fmt: StepFormat) -> List[str]:
    c = fmt.codes
    return [f"-DOPTIRS_FMT_PARAM={c.param}", f"-DOPTIRS_FMT_GRAD={c.grad}", f"-DOPTIRS_FMT_MASTER={c.master}",
            f"-DOPTIRS_FMT_STATE={c.state}", f"-DOPTIRS_FMT_SR={int(c.stochastic)}"]


def work_group(ctx: Any) -> int:
    """The pointwise kernels' work-group size: ``OPTIRS_OPENCL_FORMATS_WG`` or 128, within the device's."""
    text = os.environ.get("OPTIRS_OPENCL_FORMATS_WG", "").strip()
    allowed = [w for w in (32, 64, 128, 256) if w <= ctx.work_group]
    if not allowed:
        raise UnsupportedOperationError(f"the opencl formats kernels need work-groups of 32 work-items, the device "
                                        f"{ctx.device.name.strip()!r} allows {ctx.work_group}")
    if not text:
        return min(WORK_GROUP, allowed[-1])
    if not text.isdigit() or int(text) not in allowed:
        raise InvalidParameterError(f"OPTIRS_OPENCL_FORMATS_WG={text!r}, expected one of {allowed}")
    return int(text)


def chunk_elements(wg: int) -> int:
    """Elements per chunk of the pointwise kernels: ``OPTIRS_OPENCL_FORMATS_CHUNK`` or 2048."""
    text = os.environ.get("OPTIRS_OPENCL_FORMATS_CHUNK", "").strip()
    if not text:
        return max(FMT_CHUNK, 8 * wg)
    step = max(256, 8 * wg)
    if not text.isdigit() or int(text) < step or int(text) % step or int(text) > 1 << 24:
        raise InvalidParameterError(f"OPTIRS_OPENCL_FORMATS_CHUNK={text!r}, expected a multiple of {step} "
                                    f"(an int8 block and 8 x the work-group of {wg}) up to {1 << 24}")
    return int(text)


def register_options(ctx: Any, fmt: StepFormat) -> List[str]:
    """A register cap for the kernels of ``fmt``, where the device takes one (NVIDIA's
    ``cl_nv_compiler_options``): the int8-state kernels at 64, as the CUDA ones (fewer registers,
    more resident work-groups to hide their local-memory map lookups; the square-root codes, which
    have none, take the same rule, :func:`~optirs.backends.common.register_cap.formats_register_cap`);
    the others keep the compiler's choice. ``OPTIRS_OPENCL_FORMATS_MAXREG``: a cap for every formats
    kernel, 0 for none."""
    cache = _cache(ctx)
    nv = cache.get("nv_options")
    if nv is None:
        nv = cache["nv_options"] = "cl_nv_compiler_options" in ctx.device.extensions.split()
    cap = formats_register_cap(fmt, "OPTIRS_OPENCL_FORMATS_MAXREG")
    # OPTIRS_FMT_MAXREG leaves out the kernels' reqd_work_group_size, whose .reqntid makes ptxas
    # ignore the cap (optirs_formats.cl, FMT_WG_ATTR)
    return [f"-cl-nv-maxrregcount={cap}", f"-DOPTIRS_FMT_MAXREG={cap}"] if nv and cap else []


def nv_level(ctx: Any) -> int:
    """What NVIDIA's driver (``cl_nv_device_attribute_query``, warps of 32) takes as inline PTX: 3 from
    sm_89 on (float8 conversions), 2 from sm_80 on (``redux.sync``), 1 before, 0 for another driver or
    one whose inline PTX was refused in this context (:func:`_program` then sets it to 0)."""
    cache = _cache(ctx)
    level = cache.get("nv_warp")
    if level is None:
        level = 0
        device = ctx.device
        if "cl_nv_device_attribute_query" in device.extensions.split():
            try:
                if int(device.warp_size_nv) == 32:
                    cc = (int(device.compute_capability_major_nv), int(device.compute_capability_minor_nv))
                    level = 3 if cc >= (8, 9) else 2 if cc >= (8, 0) else 1
            except (ctx.cl.Error, AttributeError):  # a driver that lists the extension but answers neither query
                level = 0
        cache["nv_warp"] = level
    return level


def warp_options(ctx: Any, fmt: StepFormat) -> List[str]:
    """``-DOPTIRS_NV_WARP=2`` (sm_80 on: ``redux.sync``) or ``=1`` (``shfl.sync``) for the int8-state
    kernels (either code: the dynamic map or the square-root codes) on NVIDIA's driver, whose warps are
    32 consecutive work-items: a block's absmax is then a warp reduction in inline PTX, as in the CUDA
    kernels, where the portable form takes a tree in local memory with a barrier a level
    (fmt_warp_max of optirs_formats.cl). Nothing for other formats or devices;
    ``OPTIRS_OPENCL_FORMATS_WARP=0`` turns it off (the portable form, for comparison)."""
    if fmt.state_dtype not in INT8_STATES or os.environ.get("OPTIRS_OPENCL_FORMATS_WARP", "").strip() == "0":
        return []
    level = nv_level(ctx)
    return [f"-DOPTIRS_NV_WARP={level}"] if level else []


def ptx_options(ctx: Any) -> List[str]:
    """``-DOPTIRS_NV_PTX=<level>`` for every formats program on NVIDIA's driver (:func:`nv_level`: 2 from
    sm_80 on, 1 before): Adam's division by its uniform bias correction as the division's fast path
    with the reciprocal taken once (``divide_by_uniform`` of optirs_elementwise.h, the same bits),
    bfloat16 pairs packed by one ``prmt`` (``optirs_pack_high16`` of optirs_formats.h), the int8
    blocks' reciprocal, midpoint compare and code packing, the square-root codes' block divisions and
    roots by ptxas's fast paths in their windows (``optirs_div_fast``, ``optirs_sqrt_fast8``) and their
    bytes by ``prmt``, from level 2 the NaN-free rounds' nearest bfloat16 pairs by
    ``cvt.rn.bf16x2.f32``, and from level 3 the float8 state's codes and values by
    ``cvt.rn.satfinite.e4m3x2.f32`` and ``cvt.rn.f16x2.e4m3x2``; the portable C elsewhere. ``OPTIRS_OPENCL_FORMATS_PTX=0`` turns it off (the
    portable C, for comparison)."""
    if os.environ.get("OPTIRS_OPENCL_FORMATS_PTX", "").strip() == "0":
        return []
    level = nv_level(ctx)
    return [f"-DOPTIRS_NV_PTX={level}"] if level else []


def num_options() -> List[str]:
    """The tuning builds' defines: ``-DOPTIRS_FMT_NUM=0`` where ``OPTIRS_OPENCL_FORMATS_NUM=0`` (every
    round takes the bfloat16 encoders with their NaN test: the NaN-free rounds' branch of
    optirs_formats_step.h off, the same words, to compare the two on a device) and
    ``-DOPTIRS_FMT_APPROX=1`` where ``OPTIRS_OPENCL_FORMATS_APPROX=1`` (Adam's root and quotient by the
    device's ``native_`` operations)."""
    num = ["-DOPTIRS_FMT_NUM=0"] if os.environ.get("OPTIRS_OPENCL_FORMATS_NUM", "").strip() == "0" else []
    approx = ["-DOPTIRS_FMT_APPROX=1"] if os.environ.get("OPTIRS_OPENCL_FORMATS_APPROX", "").strip() == "1" else []
    return num + approx


class _Program(NamedTuple):
    kernels: Dict[str, Any]  # name -> Kernel with its argument types set
    wg: int  # work-items per work-group
    chunk: int  # elements per chunk of the tables it runs over
    slots: int  # buffers of each kind per launch
    program: Any  # the built cl.Program (its driver binary: built_binaries)


def _cache(ctx: Any) -> Dict[Any, Any]:
    """The context's format programs, maps, flags and counter (an attribute: dies with the context)."""
    hit = ctx.__dict__.get("_formats_cache")
    if hit is None:
        hit = ctx.__dict__["_formats_cache"] = {}
    return hit


def _arg_types(ctx: Any, family: Optional[str], nslots: int) -> Dict[str, list]:
    """The argument types the host passes to each kernel of the program of ``family``."""
    slots = [None] * (2 * nslots)
    state = [None] * 11 + [OFFSETS]  # M, S0-2, C0-2, L0-2, maps; the offsets record
    table = [None, None, None, np.uint32, np.uint32, None, np.uint32]  # tables, chunk range, counter
    out = {"fmt_check": slots + table + [None]}
    if family == "lamb":
        lamb = ctx.records["lamb"]
        out.update(fmt_lamb_grad_sumsq=slots + table + [None],
                   fmt_lamb_norms=slots + state + table + [None, np.int32, None, STEP, lamb],
                   fmt_lamb_apply=slots + state + table + [None, np.int32, None, None, STEP, lamb])
    elif family is not None:
        out[f"{family}_fmt"] = slots + state + table + [None, STEP, ctx.records[family]]
    return out


def _program(ctx: Any, fmt: StepFormat, family: Optional[str] = None, used: int = 0, signed: int = 0) -> _Program:
    """The program of ``fmt`` for ``family`` (None: the gradient check alone) and its state slots in
    use (bit k of ``used``; of ``signed``: slot k takes the signed int8 map), built once per
    context. The defines are the build options, so pyopencl's binary cache (keyed by source and
    options) serves a later process."""
    from optirs.backends.opencl.context import CHUNK, build_program

    lamb = family == "lamb"
    if lamb:
        wg, chunk = ctx.work_group, CHUNK
    else:
        wg = work_group(ctx)
        chunk = chunk_elements(wg)
    slots = ctx.slots
    registers = register_options(ctx, fmt)
    # the inline PTX's defines, dropped together where the driver refuses them
    inline_ptx = warp_options(ctx, fmt) + ptx_options(ctx)
    cache = _cache(ctx)
    num = num_options()
    key = ("program", fmt.codes, family, used, signed, wg, chunk, slots, tuple(num), tuple(registers),
           tuple(inline_ptx))
    hit = cache.get(key)
    if hit is not None:
        return hit
    with ctx.lock:
        hit = cache.get(key)
        if hit is not None:
            return hit
        options = [o for o in ctx.build_options if not o.startswith(("-DOPTIRS_WG=", "-DOPTIRS_CHUNK="))]
        options += [f"-DOPTIRS_WG={wg}", f"-DOPTIRS_CHUNK={chunk}", *format_defines(fmt), f"-DOPTIRS_FMT_USED={used}",
                    f"-DOPTIRS_FMT_SIGNED={signed}", f"-DOPTIRS_FMT_LAMB={int(lamb)}", *num, *registers, *inline_ptx]
        name = (f"formats.{family or 'check'}.{fmt.param_dtype}-{fmt.master}-{fmt.state_dtype}"
                f"{'-sr' if fmt.stochastic else ''}.{used}.{signed}.wg{wg}.chunk{chunk}.slots{slots}")
        source = format_source(family, slots)
        try:
            program = build_program(ctx.context, ctx.device, source, options, name)
        except GpuOptimError as exc:
            # a driver that lists the extension but refuses the option or the inline PTX: built
            # without it (the inline PTX first), and never asked for again in this context
            program, error = None, exc
            if nv_level(ctx) >= 3 and inline_ptx:
                # a driver whose PTX predates the float8 conversions (level 3): level 2 for this
                # program and every later one, the rest of the inline PTX kept
                lower = [o.rsplit("=", 1)[0] + "=2" for o in inline_ptx]
                try:
                    program = build_program(ctx.context, ctx.device, source,
                                            [o for o in options if o not in inline_ptx] + lower, name)
                    warnings.warn(f"the OpenCL driver refused the float8 conversions ({str(error).splitlines()[-1][:200]}):"
                                  " the formats kernels take the integer forms", RuntimeWarning, stacklevel=2)
                    cache["nv_warp"] = 2
                except GpuOptimError as again:
                    error = again
            for optional, flag in ((inline_ptx, "nv_warp"), (registers, "nv_options")):
                if program is not None:
                    break
                if not optional:
                    continue
                warnings.warn(f"the OpenCL driver refused the formats kernels with {optional}: built without "
                              f"({str(error).splitlines()[-1][:200]})", RuntimeWarning, stacklevel=2)
                cache[flag] = 0 if flag == "nv_warp" else False
                options = [o for o in options if o not in optional]
                try:
                    program = build_program(ctx.context, ctx.device, source, options, name)
                    break
                except GpuOptimError as again:
                    error = again
            if program is None:
                raise error from exc
        kernels, types = {}, _arg_types(ctx, family, slots)
        check_argument_space(ctx.device, types)
        for kname, arg_types in types.items():
            kernel = ctx.cl.Kernel(program, kname)
            if kernel.num_args != len(arg_types):
                raise GpuOptimError(f"OpenCL kernel {kname} takes {kernel.num_args} arguments, the host passes "
                                    f"{len(arg_types)}: optirs_formats.cl and opencl/formats.py disagree")
            kernel.set_arg_types(arg_types)
            kernels[kname] = kernel
        if "structs" not in cache:
            _check_structs(ctx, ctx.cl.Kernel(program, "fmt_struct_sizes"))
            cache["structs"] = True
        hit = cache[key] = _Program(kernels, wg, chunk, slots, program)
    return hit


def built_binaries(ctx: Any) -> List[Tuple[str, str, bytes]]:
    """Every formats program built in ``ctx`` so far: (a file name stem, its cache key as text, the
    driver's binary for the device: PTX on NVIDIA's driver), to read what the driver made of the C
    (``benchmarks/bench_formats.py --dump-binaries``)."""
    out = []
    for key, prog in list(_cache(ctx).items()):
        if not (isinstance(key, tuple) and key[0] == "program" and isinstance(prog, _Program)):
            continue
        c, family, used, signed = key[1], key[2], key[3], key[4]
        # the optional options' values: -r<register cap>, -w<warp reduction level>, -p<inline PTX level>,
        # -n0 (no NaN-free rounds)
        tags = {"-cl-nv-maxrreg": "r", "-DOPTIRS_NV_WARP": "w", "-DOPTIRS_NV_PTX": "p", "-DOPTIRS_FMT_NUM": "n",
                "-DOPTIRS_FMT_APPROX": "a"}
        extra = "".join(f"-{tag}{o.split('=')[-1]}" for o in key[-3] + key[-2] + key[-1] for start, tag in tags.items()
                        if o.startswith(start))
        stem = f"{family or 'check'}-{c.param}_{c.grad}_{c.master}_{c.state}_{c.stochastic}-u{used}-s{signed}{extra}"
        binaries = prog.program.get_info(ctx.cl.program_info.BINARIES)
        out.append((stem, repr(key), bytes(binaries[0]) if binaries else b""))
    return out


def _check_structs(ctx: Any, kernel: Any) -> None:
    cl = ctx.cl
    out = np.zeros(3, np.int32)
    buf = cl.Buffer(ctx.context, cl.mem_flags.WRITE_ONLY, out.nbytes)
    kernel.set_arg(0, buf)
    cl.enqueue_nd_range_kernel(ctx.queue, kernel, (1,), None)
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


_DTYPE_OK: Dict[Tuple[Any, str], bool] = {}


def _dtype_ok(dt: Any, dtype: str) -> bool:
    """Whether a device array of numpy dtype ``dt`` holds ``dtype`` (memoized)."""
    key = (dt, dtype)
    ok = _DTYPE_OK.get(key)
    if ok is None:
        if dtype == "float32":
            ok = dt == np.float32
        else:
            ok = dt.itemsize == 2 and (dt == np.uint16 or dtype_name(dt) == dtype)
        _DTYPE_OK[key] = ok = bool(ok)
    return ok


class _Packed(list):
    """Per-tensor views into one flat device array at the layout's offsets."""

    flat: Any = None


def _stage_numpy(ctx: Any, params: List[np.ndarray], grads: List[np.ndarray], fmt: StepFormat) -> Staged:
    p_host = [_host_bits(np.asarray(p), fmt.param_dtype, f"params[{i}]") for i, p in enumerate(params)]
    g_host = [_host_bits(np.asarray(g), fmt.grad_dtype, f"grads[{i}]") for i, g in enumerate(grads)]
    sizes = tuple(int(p.size) for p in p_host)
    if sum(sizes) == 0:
        return Staged(list(params), list(grads))
    offsets, total = aligned_offsets(sizes)  # each tensor on the vector grid
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
        for views, arrays in ((pv, p_host), (gv, g_host)):
            host = pack_into(np.zeros(total, views.flat.dtype), arrays, offsets)
            cl.enqueue_copy(q, views.flat.base_data, host, is_blocking=True)
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
                 key: Tuple[Any, ...], tables: Any, slots: int):
        self.refs = [weakref.ref(a) for a in params] + [weakref.ref(a) for a in grads]
        self.key, self.tables, self.slots = key, tables, slots
        s_offs = key[1]
        ntens = len(layout)
        tens = np.zeros((ntens, 8), np.int64)
        grouper = SlotGrouper(tables, slots)
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
        return all(map(operator.is_, [r() for r in refs], itertools.chain(params, grads)))

    def launch(self, ctx: Any, prog: _Program, name: str, params: List[Any], grads: List[Any],
               state: Sequence[Any], tail: Sequence[Any]) -> None:
        """``name`` over every launch group: its slot buffers, ``state``, the tables, then ``tail``."""
        tables, most = self.tables, resident_groups(ctx, prog.wg, RESIDENT_VARIABLE)
        for g in self.groups:
            nchunks = g.chunk_end - g.chunk_begin
            head = [*g.buffers(ctx, params, grads), *state, self.tens, tables.chunk_tensor,
                    tables.chunk_start, g.chunk_begin, nchunks]
            deal(ctx, prog.kernels[name], prog.wg, head, nchunks, tail, most)


def _plan(ctx: Any, name: str, params, grads, layout, table: Optional[np.ndarray], s_offs: Tuple[int, ...],
          prog: _Program) -> _Plan:
    """The cached plan ``name`` ("step", "check", "lamb") of this layout for these arrays, over
    ``prog``'s chunks and slots."""
    from optirs.backends.opencl.context import _layout_tables

    tables = _layout_tables(ctx, layout, prog.chunk)
    cache = layout.cache.setdefault(("opencl-formats", id(ctx)), {})
    plan = cache.get(name)
    key = (table is not None and bool((table[:, 1] >= 0).any()), s_offs, prog.chunk, prog.slots)
    if plan is None or not plan.matches(params, grads, key):
        plan = cache[name] = _Plan(ctx, params, grads, layout, table, key, tables, prog.slots)
    return plan


# ---------------------------------------------------------------- the step's buffers


def _part(ctx: Any, a: Any) -> Tuple[Any, int]:
    """(cl buffer, element offset) of a device array, the dummy buffer for None or an empty array."""
    if a is None or not a.size:
        return ctx.dummy, 0
    return a.base_data, a.offset // a.dtype.itemsize


def _state_args(ctx: Any, family: str, state: Dict[str, Any], fs: FormatState, found_inf: Any):
    """The kernel's buffer arguments (M, S0-2, C0-2, L0-2, maps), the offsets record, the used and
    signed masks, and the state offsets the alignment flag depends on. The codes are each slot's
    ``<slot>.codes`` or ``<slot>.sqrt_codes`` (``FormatState.slot_buffers``); only the dynamic map's
    programs read the maps (the square-root codes are arithmetic: the dummy buffer stands in)."""
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
    maps = _maps(ctx) if fs.fmt.state_dtype == "int8" else ctx.dummy
    return [m_buf, *s_bufs, *c_bufs, *l_bufs, maps], record, used, signed_mask, skip_buf, s_offs


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
            try:  # the distinct dtypes first: a step checks every array
                ok = all(_dtype_ok(dt, dtype) for dt in {a.dtype for a in arrays})
            except AttributeError:
                ok = False
            if ok:
                continue
            for i, a in enumerate(arrays):
                if not isinstance(a, np.ndarray) and hasattr(a, "dtype") and not _dtype_ok(a.dtype, dtype):
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
        bufs, offs, used, signed_mask, skip, s_offs = _state_args(ctx, family, state, format_state, found_inf)
        prog = _program(ctx, fmt, family, used, signed_mask)
        st = np.array((int(seed) & 0xFFFFFFFF, int(step) & 0xFFFFFFFF), STEP)
        rec = np.array(tuple(scalars), ctx.records[family])
        cl = ctx.cl
        with ctx.lock:
            try:
                plan = _plan(ctx, "lamb" if family == "lamb" else "step", params, grads, layout,
                             format_state.tensor_table(), s_offs, prog)
                if family == "lamb":
                    _lamb(ctx, prog, plan, layout, params, grads, bufs, offs, skip, st, rec, scalars)
                    return
                plan.launch(ctx, prog, f"{family}_fmt", params, grads, [*bufs, offs], [skip, st, rec])
            except cl.Error as exc:
                raise ctx.translate(exc, f"running the {family} format step over {n} elements") from exc

    def _formats_check(self, ctx, grads, layout, fmt, flag) -> None:
        if layout.total == 0:
            return
        if flag.offset:
            raise InvalidParameterError("flag is a view at a non-zero offset, expected a 1-element int32 array")
        prog = _program(ctx, fmt)
        cl = ctx.cl
        with ctx.lock:
            try:
                # the check reads gradients only: the parameter slots hold the gradients' buffers
                plan = _plan(ctx, "check", grads, grads, layout, None, (0,) * 7, prog)
                plan.launch(ctx, prog, "fmt_check", grads, grads, [], [flag.base_data])
            except cl.Error as exc:
                raise ctx.translate(exc, f"checking {layout.total} gradients") from exc


def _lamb(ctx, prog, plan, layout, params, grads, bufs, offs, skip, st, rec, scalars) -> None:
    from optirs.backends.opencl.context import _lamb_scratch

    q, wg, k = ctx.queue, ctx.work_group, ctx.kernels
    tables = plan.tables
    partial_g, partial_pu, scale, ratio = _lamb_scratch(ctx, layout, tables)
    clip = np.int32(scalars.max_grad_norm > 0)
    state = [*bufs, offs]
    if clip:
        plan.launch(ctx, prog, "fmt_lamb_grad_sumsq", params, grads, [], [partial_g])
        k["lamb_grad_scale"](q, (wg,), (wg,), partial_g, tables.total_chunks, scalars.max_grad_norm,
                             scalars.grad_factor, scale)
    plan.launch(ctx, prog, "fmt_lamb_norms", params, grads, state, [scale, clip, partial_pu, st, rec])
    k["lamb_trust_ratios"](q, (len(layout) * wg,), (wg,), partial_pu, tables.first_chunk, tables.nchunks,
                           scalars.max_trust_ratio, ratio)
    plan.launch(ctx, prog, "fmt_lamb_apply", params, grads, state, [scale, clip, ratio, skip, st, rec])
