"""The opencl backend's context: choosing a device, building programs, staging areas, launch planning.

:class:`OpenclContext` is what ``optirs_open`` returns: the context, the queue, the built
program with its ``Kernel`` objects (argument types set once), the staging areas of numpy
inputs and the per-layout tables. The hook mixins of the package use these.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from optirs.backends.common.opencl_source import program_source
from optirs.backends.opencl.slots import Group, SlotGrouper, Tickets, check_argument_space, slot_count, slot_macros
from optirs.core.compile_cache import timed_build
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import DeviceMemoryError, GpuOptimError
from optirs.core.layout import aligned_offsets
from optirs.plugin.hookspecs import DeviceInfo

# Elements per work-group in the chunked kernels (a multiple of 4, so chunk starts keep the
# tensor's alignment); the chunk table of a 256M-element model is 32K rows.
CHUNK = 8192
# Work-group size asked for (lowered to the device's limit, kept a power of two for reductions).
WORK_GROUP = 256
KERNEL_FILE = "optirs_steps.cl"
# The elementwise kernel families (each gets <family>_flat4/_flat1/_chunks from STEP_KERNELS) and
# the scalar record of every family (optirs.core.scalars), passed by value as a struct.
ELEMENTWISE = tuple(dict.fromkeys(d.kernel for d in DEFINITIONS.values() if d.pointwise))
RECORDS = {d.kernel: d.scalars_type for d in DEFINITIONS.values()}
# OpenCL error codes that mean "out of memory".
_MEMORY_CODES = {-4, -5, -6, -61}  # MEM_OBJECT_ALLOCATION_FAILURE, OUT_OF_RESOURCES, OUT_OF_HOST_MEMORY, INVALID_BUFFER_SIZE
_MISSING = object()


# ---------------------------------------------------------------- sources and records


def kernel_source(slots: int) -> str:
    """The program text for ``slots`` buffers of each kind per chunked launch: the slot macros,
    optirs_steps.cl with its headers inlined, then the kernels of every elementwise family and the
    struct-size check, generated from the definitions."""
    sizes = "\n".join(f"    out[{k}] = (int)sizeof({family}_scalars);" for k, family in enumerate(RECORDS))
    return "\n".join([
        slot_macros(slots) + program_source(KERNEL_FILE),
        *(f"STEP_KERNELS({family})" for family in ELEMENTWISE),
        "/* Lets the host check that its numpy records have the structs' sizes. */",
        "__kernel void optirs_struct_sizes(__global int *out)\n{",
        sizes,
        f"    out[{len(RECORDS)}] = (int)sizeof(acc_t);",
        "}",
    ])


def kernel_arg_types(records: Dict[str, np.dtype], slots: int) -> Dict[str, list]:
    """The argument types the host passes to each kernel of the program (``None``: a buffer)."""
    u64, u32, i32, f32 = np.uint64, np.uint32, np.int32, np.float32
    pg = [None] * (2 * slots)
    table = [None, None, None, None, u32, u32, None, u32]  # tens, tinfo, chunk table, range, counter
    types: Dict[str, list] = {"optirs_struct_sizes": [None]}
    for fam in ELEMENTWISE:
        rec = records[fam]
        types[f"{fam}_flat4"] = types[f"{fam}_flat1"] = [None, u64, None, u64, None, None, None, u64, u64, rec]
        types[f"{fam}_chunks"] = pg + [None, None, None] + table + [rec]
    lamb = records["lamb"]
    types["lamb_grad_sumsq"] = pg + table + [None]
    types["lamb_grad_scale"] = [None, u32, f32, f32, None]
    types["lamb_moments"] = pg + [None, None] + table + [None, i32, None, lamb]
    types["lamb_trust_ratios"] = [None, None, None, f32, None]
    types["lamb_apply"] = pg + [None, None] + table + [None, lamb]
    return types


def record_dtype(record: type) -> np.dtype:
    """The numpy record matching the OpenCL struct of an optirs.core.scalars NamedTuple (float -> f4, bool -> i4)."""
    fields = []
    for name, ann in record.__annotations__.items():
        # annotations may be strings or ForwardRefs (``from __future__ import annotations``)
        text = ann if isinstance(ann, str) else getattr(ann, "__forward_arg__", getattr(ann, "__name__", str(ann)))
        if text in ("bool",):
            fields.append((name, "<i4"))
        elif text.endswith("float32"):
            fields.append((name, "<f4"))
        else:
            raise GpuOptimError(f"scalar field {record.__name__}.{name} has type {ann!r}, expected np.float32 or bool")
    return np.dtype(fields)


# ---------------------------------------------------------------- choosing a device


class _NoDevice(Exception):
    """Why no device matches (becomes a probe reason or BackendUnavailableError)."""


def _check_choice(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str) and not value.strip()):
        raise _NoDevice(f"{what}={value!r}, expected an index or a (case-insensitive) name substring")
    if isinstance(value, int) and value < 0:
        raise _NoDevice(f"{what}={value!r}, expected an index >= 0")


def _parse_ctx_env(text: str) -> Tuple[Optional[Any], Optional[Any]]:
    """``PYOPENCL_CTX`` as pyopencl reads it: ``platform[:device]``, each an index or a name substring."""
    parts = [s.strip() for s in text.split(":")]
    if len(parts) > 2:
        raise _NoDevice(f"PYOPENCL_CTX={text!r}, expected 'platform[:device]'")
    out: List[Optional[Any]] = []
    for part in parts + [""] * (2 - len(parts)):
        out.append(None if part == "" else int(part) if part.isdigit() else part)
    return out[0], out[1]


def _kind(device: Any) -> str:
    import pyopencl as cl

    t = device.type
    if t & cl.device_type.GPU:
        return "gpu"
    if t & cl.device_type.ACCELERATOR:
        return "accelerator"
    if t & cl.device_type.CPU:
        return "cpu"
    return "other"


def _pick(items: Sequence[Any], choice: Any, what: str, names: Sequence[str]) -> int:
    if isinstance(choice, int):
        if choice >= len(items):
            raise _NoDevice(f"{what}={choice} is out of range, expected an index below {len(items)}: {list(names)}")
        return choice
    for i, name in enumerate(names):
        if choice.lower() in name.lower():
            return i
    raise _NoDevice(f"{what}={choice!r} matches none of {list(names)}")


def select_device(options: Dict[str, Any]) -> Tuple[Any, Any, List[Tuple[Any, Any]]]:
    """(platform, device, every (platform, device) pair) chosen by the options.

    ``platform``/``device`` options (an index or a case-insensitive name substring) come first;
    without either, ``PYOPENCL_CTX`` (``platform[:device]``) is used; otherwise the first GPU,
    then the first accelerator, then the first device. ``device`` as an index counts within the
    chosen platform, or over all platforms' devices in order when no platform is named.
    """
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise _NoDevice(f"no OpenCL platform is installed ({exc}); install a driver or pip install 'optirs[pocl]'") from exc
    pairs = [(p, d) for p in platforms for d in _devices(p)]
    if not pairs:
        raise _NoDevice(f"the OpenCL platforms {[p.name for p in platforms]} have no devices")
    plat, dev = options.get("platform"), options.get("device")
    where = "options"
    if plat is None and dev is None and os.environ.get("PYOPENCL_CTX", "").strip():
        plat, dev = _parse_ctx_env(os.environ["PYOPENCL_CTX"])
        where = f"PYOPENCL_CTX={os.environ['PYOPENCL_CTX']!r}"
    for what, value in (("platform", plat), ("device", dev)):
        if value is not None:
            _check_choice(what, value)
    try:
        if plat is not None:
            chosen = platforms[_pick(platforms, plat, "platform", [p.name for p in platforms])]
            candidates = [(p, d) for p, d in pairs if p == chosen]
            if not candidates:
                raise _NoDevice(f"platform {chosen.name!r} has no devices")
        else:
            candidates = pairs
        if dev is not None:
            p, d = candidates[_pick(candidates, dev, "device", [d.name.strip() for _, d in candidates])]
        else:
            rank = {"gpu": 0, "accelerator": 1}
            p, d = min(candidates, key=lambda pd: rank.get(_kind(pd[1]), 2))  # stable: first of the best kind
    except _NoDevice as exc:
        raise _NoDevice(f"{exc} (from {where})") from None
    return p, d, pairs


def _devices(platform: Any) -> List[Any]:
    import pyopencl as cl

    try:
        return list(platform.get_devices())
    except cl.Error:  # a platform with no devices raises DEVICE_NOT_FOUND
        return []


def describe_device(platform: Any, device: Any, selected: bool = False) -> DeviceInfo:
    import pyopencl as cl

    return DeviceInfo(
        name=device.name.strip(), kind=_kind(device), memory_bytes=int(device.global_mem_size),
        compute_units=int(device.max_compute_units),
        details={
            "platform": platform.name.strip(), "vendor": device.vendor.strip(), "opencl": device.version.strip(),
            "driver": device.driver_version.strip(), "max_work_group_size": int(device.max_work_group_size),
            "max_mem_alloc_size": int(device.max_mem_alloc_size),
            "correctly_rounded_divide_sqrt": bool(device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT),
            "fp64": bool(device.double_fp_config), "selected": selected,
        },
    )


# ---------------------------------------------------------------- building


def build_options(device: Any, work_group: int) -> List[str]:
    import pyopencl as cl

    opts = [f"-DOPTIRS_WG={work_group}", f"-DOPTIRS_CHUNK={CHUNK}"]
    # Without it OpenCL allows 2.5 ulp division and 3 ulp sqrt in float; with it, the numba results.
    if device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
        opts.append("-cl-fp32-correctly-rounded-divide-sqrt")
    return opts


def build_program(context: Any, device: Any, source: str, options: Sequence[str], name: str) -> Any:
    """Build ``source`` for ``device``; a failure is a GpuOptimError carrying the compiler log. A
    build slow enough to have compiled is in the compile log as ``opencl.<name>``."""
    import pyopencl as cl

    program = cl.Program(context, source)
    try:
        start = time.perf_counter()
        built = program.build(options=list(options), devices=[device])
        timed_build(f"opencl.{name}", time.perf_counter() - start,
                    "the OpenCL driver or pyopencl caches the binary: later runs load it")
        return built
    except cl.Error as exc:
        try:
            log = program.get_build_info(device, cl.program_build_info.LOG)
        except cl.Error:
            log = ""
        log = (log or "").strip() or str(exc)
        raise GpuOptimError(
            f"building the optirs OpenCL kernels failed on {device.name.strip()!r} with options {list(options)}:\n"
            f"--- compiler log ---\n{log}"
        ) from exc


def _work_group(device: Any) -> int:
    limit = min(WORK_GROUP, int(device.max_work_group_size))
    return 1 << (limit.bit_length() - 1)


# ---------------------------------------------------------------- the context


class _Packed(list):
    """Per-tensor views into one flat device array, back to back at the layout's offsets."""

    flat: Any = None


class _StagingArea:
    """Device (and, for several tensors, host) buffers that numpy inputs are packed into."""

    def __init__(self, ctx: "OpenclContext", sizes: Tuple[int, ...]):
        # at the layout's offsets, so the flat kernels address params, grads and state alike
        offsets, total = aligned_offsets(sizes)
        self.sizes, self.offsets, self.total = sizes, offsets, total
        self.params = _Packed(); self.grads = _Packed()
        for views in (self.params, self.grads):
            views.flat = ctx.empty(total)
            views.extend(views.flat[int(o): int(o) + int(n)] for o, n in zip(offsets, sizes))
        many = len(sizes) > 1
        # zeros between the tensors: the flat kernels step the gaps too (into nothing anyone reads)
        self.host_p = np.zeros(total, np.float32) if many else None
        self.host_g = np.zeros(total, np.float32) if many else None


class OpenclContext:
    """An opened OpenCL device: context, in-order queue, the built program and its kernels."""

    def __init__(self, platform: Any, device: Any, profiling: bool = False):
        import pyopencl as cl

        self.cl = cl
        self.platform, self.device = platform, device
        self.context = cl.Context([device])
        props = cl.command_queue_properties.PROFILING_ENABLE if profiling else 0
        self.queue = cl.CommandQueue(self.context, device, properties=props)
        self.work_group = _work_group(device)
        self.compute_units = max(1, int(device.max_compute_units))
        self.slots = slot_count(device)  # buffers of each kind per chunked launch
        self.build_options = build_options(device, self.work_group)
        self.program = build_program(self.context, device, kernel_source(self.slots), self.build_options,
                                     f"kernels.slots{self.slots}")
        self.records = {name: record_dtype(cls) for name, cls in RECORDS.items()}
        self.kernels: Dict[str, Any] = {}
        self._make_kernels()
        self.acc_bytes = self._check_structs()
        self.dummy = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, 16)  # stands in for unused slots
        self.tickets = Tickets(self)  # the chunked launches deal chunks from it (slots.deal)
        self.lock = threading.Lock()
        self._staging: Dict[Tuple[int, ...], _StagingArea] = {}

    # kernels are made once, with their argument types, and reused for every launch
    def _make_kernels(self) -> None:
        types = kernel_arg_types(self.records, self.slots)
        check_argument_space(self.device, types)
        for name, arg_types in types.items():
            kernel = self.cl.Kernel(self.program, name)
            if kernel.num_args != len(arg_types):
                raise GpuOptimError(f"OpenCL kernel {name} takes {kernel.num_args} arguments, the host passes "
                                    f"{len(arg_types)}: optirs_steps.cl and opencl.py disagree")
            kernel.set_arg_types(arg_types)
            self.kernels[name] = kernel

    def _check_structs(self) -> int:
        cl = self.cl
        out = np.zeros(len(RECORDS) + 1, np.int32)
        buf = cl.Buffer(self.context, cl.mem_flags.WRITE_ONLY, out.nbytes)
        self.kernels["optirs_struct_sizes"](self.queue, (1,), None, buf)
        cl.enqueue_copy(self.queue, out, buf)
        for size, (name, dtype) in zip(out[:-1], self.records.items()):
            if size != dtype.itemsize:
                raise GpuOptimError(f"OpenCL struct {name}_scalars is {size} bytes but the host record "
                                    f"{RECORDS[name].__name__} is {dtype.itemsize}: optirs_scalars.h and optirs.core.scalars disagree")
        return int(out[-1])

    # ------------------------------------------------------------ memory

    def empty(self, size: int, dtype: Any = np.float32, fill: Optional[float] = None) -> Any:
        """A flat device array; allocation failures become DeviceMemoryError."""
        import pyopencl.array as cla

        cl, dtype = self.cl, np.dtype(dtype)
        nbytes = int(size) * dtype.itemsize
        if size == 0:
            return cla.empty(self.queue, (0,), dtype)
        limit = int(self.device.max_mem_alloc_size)
        if nbytes > limit:
            raise DeviceMemoryError(
                f"could not allocate {nbytes} bytes ({size} x {dtype}) on {self.device.name.strip()!r}: one OpenCL "
                f"buffer may hold at most {limit} bytes (device memory {self.device.global_mem_size} bytes)"
            )
        try:
            buf = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, nbytes)
            if fill is not None:
                cl.enqueue_fill_buffer(self.queue, buf, np.array([fill], dtype), 0, nbytes)
            # OpenCL allocates lazily; waiting here makes an out-of-memory surface now, not mid-step.
            self.queue.finish()
        except cl.Error as exc:
            raise self.translate(exc, f"allocating {nbytes} bytes ({size} x {dtype})") from exc
        return cla.Array(self.queue, (int(size),), dtype, data=buf)

    def translate(self, exc: Exception, what: str) -> GpuOptimError:
        code = getattr(exc, "code", None)
        where = f"{what} on {self.device.name.strip()!r} (device memory {self.device.global_mem_size} bytes, " \
                f"largest buffer {self.device.max_mem_alloc_size} bytes)"
        if code in _MEMORY_CODES or isinstance(exc, self.cl.MemoryError):
            return DeviceMemoryError(f"out of device memory {where}: {exc}")
        return GpuOptimError(f"OpenCL error {where}: {exc}")

    def staging(self, sizes: Tuple[int, ...]) -> _StagingArea:
        area = self._staging.get(sizes)
        if area is None:
            if len(self._staging) >= 4:  # a few models at a time; drop the oldest
                self._staging.pop(next(iter(self._staging)))
            area = self._staging[sizes] = _StagingArea(self, sizes)
        return area

    def __repr__(self) -> str:
        return f"<OpenclContext {self.device.name.strip()!r} on {self.platform.name.strip()!r}>"


# ---------------------------------------------------------------- launch planning


def _cl_array(a: Any) -> bool:
    return type(a).__module__.startswith("pyopencl")


def _flat_range(params: List[Any], grads: List[Any], layout: Any) -> Optional[Tuple[int, int, int, int]]:
    """When the tensors lie back to back at the layout's offsets in one buffer (per kind):
    (index of a tensor holding the parameter buffer, element offset of tensor 0 in it, the same for gradients)."""
    out: List[int] = []
    for arrays in (params, grads):
        base = None
        first = holder = 0
        for t, (a, off, n) in enumerate(zip(arrays, layout.offsets, layout.sizes)):
            if n == 0:
                continue
            if base is None:
                base, holder, first = a.base_data, t, a.offset // 4 - int(off)
                if first < 0:
                    return None
            elif a.base_data != base or a.offset // 4 - int(off) != first:
                return None
        out += [holder, first]
    return out[0], out[1], out[2], out[3]


class _Tables(NamedTuple):
    chunk_tensor: Any  # device int32 per chunk
    chunk_start: Any  # device int64 per chunk
    first_chunk: Any  # device int32 per tensor
    nchunks: Any  # device int32 per tensor
    host_first: np.ndarray  # int64, ntensors + 1 (chunk range of tensor t: host_first[t]:host_first[t+1])
    total_chunks: int


def _layout_tables(ctx: OpenclContext, layout: Any, chunk: int = CHUNK) -> _Tables:
    """The chunk tables of ``layout`` in chunks of ``chunk`` elements, on the device once."""
    cache = layout.cache.setdefault(("opencl", id(ctx)), {})
    name = "tables" if chunk == CHUNK else ("tables", chunk)
    tables = cache.get(name)
    if tables is None:
        cl = ctx.cl
        tensor, start, _ = layout.chunks(chunk)
        counts = np.bincount(tensor, minlength=len(layout)).astype(np.int64) if len(tensor) else np.zeros(len(layout), np.int64)
        first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        def up(a: np.ndarray) -> Any:
            a = np.ascontiguousarray(a)
            return cl.Buffer(ctx.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=a) if a.nbytes else ctx.dummy

        tables = _Tables(up(tensor.astype(np.int32)), up(start.astype(np.int64)), up(first[:-1].astype(np.int32)),
                         up(counts.astype(np.int32)), first, int(len(tensor)))
        cache[name] = tables
    return tables


class _Plan:
    """How one step launches for a given list of arrays: the flat range, or chunk groups and tensor tables.

    Cached per layout and reused while the caller passes the same array objects (checked through
    weak references, so the cache keeps nothing alive); rebuilt otherwise.
    """

    def __init__(self, params: List[Any], grads: List[Any], s_off: int):
        self.refs = [weakref.ref(a) for a in params] + [weakref.ref(a) for a in grads]
        self.s_off = s_off
        self.flat: Optional[Tuple[int, int, int, int]] = None
        self.groups: Optional[List[Group]] = None
        self.tens = self.info = None

    def matches(self, params: List[Any], grads: List[Any], s_off: int) -> bool:
        refs = self.refs
        if s_off != self.s_off or len(refs) != len(params) + len(grads):
            return False
        n = len(params)
        for i, a in enumerate(params):
            if refs[i]() is not a:
                return False
        for i, a in enumerate(grads):
            if refs[n + i]() is not a:
                return False
        return True


def _plan(ctx: OpenclContext, params: List[Any], grads: List[Any], layout: Any, s_off: int, chunked: bool) -> _Plan:
    """The cached plan for these arrays; ``chunked`` asks for chunk groups even when the model is flat (LAMB)."""
    cache = layout.cache.setdefault(("opencl", id(ctx)), {})
    plan = cache.get("plan")
    if plan is None or not plan.matches(params, grads, s_off):
        plan = _Plan(params, grads, s_off)
        plan.flat = _flat_range(params, grads, layout)
        cache["plan"] = plan
    if plan.groups is None and (chunked or plan.flat is None):
        _chunk_groups(ctx, plan, params, grads, layout, _layout_tables(ctx, layout))
    return plan


def _chunk_groups(ctx: OpenclContext, plan: _Plan, params: List[Any], grads: List[Any], layout: Any,
                  tables: _Tables) -> None:
    """Fill the plan's tensor tables and launch groups of at most ``ctx.slots`` distinct buffers of each kind."""
    ntens = len(layout)
    tens = np.zeros((ntens, 4), np.int64)
    info = np.zeros((ntens, 4), np.int32)
    grouper = SlotGrouper(tables, ctx.slots)
    for t in range(ntens):
        n = int(layout.sizes[t])
        s_off = plan.s_off + int(layout.offsets[t])
        if n == 0:
            tens[t] = (0, 0, s_off, 0)
            continue
        if plan.flat is not None:  # one buffer of each kind: every tensor in slot 0
            ph, p0, gh, g0 = plan.flat
            pk, gk, po, go = -1, -1, p0 + int(layout.offsets[t]), g0 + int(layout.offsets[t])
        else:
            p, g = params[t], grads[t]
            ph, gh, pk, gk, po, go = t, t, p.base_data.int_ptr, g.base_data.int_ptr, p.offset // 4, g.offset // 4
        ps, gs = grouper.add(t, pk, gk, ph, gh)
        tens[t] = (po, go, s_off, n)
        info[t] = (ps, gs, int(po % 4 == 0 and go % 4 == 0 and s_off % 4 == 0), 0)
    groups = grouper.finish(ntens)
    cl = ctx.cl
    flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
    plan.tens, plan.info = cl.Buffer(ctx.context, flags, hostbuf=tens), cl.Buffer(ctx.context, flags, hostbuf=info)
    plan.groups = groups


def _lamb_scratch(ctx: OpenclContext, layout: Any, tables: _Tables) -> Tuple[Any, Any, Any, Any]:
    cache = layout.cache.setdefault(("opencl", id(ctx)), {})
    scratch = cache.get("lamb_scratch")
    if scratch is None:
        cl, rw = ctx.cl, ctx.cl.mem_flags.READ_WRITE
        nc = max(tables.total_chunks, 1)
        scratch = (cl.Buffer(ctx.context, rw, nc * ctx.acc_bytes), cl.Buffer(ctx.context, rw, 2 * nc * ctx.acc_bytes),
                   cl.Buffer(ctx.context, rw, 4), cl.Buffer(ctx.context, rw, 4 * max(len(layout), 1)))
        cache["lamb_scratch"] = scratch
    return scratch
