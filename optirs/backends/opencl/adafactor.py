"""The opencl backend's Adafactor step (``adafactor_step`` in optirs_steps.cl).

``adafactor_step`` runs one work-group per tensor. A model in one buffer (numpy inputs are packed
so; a flat parameter buffer of views) is one launch; tensors in separate buffers are one launch
each, since OpenCL 1.2 kernels cannot take a table of buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from optirs.core.errors import GpuOptimError
from optirs.core.factored import factored_layout

def appended_kernels(ctx: Any) -> None:
    """Make (once per context) the ``adafactor_step`` kernel with its argument types."""
    if "adafactor_step" in ctx.kernels:
        return
    cl = ctx.cl
    with ctx.lock:
        if "adafactor_step" in ctx.kernels:
            return
        u64, u32 = np.uint64, np.uint32
        arg_types = [None] * 6 + [u64, None, None, u32, ctx.records["adafactor"]]
        kernel = cl.Kernel(ctx.program, "adafactor_step")
        if kernel.num_args != len(arg_types):
            raise GpuOptimError(f"OpenCL kernel adafactor_step takes {kernel.num_args} arguments, the host passes "
                                f"{len(arg_types)}: optirs_steps.cl and opencl/adafactor.py disagree")
        kernel.set_arg_types(arg_types)
        ctx.kernels["adafactor_step"] = kernel


class OpenclAdafactor:
    """Mixin of OpenclBackend: Adafactor, one work-group per tensor."""

    def _adafactor(self, ctx, request) -> None:
        params, grads, state, layout, scalars = (request.params, request.grads, request.state, request.layout,
                                                 request.scalars)
        from optirs.backends.opencl.context import _flat_range
        from optirs.backends.opencl.steps import _state_base

        if layout.total == 0:
            return
        appended_kernels(ctx)
        cl, wg = ctx.cl, ctx.work_group
        fl = factored_layout(layout)
        rec = np.array(tuple(scalars), ctx.records["adafactor"])
        (row, col, var), s_off = _state_base(ctx, (state["row_var"], state["col_var"], state["variance"]))
        cache = layout.cache.setdefault(("opencl", id(ctx)), {})
        tables = cache.get("adafactor")
        if tables is None:  # the tensor table and the row-mean scratch, once per layout
            flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
            tables = cache["adafactor"] = [cl.Buffer(ctx.context, flags, hostbuf=np.ascontiguousarray(fl.table)),
                                           cl.Buffer(ctx.context, cl.mem_flags.READ_WRITE, 4 * max(1, fl.total_batches)),
                                           None, None]
        table, means = tables[0], tables[1]
        flat = _flat_range(params, grads, layout)
        offs = np.zeros((len(fl), 2), np.int64)
        if flat is not None:
            offs[:, 0] = flat[1] + layout.offsets
            offs[:, 1] = flat[3] + layout.offsets
        else:
            for t, (p, g) in enumerate(zip(params, grads)):
                if layout.sizes[t]:
                    offs[t] = (p.offset // 4, g.offset // 4)
        if tables[2] is None or not np.array_equal(tables[2], offs):  # re-upload only when the inputs moved
            tables[2] = offs
            tables[3] = cl.Buffer(ctx.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=offs)
        kernel = ctx.kernels["adafactor_step"]
        with ctx.lock:
            try:
                if flat is not None:
                    kernel(ctx.queue, (len(fl) * wg,), (wg,), params[flat[0]].base_data, grads[flat[2]].base_data,
                           row, col, var, means, s_off, table, tables[3], 0, rec)
                    return
                for t in range(len(fl)):
                    if layout.sizes[t]:
                        kernel(ctx.queue, (wg,), (wg,), params[t].base_data, grads[t].base_data,
                               row, col, var, means, s_off, table, tables[3], t, rec)
            except cl.Error as exc:
                raise ctx.translate(exc, f"running the adafactor step over {layout.total} elements") from exc
