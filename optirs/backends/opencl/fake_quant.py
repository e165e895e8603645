"""The opencl backend's ``fake_quant`` capability: ``kernels/fake_quant.cl`` on the backend's queue.

The program text comes from :mod:`optirs.backends.common.opencl_source` and is built once per
opened context, without fast-math options (the source turns ``FP_CONTRACT`` off). Host numpy
inputs are uploaded and the results read back; ``pyopencl.array.Array`` inputs of the same
OpenCL context are read in place and the results stay on the device (the mask as uint8).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

import numpy as np

from optirs.backends.common import opencl_source
from optirs.backends.common.fake_quant import NO_KEY
from optirs.core.errors import ShapeMismatchError, UnsupportedOperationError
from optirs.plugin.hookspecs import FakeQuantGrid, StochasticKeys, hookimpl

KERNEL_FILE = "fake_quant.cl"

# Opened context -> (forward, backward) kernels; the entry goes with the context.
_PROGRAMS: "weakref.WeakKeyDictionary[Any, Tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def kernels(ctx: Any) -> Tuple[Any, Any]:
    """(forward, backward) kernels of ``ctx``'s context, built on first use."""
    found = _PROGRAMS.get(ctx)
    if found is None:
        from optirs.backends.opencl.context import build_program

        program = build_program(ctx.context, ctx.device, opencl_source.program_source(KERNEL_FILE), [], "fake_quant")
        found = _PROGRAMS[ctx] = (program.fake_quant, program.fake_quant_backward)
    return found


def _on_device(ctx: Any, a: Any, name: str) -> bool:
    """Whether ``a`` is an array of ``ctx``'s device (False: a host numpy array); others are refused."""
    import pyopencl.array as cla

    if isinstance(a, np.ndarray):
        return False
    if not isinstance(a, cla.Array):
        raise UnsupportedOperationError(
            f"{name} of type {type(a).__module__}.{type(a).__qualname__} is neither a numpy array nor a "
            "pyopencl.array.Array, expected one of those on backend='opencl'")
    if a.context.int_ptr != ctx.context.int_ptr:
        raise UnsupportedOperationError(
            f"{name} lives in another OpenCL context than backend 'opencl' opened ({ctx.device.name.strip()!r}), "
            "expected an array made on get_backend('opencl').ctx.queue")
    if not a.flags.c_contiguous:
        raise ShapeMismatchError(f"{name} is not C-contiguous, expected a contiguous device array")
    return True


def _buffer(ctx: Any, a: Any, on_device: bool) -> Any:
    """An OpenCL buffer holding ``a``'s elements from its start (a non-empty array)."""
    import pyopencl.array as cla

    if not on_device:
        return cla.to_device(ctx.queue, np.ascontiguousarray(a).reshape(-1)).base_data
    if a.offset:
        a = a.copy()  # the kernels index from the buffer's start
    return a.base_data


def _grid_buffers(ctx: Any, grid: FakeQuantGrid):
    cl = ctx.cl
    flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
    return [cl.Buffer(ctx.context, flags, hostbuf=np.ascontiguousarray(a))
            for a in (grid.inv_scale, grid.scale, grid.zero_point)]


class OpenclFakeQuant:
    """Integer fake-quant and its straight-through gradient as OpenCL C kernels."""

    @hookimpl
    def optirs_fake_quant_forward(self, ctx: Any, x: Any, grid: FakeQuantGrid,
                                  rounding: Optional[StochasticKeys]) -> Tuple[Any, Any]:
        import pyopencl.array as cla

        on_device = _on_device(ctx, x, "x")
        if grid.size == 0:
            if on_device:
                return x.copy(), cla.zeros(ctx.queue, grid.shape, np.uint8)
            return x.copy(), np.zeros(grid.shape, np.bool_)
        bx = _buffer(ctx, x, on_device)
        forward, _ = kernels(ctx)
        out = cla.empty(ctx.queue, grid.shape, np.float32)
        mask = cla.empty(ctx.queue, grid.shape, np.uint8)
        key_lo, key_hi = rounding if rounding is not None else (NO_KEY, NO_KEY)
        forward(ctx.queue, (grid.size,), None, bx, out.base_data, mask.base_data, *_grid_buffers(ctx, grid),
                np.int64(grid.inner), np.int64(grid.channels), grid.quant_min, grid.quant_max,
                np.int32(grid.int64_cast), np.int32(rounding is not None), np.uint64(key_lo), np.uint64(key_hi),
                np.int64(grid.size))
        if on_device:
            return out, mask
        return out.get(), mask.get().astype(np.bool_)

    @hookimpl
    def optirs_fake_quant_backward(self, ctx: Any, x: Any, grad: Any, grid: FakeQuantGrid) -> Any:
        import pyopencl.array as cla

        on_device = _on_device(ctx, x, "x")
        _on_device(ctx, grad, "grad")
        if grid.size == 0:
            return grad.copy()
        bx, bg = _buffer(ctx, x, on_device), _buffer(ctx, grad, on_device)
        _, backward = kernels(ctx)
        gin = cla.empty(ctx.queue, grid.shape, np.float32)
        backward(ctx.queue, (grid.size,), None, bx, bg, gin.base_data, *_grid_buffers(ctx, grid),
                 np.int64(grid.inner), np.int64(grid.channels), grid.quant_min, grid.quant_max,
                 np.int32(grid.int64_cast), np.int64(grid.size))
        return gin if on_device else gin.get()
