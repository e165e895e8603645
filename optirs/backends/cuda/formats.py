"""The cuda backend's step formats (``optirs_step`` with a format): 16-bit parameters, compact masters, compact state.

One launch steps the whole model for every format (LAMB: its passes), see
:mod:`optirs.backends.cuda.formats_kernels`. The kernels are specialised per step format
(parameter and gradient dtypes, master, state dtype, rounding) and family, compiled on first use
and cached per context.

Staging: device arrays are stepped in place through their addresses (the kernels read a pointer
table). A 16-bit array may come as

* a torch CUDA tensor of ``torch.bfloat16`` / ``torch.float16`` (read through ``data_ptr()``, so
  torch versions whose ``__cuda_array_interface__`` refuses bfloat16 work too; torch 2.x exports
  bfloat16 with typestr ``<V2``),
* any ``__cuda_array_interface__`` array with typestr ``<f2`` (float16), ``<V2`` (bfloat16, as
  torch and ml_dtypes spell it) or ``<u2``/``<i2`` (the bit patterns of the format's 16-bit dtype),
* numpy host arrays (float32, ``ml_dtypes.bfloat16``, float16), copied into reused device
  buffers and back after the step.
"""

from __future__ import annotations

import operator
import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from optirs.backends.common.register_cap import formats_register_cap
from optirs.core.arrays import describe
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.core.layout import aligned_offsets, pack_into
from optirs.plugin.hookspecs import Staged

_HALF = ("bfloat16", "float16")
_TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.int16": "bits16", "torch.uint16": "bits16"}
_KEEP = 2  # staging buffers kept per context (the latest models)
RESIDENT_BLOCK = 128  # threads per block of the formats kernels (see _resident_block; H200: 128 < 256 < 512)
_IS = operator.is_


def _name(dtype: Any) -> str:
    """A format dtype as its name ("float32", "bfloat16", "float16")."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _numpy_kind(dtype: np.dtype) -> str:
    if dtype.name in ("float32", "float16", "bfloat16"):
        return dtype.name
    if dtype.kind == "V" and dtype.itemsize == 2 and dtype.fields is None:
        return "bfloat16"  # '<V2': torch's and ml_dtypes' typestr for bfloat16
    if dtype in (np.dtype(np.uint16), np.dtype(np.int16)):
        return "bits16"
    return dtype.str


def device_kind(array: Any, what: str) -> Tuple[str, bool]:
    """(element kind, C-contiguous) of a CUDA device array: "float32", "bfloat16", "float16",
    "bits16" (uint16/int16 patterns) or the dtype string of anything else."""
    module = type(array).__module__
    if module.startswith("torch"):
        if not getattr(array, "is_cuda", False):
            raise InvalidParameterError(f"{what} is a torch tensor on {array.device}, expected a CUDA tensor")
        name = str(array.dtype)
        return _TORCH_DTYPES.get(name, name), bool(array.is_contiguous())
    meta = describe(array, what)
    if meta.kind != "cuda":
        raise InvalidParameterError(f"{what} is a {meta.kind} array, expected a CUDA device array or numpy")
    return _numpy_kind(meta.dtype), meta.contiguous


def _check_kind(kind: str, contiguous: bool, expected: str, what: str) -> None:
    if kind == "bits16" and expected in _HALF:
        kind = expected  # the caller hands the 16-bit patterns; the format names their dtype
    if kind != expected:
        raise InvalidParameterError(
            f"{what} holds {kind} elements, expected {expected} (the step format's dtype; 16-bit arrays may also "
            "come as uint16/int16 bit patterns)")
    if not contiguous:
        raise InvalidParameterError(f"{what} is not C-contiguous, expected a contiguous array (the kernels address it flat)")


class CudaFormats:
    """The step formats' kernels and staging (mixed into :class:`optirs.backends.cuda.CudaBackend`; ``optirs_step`` calls them)."""

    def _formats_check(self, ctx: Any, grads: List[Any], layout: Any, fmt: Any, flag: Any) -> None:
        from numba import types

        from optirs.backends.cuda.context import device_address
        
        if layout.total == 0:
            return
        ctx.resolve_stream(grads[0] if grads else None)
        gdt = _name(fmt.grad_dtype)
        fk = _kernels()
        table = types.int64[:, ::1]
        planned = plan(ctx, f"formats_check_{gdt}", lambda: fk.make_check_kernel(gdt),
                       (table, table, types.int64), ((0,),), layout)
        chunks, nchunks = ctx.chunk_table(layout, planned[1])
        ptrs = self._pointers(ctx, grads, grads, layout)
        address = device_address(flag)
        if address is None:
            raise InvalidParameterError(f"flag is a {type(flag).__name__}, expected a 1-element int32 CUDA device array")
        run(ctx, planned, (chunks, ptrs, nchunks), ((address,),), 0)

    def _formats_step(self, ctx: Any, request: Any) -> None:
        from optirs.backends.cuda.steps import flag_address

        family, params, grads, state, layout = (request.definition.kernel, request.params, request.grads,
                                                request.state, request.layout)
        format_state, fmt, scalars = request.format_state, request.fmt, request.scalars
        controls = request.controls
        seed, step, found_inf = controls.seed, controls.step, controls.found_inf
        if layout.total == 0:
            return
        ctx.resolve_stream(params[0] if params else None)
        name, head, fixed, tensors, fc, signed, used = _setup(ctx, family, state, layout, format_state, fmt)
        found = flag_address(found_inf)
        fk = _kernels()
        ptrs = self._pointers(ctx, params, grads, layout)
        if family == "lamb":
            self._formats_lamb(ctx, fk, name, head, layout, fc, signed, used, ptrs, tensors, fixed, found, seed, step,
                               scalars, fmt)
            return
        args = fixed + (found, int(seed) & 0xFFFFFFFF, int(step), scalars)
        claim = _tuning(ctx, "claim", fk.claim_chunks)
        approx = _tuning(ctx, "approx", fk.approx_steps)
        grid = _tuning(ctx, "grid", _grid)
        planned = plan(ctx, f"formats_step_{name}{'_claim' if claim else ''}{'_approx' if approx else ''}",
                       lambda: fk.make_step_kernel(family, fc, signed, used, claim=claim, approx=approx), head,
                       args, layout, _max_registers(fmt, family),
                       CLAIMED_ROUNDS_PER_CHUNK if claim else ROUNDS_PER_CHUNK, grid)
        chunks, nchunks = ctx.chunk_table(layout, planned[1], grid)
        run(ctx, planned, (chunks, ptrs, tensors, nchunks), args, 3)

    @staticmethod
    def _formats_lamb(ctx, fk, name, head, layout, fc, signed, used, ptrs, tensors, fixed, found, seed, step, scalars,
                      fmt) -> None:
        """LAMB's launches: the gradients' sum of squares (with max_grad_norm), pass 1 (per-tensor sums
        of p^2 and u^2, nothing else written), pass 2 (trust ratios; parameters, masters, moments).
        The sums live in a float64[2, 2 * ntensors + 1] pair of rows used on alternate steps: pass 2
        zeroes the other row, so no step needs a host-side memset (docs/formats.md)."""
        from numba import types

        ntensors = len(layout)
        key = ("cuda.formats.lamb_acc", ntensors)
        acc = layout.cache.get(key)
        if acc is None:
            acc = layout.cache[key] = ctx.upload(np.zeros((2, 2 * ntensors + 1), np.float64))
        q = int(step) & 1
        if scalars.max_grad_norm > 0:
            gdt = _name(fmt.grad_dtype)
            gargs = (acc, ntensors, found, q, scalars)
            planned = plan(ctx, f"formats_lamb_grad_{gdt}", lambda: fk.make_lamb_grad_kernel(gdt),
                           (types.int64[:, ::1], types.int64[:, ::1], types.int64), gargs, layout)
            chunks, nchunks = ctx.chunk_table(layout, planned[1])
            run(ctx, planned, (chunks, ptrs, nchunks), gargs, 2)
        args = fixed + (acc, ntensors, found, int(seed) & 0xFFFFFFFF, int(step), q, scalars)
        for mode in ("lamb_norms", "lamb_apply"):
            planned = plan(ctx, f"formats_{mode}_{name}", lambda: fk.make_step_kernel("lamb", fc, signed, used, mode), head,
                           args, layout, _max_registers(fmt, "lamb"))
            chunks, nchunks = ctx.chunk_table(layout, planned[1])
            run(ctx, planned, (chunks, ptrs, tensors, nchunks), args, 4)

    # ------------------------------------------------ staging

    def _formats_stage(self, ctx: Any, params: List[Any], grads: List[Any], fmt: Any) -> Staged:
        from optirs.backends.cuda.context import DeviceList

        if len(params) != len(grads):
            raise InvalidParameterError(f"{len(params)} params and {len(grads)} grads, expected one gradient per parameter")
        ctx.refuse_capture(ctx.resolve_stream(params[0] if params else None), "an optimizer step")
        pdt, gdt = _name(fmt.param_dtype), _name(fmt.grad_dtype)
        host = [isinstance(a, np.ndarray) for a in list(params) + list(grads)]
        if all(host):
            return self._formats_stage_host(ctx, params, grads, pdt, gdt)
        if any(host):
            raise InvalidParameterError(
                "params/grads mix numpy and device arrays, expected all numpy (uploaded) or all device arrays")
        for label, arrays, expected in (("params", params, pdt), ("grads", grads, gdt)):
            for i, a in enumerate(arrays):
                _check_kind(*device_kind(a, f"{label}[{i}]"), expected, f"{label}[{i}]")
        return Staged(DeviceList(params, ctx.addresses(list(params), "params")),
                      DeviceList(grads, ctx.addresses(list(grads), "grads")))

    @staticmethod
    def _formats_stage_host(ctx: Any, params: Sequence[np.ndarray], grads: Sequence[np.ndarray], pdt: str,
                            gdt: str) -> Staged:
        from optirs.backends.cuda.context import DeviceList, device_address

        for label, arrays, expected in (("params", params, pdt), ("grads", grads, gdt)):
            for i, a in enumerate(arrays):
                kind = _numpy_kind(a.dtype)
                _check_kind(kind, True, expected, f"{label}[{i}]")
        sizes = [int(a.size) for a in params]
        for i, (p, g) in enumerate(zip(params, grads)):
            if g.size != p.size:
                raise InvalidParameterError(f"grads[{i}] has {g.size} elements, expected {p.size} (params[{i}]'s)")
        buffers = _host_buffers(ctx, tuple(a.shape for a in params), tuple(sizes), pdt, gdt)
        dp, dg, offsets = buffers
        psize, gsize = dp.dtype.itemsize, dg.dtype.itemsize
        total = int(offsets[-1])
        if total:
            for arrays, device in ((params, dp), (grads, dg)):
                ctx.write(device[:total], pack_into(np.zeros(total, device.dtype), [_bits(a) for a in arrays],
                                                    offsets[:-1]))
        pbase, gbase = device_address(dp), device_address(dg)
        paddr = tuple(int(pbase + psize * o) for o in offsets[:-1])
        gaddr = tuple(int(gbase + gsize * o) for o in offsets[:-1])

        def finish() -> None:
            if not total:
                return
            out = ctx.download(dp[:total])
            for a, o, n in zip(params, offsets[:-1], sizes):
                _bits(a).reshape(-1)[...] = out[o : o + n]

        return Staged(DeviceList([dp] * len(params), paddr), DeviceList([dg] * len(grads), gaddr), finish)


def _bits(a: np.ndarray) -> np.ndarray:
    """A host array as the kernels see it: float32, or the uint16 patterns of a 16-bit dtype."""
    return a if a.dtype == np.float32 else a.view(np.uint16)


def _host_buffers(ctx: Any, shapes: tuple, sizes: tuple, pdt: str, gdt: str):
    """Reused device buffers (params, grads, offsets) for one model's shapes and dtypes."""
    cache: "OrderedDict[tuple, Any]" = ctx.__dict__.setdefault("_formats_staging", OrderedDict())
    key = (shapes, pdt, gdt)
    hit = cache.get(key)
    if hit is None:
        dtype = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.uint16}
        # each tensor where the layout puts its state, so the kernels' vector accesses apply
        starts, end = aligned_offsets(sizes)
        offsets = np.append(starts, end).astype(np.int64)
        total = max(1, end)
        hit = cache[key] = (ctx.empty(total, dtype[pdt]), ctx.empty(total, dtype[gdt]), offsets)
        while len(cache) > _KEEP:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit


def _setup(ctx: Any, family: str, state: Dict[str, Any], layout: Any, format_state: Any, fmt: Any) -> tuple:
    """What a format step of ``family`` on these state buffers launches with, besides the arrays that
    may move (kernel name, argument types, the maps and buffer addresses, the tensor table, codes,
    signs): worked out once per layout, format and state, so a step only reads the parameters and
    gradients (a replaced state dict is worked out again)."""
    key = ("cuda.formats.setup", family, fmt)
    hit = layout.cache.get(key)
    if hit is not None and hit[0] is state and hit[1] is format_state:
        return hit[2]
    from numba import types

    definition = _definition(family)
    # The state's buffers depend on the storage only: gradients may come in either dtype.
    if replace(format_state.fmt, grad_dtype=fmt.grad_dtype) != fmt:
        raise InvalidParameterError(f"fmt={fmt} but format_state was made for {format_state.fmt}, "
                                    "expected the same storage format")
    fc = fmt.codes
    signed = tuple(bool(getattr(s, "signed", True)) for s in definition.slots)
    slots, used = [0] * 9, 0
    for k, name in enumerate(definition.slot_names()):
        if name not in format_state.slot_names:
            continue
        used |= 1 << k
        for j, buffer in enumerate(format_state.slot_buffers(name)):
            slots[k + 3 * j] = _address(state, buffer)
    master = format_state.master_buffer()
    maddr = _address(state, master) if master is not None else 0
    maps, tables = _maps(ctx)
    table = types.int64[:, ::1]
    # the slots in use are compiled in: an unused slot (Adam's max_exp_avg_sq without amsgrad) costs
    # neither registers nor instructions
    name = f"{family}_{'_'.join(map(str, fc))}_{''.join('s' if x else 'u' for x in signed)}_{used}"
    setup = (name, (table, table, table, types.int64), (maps, tables, maddr, tuple(slots)),
             _tensor_table(ctx, layout, format_state), fc, signed, used)
    layout.cache[key] = (state, format_state, setup)
    return setup


def _definition(family: str) -> Any:
    """The definition whose kernel family is ``family`` (its slots give the element step's slot order)."""
    from optirs.core.definitions import DEFINITIONS
    from optirs.core.formats import FORMAT_FAMILIES

    if family in FORMAT_FAMILIES:
        for d in DEFINITIONS.values():
            if d.kernel == family:
                return d
    raise UnsupportedOperationError(
        f"family={family!r}: the cuda backend's formats step runs {list(FORMAT_FAMILIES)}")


def _address(state: Dict[str, Any], buffer: str) -> int:
    from optirs.backends.cuda.context import device_address

    array = state.get(buffer)
    address = device_address(array) if array is not None else None
    if address is None:
        raise InvalidParameterError(f"state[{buffer!r}] is {type(array).__name__}, expected the CUDA device buffer "
                                    "of format_state.buffer_sizes()")
    return address


def _maps(ctx: Any):
    """(float32[4, 256], uint8[2, TABLE_SIZE]) on the device, once per context: the signed map and its
    midpoints, the unsigned map and its midpoints (each 255 midpoints padded with +inf), and the two
    maps' bucket tables (:mod:`optirs.backends.common.int8_buckets`)."""
    maps = ctx.__dict__.get("_formats_maps")
    if maps is None:
        from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints
        from optirs.core.formats import dynamic_map

        host = np.empty((4, 256), np.float32)
        for row, signed in ((0, True), (2, False)):
            host[row] = dynamic_map(signed)
            host[row + 1] = padded_midpoints(signed)
        tables = np.stack([bucket_table(True), bucket_table(False)])
        maps = ctx._formats_maps = (ctx.upload(host), ctx.upload(np.ascontiguousarray(tables)))
    return maps


def _tensor_table(ctx: Any, layout: Any, format_state: Any):
    key = ("cuda.formats.tensors", format_state.fmt)
    table = layout.cache.get(key)
    if table is None:
        table = layout.cache[key] = ctx.upload(np.ascontiguousarray(format_state.tensor_table(), dtype=np.int64))
    return table


def _kernels():
    import optirs.backends.cuda.formats_kernels as formats_kernels

    return formats_kernels


# Blocks that take every grid-th chunk: a chunk's setup (its tensor's pointers, block and scale
# addresses, its round count) cost about 5 instructions an element at 4 rounds a chunk; 16 rounds
# took 2-5% less kernel time in the int8 kernels on the H200 (docs/benchmarks.md, 2026-12-05).
ROUNDS_PER_CHUNK = 16
# Blocks that claim chunks from a counter: no block waits on a share of a long tensor while the
# others are done, so small chunks pay; 2 rounds took 3-9% less kernel time than 16 on GPT-2 1.3B
# shapes and about as much on 124M on the H100 (docs/benchmarks.md, 2026-12-06).
CLAIMED_ROUNDS_PER_CHUNK = 2


def plan(ctx: Any, name: str, factory: Any, head_types: tuple, args: tuple, layout: Any, max_registers: int = 0,
         rounds: int = ROUNDS_PER_CHUNK, chunk_grid: int = 0):
    """(compiled kernel, chunk elements, grid, block) of ``factory()``'s kernel on ``layout``:
    compiled once per context and signature (``head_types`` and the types of ``args``; at most
    ``max_registers`` per thread when non-zero), sized once per layout (8 elements per thread,
    ``rounds`` rounds a chunk), never more blocks than the chunks of the table it runs over
    (``TensorLayout.chunks(chunk, chunk_grid)``)."""
    import numba

    key = ("cuda.formats.plan", name)
    plan = layout.cache.get(key)
    if plan is None:
        pyfunc = ctx.__dict__.setdefault("_formats_pyfuncs", {}).get(name)
        if pyfunc is None:
            pyfunc = ctx._formats_pyfuncs[name] = factory()
        compiled = ctx.compiled(name, pyfunc, head_types + tuple(numba.typeof(a) for a in args),
                                max_registers=max_registers)
        grid, block = compiled.launch_size(ctx, (layout.total + 7) // 8, resident_block=_resident_block())
        chunk = _chunk_elements(ctx, block, rounds)
        nchunks = len(layout.chunks(chunk, chunk_grid)[0])
        plan = layout.cache[key] = (compiled, chunk, max(1, min(grid, nchunks)), block)
    return plan


def _tuning(ctx: Any, name: str, read: Any) -> Any:
    """``read()`` (a tuning variable's value) once per context, at its first formats step: a step
    reads no environment."""
    key = f"_formats_{name}"
    value = ctx.__dict__.get(key)
    if value is None:
        value = ctx.__dict__[key] = read()
    return value


def _grid() -> int:
    """The pointwise formats kernels' chunks cut where each tensor's state offsets cross the chunk
    size's grid (``TensorLayout.chunks(chunk, 256)``): every chunk but a tensor's first and last is
    one aligned piece of the flat buffers, where chunks counted from each tensor's start straddled
    two (GPT-2 124M's tensors are multiples of 256, not of the chunk): 1.3-4.7% less kernel time in
    the one-byte rows on 124M, none elsewhere (docs/benchmarks.md, 2026-12-07 07:53).
    ``OPTIRS_CUDA_FORMATS_GRID=0`` (tuning): chunks from each tensor's start."""
    text = os.environ.get("OPTIRS_CUDA_FORMATS_GRID", "256").strip()
    if text not in ("0", "256"):
        raise InvalidParameterError(f"OPTIRS_CUDA_FORMATS_GRID={text!r}, expected 0 or 256")
    return int(text)


def _chunk_elements(ctx: Any, block: int, rounds: int = ROUNDS_PER_CHUNK) -> int:
    """The formats kernels' chunk: ``rounds`` rounds of ``block`` threads, 8 elements each (a
    128-thread block takes 2048 elements in 2 rounds); with :data:`ROUNDS_PER_CHUNK`, never less
    than the plain kernels' chunk. ``OPTIRS_CUDA_FORMATS_CHUNK`` (tuning): another size, a multiple
    of 1024 elements (0 for the default)."""
    text = os.environ.get("OPTIRS_CUDA_FORMATS_CHUNK", "").strip()
    if text:
        if not text.isdigit() or int(text) % 1024:
            raise InvalidParameterError(f"OPTIRS_CUDA_FORMATS_CHUNK={text!r}, expected a multiple of 1024 elements "
                                        "(0: the default)")
        if int(text):
            return int(text)
    elements = -(-block * 8 * rounds // 1024) * 1024
    return max(ctx.kernels.chunk_elements(block), elements) if rounds >= ROUNDS_PER_CHUNK else elements


def _max_registers(fmt: Any, family: str) -> int:
    """The register cap of ``family``'s formats kernels (optirs.backends.common.register_cap);
    ``OPTIRS_CUDA_FORMATS_MAXREG`` (tuning): a cap for every formats kernel, 0 for none."""
    return formats_register_cap(fmt, "OPTIRS_CUDA_FORMATS_MAXREG", _kernels().full_group_rounds(fmt.codes, family))


def _resident_block() -> int:
    """The formats kernels' block size, in a grid of as many blocks as stay resident (each block loops
    over chunks). One block per chunk of the occupancy plugin's largest block left one block per SM
    for these register-heavy kernels: every block's start (its chunk's tables, the int8 maps into
    shared memory) and its last warps' tail went unhidden. ``OPTIRS_CUDA_FORMATS_BLOCK`` (tuning):
    another size; 0 for the plugin's launch."""
    return int(os.environ.get("OPTIRS_CUDA_FORMATS_BLOCK", str(RESIDENT_BLOCK)) or 0)


def run(ctx: Any, plan: tuple, head: tuple, args: tuple, ndyn: int) -> None:
    """Launch a planned kernel with ``head + args``.

    ``args[-1]`` is the trailing record (the scalars, rewritten in place by the prepared launch)
    and the ``ndyn`` integers before it may change every step (the step count, the address of the
    caller's found_inf flag): they are rewritten in the prepared argument block, not keyed.
    """
    from optirs.backends.cuda.context import PreparedLaunch, argument_key

    compiled, _, grid, block = plan
    stable = head + args[: len(args) - 1 - ndyn]
    dyn, sc = args[len(args) - 1 - ndyn : -1], args[-1]
    # the very objects of this plan's last launch (one plan per kernel and layout; cached tables and
    # setup): that launch, unkeyed
    last = ctx.__dict__.setdefault("_formats_last", {}).get(id(plan))
    if last is not None and last[1] is compiled and len(last[0]) == len(stable) and all(map(_IS, last[0], stable)):
        prepared = last[2]
    else:
        launches: "OrderedDict[tuple, Any]" = ctx.__dict__.setdefault("_formats_launches", OrderedDict())
        key = (id(compiled), grid, block) + argument_key(stable)
        prepared = launches.get(key)
        if prepared is None:
            # another table of the last launch's pointer tables (a new address set): prepared with it
            prepared = last[2].sibling(stable) if last is not None and last[1] is compiled else None
            if prepared is None:
                prepared = PreparedLaunch(ctx, compiled, stable + dyn + (sc,), grid, block)
                ctx.prepare_siblings(prepared, stable + dyn + (sc,))
            launches[key] = prepared
            while len(launches) > 16:
                launches.popitem(last=False)
        else:
            launches.move_to_end(key)
        memo = ctx._formats_last
        memo[id(plan)] = (stable, compiled, prepared)
        while len(memo) > 16:
            memo.pop(next(iter(memo)))
    if prepared.fn is None:  # numba's launch (simulator): the arguments as they are now
        compiled.dispatcher[grid, block, ctx.nstream](*stable, *dyn, sc)
        return
    if ndyn:
        end = len(prepared.cargs) - prepared.nsc
        for cval, value in zip(prepared.cargs[end - ndyn : end], dyn):
            cval.value = int(value)
    prepared(sc, ctx.stream, ctx.nstream)
