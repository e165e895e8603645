"""The opencl backend's mixed-precision passes: OpenCL C, one launch per tensor per pass.

The kernels are ``optirs/backends/common/kernels/optirs_mixed_precision.cl``, built once per
opened context through :mod:`optirs.backends.common.opencl_source`. Half tensors are the
caller's ``pyopencl.array.Array`` objects (separate buffers), read and written at their element
offsets; the float32 buffers are the flat arrays the wrapper allocated.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Tuple

import numpy as np

from optirs.backends.common.opencl_source import program_source
from optirs.core.arrays import ArrayMeta, describe
from optirs.core.errors import InvalidParameterError
from optirs.core.layout import TensorLayout
from optirs.plugin.hookspecs import hookimpl

KERNEL_FILE = "optirs_mixed_precision.cl"
# Work items per group the global size is rounded up to (the kernels check their bound).
GROUP = 256

# OpenCL context object -> its built kernels and flag buffer; dies with the context.
_built: "weakref.WeakKeyDictionary[Any, Dict[str, Any]]" = weakref.WeakKeyDictionary()


def opencl_kernels(ctx: Any) -> Dict[str, Any]:
    """``{"unscale", "narrow", "found"}``: the two kernels and the found-inf word, built for an
    optirs OpenCL context (once per context)."""
    hit = _built.get(ctx)
    if hit is None:
        import pyopencl as cl

        from optirs.backends.opencl.context import build_program

        program = build_program(ctx.context, ctx.device, program_source(KERNEL_FILE), [], "mixed_precision")
        hit = {"unscale": program.optirs_mp_unscale, "narrow": program.optirs_mp_narrow,
               "found": cl.Buffer(ctx.context, cl.mem_flags.READ_WRITE, 4)}
        _built[ctx] = hit
    return hit


def _parts(a: Any, itemsize: int) -> Tuple[Any, np.uint64, int]:
    """(buffer, element offset, element count) of a pyopencl array."""
    return a.base_data, np.uint64(a.offset // itemsize), int(a.size)


def _global_size(n: int) -> Tuple[int]:
    return (-(-n // GROUP) * GROUP,)


class OpenclMixedPrecision:
    """The ``mixed_precision`` capability of the opencl backend (``pyopencl.array.Array``)."""

    @hookimpl
    def optirs_mixed_precision_describe(self, ctx: Any, array: Any, what: str, half_dtype: np.dtype) -> ArrayMeta:
        if not type(array).__module__.startswith("pyopencl"):
            raise InvalidParameterError(
                f"{what} is a {type(array).__name__}, expected a pyopencl.array.Array on the opencl backend"
            )
        return describe(array, what)  # its extent is the cl_mem handle and byte range: overlaps are found

    @hookimpl
    def optirs_mixed_precision_unscale(self, ctx: Any, grads: List[Any], out: Any, layout: TensorLayout,
                                       inv_scale: np.float32, bfloat16: bool) -> bool:
        import pyopencl as cl

        k = opencl_kernels(ctx)
        cl.enqueue_fill_buffer(ctx.queue, k["found"], np.zeros(1, np.int32), 0, 4)
        out_buf, out_off, _ = _parts(out, 4)
        inv, bf16 = np.float32(inv_scale), np.int32(bool(bfloat16))
        for g, off in zip(grads, layout.offsets):
            buf, g_off, n = _parts(g, 2)
            if n:
                k["unscale"](ctx.queue, _global_size(n), None, buf, g_off, out_buf,
                             np.uint64(int(out_off) + int(off)), np.uint32(n), inv, bf16, k["found"])
        found = np.zeros(1, np.int32)
        cl.enqueue_copy(ctx.queue, found, k["found"])  # blocking: the flag decides the step
        return bool(found[0])

    @hookimpl
    def optirs_mixed_precision_narrow(self, ctx: Any, masters: Any, params: List[Any], layout: TensorLayout,
                                      bfloat16: bool) -> None:
        k = opencl_kernels(ctx)
        master_buf, m_off, _ = _parts(masters, 4)
        bf16 = np.int32(bool(bfloat16))
        for p, off in zip(params, layout.offsets):
            buf, p_off, n = _parts(p, 2)
            if n:
                k["narrow"](ctx.queue, _global_size(n), None, master_buf, np.uint64(int(m_off) + int(off)),
                            buf, p_off, np.uint32(n), bf16)
