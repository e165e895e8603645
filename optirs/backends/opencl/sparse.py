"""The opencl backend's ``sparse`` capability: row-sparse Adam and SGD steps, one launch per table.

The kernels are ``optirs/backends/common/kernels/optirs_sparse.cl`` (program text from
:mod:`optirs.backends.common.opencl_source`), built once per context with the backend's build
options (correctly rounded division and sqrt where the device has them, FP_CONTRACT off), so
the results are those of the numba kernels. pyopencl is imported only once a step runs.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import numpy as np

from optirs.backends.common.opencl_source import program_source, scalar_record
from optirs.core.arrays import describe
from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import SparseRows, SparseTable, Staged, hookimpl

KERNEL_FILE = "optirs_sparse.cl"


class _Program:
    """The built sparse kernels of one context (Kernel objects made once: looking a kernel up by
    name on the program makes a new one per call)."""

    def __init__(self, ctx: Any):
        from optirs.backends.opencl.context import build_program

        program = build_program(ctx.context, ctx.device, program_source(KERNEL_FILE), ctx.build_options, "sparse")
        self.kernels = {k.function_name: k for k in program.all_kernels()}
        self.queue = ctx.queue
        self.stand_in = ctx.dummy  # a small buffer for state slots the hyperparameters do not use

    def run(self, name: str, items: int, *args: Any) -> None:
        if items:
            self.kernels[name](self.queue, (int(items),), None, *args)


_PROGRAMS: "weakref.WeakKeyDictionary[Any, _Program]" = weakref.WeakKeyDictionary()


def _program(ctx: Any) -> _Program:
    prog = _PROGRAMS.get(ctx)
    if prog is None:
        prog = _PROGRAMS[ctx] = _Program(ctx)
    return prog


def _adopt(ctx: Any, array: Any, what: str) -> Tuple[Any, Optional[np.ndarray]]:
    """(pyopencl array for the kernels, host array to write back or None)."""
    import pyopencl.array as cla

    kind = describe(array, what).kind
    if kind == "numpy":
        return cla.to_device(ctx.queue, np.ascontiguousarray(array)), array
    if kind != "opencl" or not isinstance(array, cla.Array):
        raise InvalidParameterError(f"{what} is a {kind} array, expected numpy or a pyopencl.array.Array on backend 'opencl'")
    if array.size and array.context != ctx.context:
        raise InvalidParameterError(f"{what} belongs to another OpenCL context, expected arrays made on "
                                    "optirs.get_backend('opencl').ctx.context (or its .queue)")
    if array.offset:
        # Kernel arguments are whole buffers: a view that starts inside one cannot be passed.
        raise InvalidParameterError(f"{what} is a view at byte offset {array.offset}, expected an array that "
                                    "starts at its buffer's beginning")
    return array, None


def _buffer(array: Any) -> Any:
    return array.data


def _segments(ctx: Any, grad: SparseRows):
    """The three index arrays as separate buffers (kernel arguments must start at their buffer's beginning)."""
    import pyopencl.array as cla

    return tuple(cla.to_device(ctx.queue, a).data for a in (grad.rows, grad.segments, grad.order))


class OpenclSparse:
    """Hooks of the ``sparse`` capability (mixed into :class:`optirs.backends.opencl.OpenclBackend`)."""

    @hookimpl
    def optirs_sparse_stage(self, ctx: Any, tables: List[Any], values: List[Any]) -> Staged:
        staged = [_adopt(ctx, p, f"params[{i}]") for i, p in enumerate(tables)]
        dvalues = [_adopt(ctx, v, f"values[{i}]")[0] for i, v in enumerate(values)]

        def finish() -> None:
            for device, host in staged:
                if host is not None:
                    host[...] = device.get(queue=ctx.queue).reshape(host.shape)

        writes_back = any(host is not None for _, host in staged)
        return Staged([d for d, _ in staged], dvalues, finish if writes_back else None)

    @hookimpl
    def optirs_sparse_adam_step(self, ctx: Any, table: SparseTable, grad: SparseRows, scalars: Any,
                                dense_decay: bool) -> None:
        prog, s = _program(ctx), table.state
        rows, seg, order = _segments(ctx, grad)
        n, dim, rec = grad.rows.shape[0], np.int64(table.dim), scalar_record(scalars)
        p, m, v, values = (_buffer(a) for a in (table.param, s["exp_avg"], s["exp_avg_sq"], grad.values))
        if not dense_decay:
            prog.run("adam_lazy", n * table.dim, p, m, v, rows, seg, order, values, np.int64(n), dim, rec)
            return
        pos = _buffer(s["row_position"])
        prog.run("scatter_pos", n, pos, rows, np.int64(n), np.int32(0))
        prog.run("adam_dense", table.num_rows * table.dim, p, m, v, pos, seg, order, values,
                 np.int64(table.num_rows), dim, rec)
        prog.run("scatter_pos", n, pos, rows, np.int64(n), np.int32(1))

    @hookimpl
    def optirs_sparse_sgd_step(self, ctx: Any, table: SparseTable, grad: SparseRows, scalars: Any,
                               first_scalars: Any, dense_decay: bool) -> None:
        prog, s = _program(ctx), table.state
        rows, seg, order = _segments(ctx, grad)
        n, dim, rec = grad.rows.shape[0], np.int64(table.dim), scalar_record(scalars)
        p, values = _buffer(table.param), _buffer(grad.values)
        buf = _buffer(s["momentum_buffer"]) if "momentum_buffer" in s else prog.stand_in
        if not dense_decay:
            seen = _buffer(s["row_seen"]) if "row_seen" in s else prog.stand_in
            prog.run("sgd_lazy", n * table.dim, p, buf, seen, rows, seg, order, values, np.int64(n), dim, rec,
                     scalar_record(first_scalars))
            if "row_seen" in s:  # after the step: every item of a row reads the old flag
                prog.run("mark_seen", n, seen, rows, np.int64(n))
            return
        pos = _buffer(s["row_position"])
        prog.run("scatter_pos", n, pos, rows, np.int64(n), np.int32(0))
        prog.run("sgd_dense", table.num_rows * table.dim, p, buf, pos, seg, order, values,
                 np.int64(table.num_rows), dim, rec)
        prog.run("scatter_pos", n, pos, rows, np.int64(n), np.int32(1))
