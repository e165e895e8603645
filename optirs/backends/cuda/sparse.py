"""The cuda backend's ``sparse`` capability: row-sparse Adam and SGD steps, one launch per table.

The kernels are :mod:`optirs.backends.cuda.sparse_kernels` (compiled on the first step). A step
uploads the segment arrays in one host-to-device copy, then launches the lazy kernel over the
touched elements, or (dense decay) scatters ``row_position``, launches over the whole table and
clears it again (two O(touched rows) launches around the one table-sized launch).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from optirs.core.arrays import describe
from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import SparseRows, SparseTable, Staged, hookimpl

# Per context: one-element stand-ins for state slots the hyperparameters do not use (never
# indexed). Keyed by the context itself: an id()-keyed cache could hand a freed context's
# array to a new one.
_STAND_INS: "weakref.WeakKeyDictionary[Any, Dict[Tuple[str, int], Any]]" = weakref.WeakKeyDictionary()


def _stand_in(ctx: Any, dtype: Any, ndim: int) -> Any:
    cache = _STAND_INS.setdefault(ctx, {})
    key = (np.dtype(dtype).str, ndim)
    if key not in cache:
        cache[key] = ctx.upload(np.zeros((1,) * ndim, dtype))
    return cache[key]


def _adopt(ctx: Any, array: Any, what: str) -> Tuple[Any, Optional[np.ndarray]]:
    """(device array for the kernels, host array to write back or None)."""
    kind = describe(array, what).kind
    if kind == "numpy":
        return ctx.upload(np.ascontiguousarray(array)), array
    if kind == "cuda":
        return (array if hasattr(array, "copy_to_host") else ctx.cuda.as_cuda_array(array)), None
    raise InvalidParameterError(f"{what} is a {kind} array, expected numpy or a CUDA device array on backend 'cuda'")


def _segments(ctx: Any, grad: SparseRows):
    """The three index arrays on the device: one host-to-device copy, then views into it."""
    both = ctx.upload(np.concatenate([grad.rows, grad.segments, grad.order]))
    a, b = grad.rows.size, grad.rows.size + grad.segments.size
    return both[:a], both[a:b], both[b:]


def _rows(flat: Any, table: SparseTable) -> Any:
    return flat.reshape(table.num_rows, table.dim)


class CudaSparse:
    """Hooks of the ``sparse`` capability (mixed into :class:`optirs.backends.cuda.CudaBackend`)."""

    @staticmethod
    def _launcher(ctx: Any) -> Callable[..., None]:
        import optirs.backends.cuda.sparse_kernels as sparse_kernels

        compiled = sparse_kernels.kernels()

        def run(name: str, items: int, *args: Any) -> None:
            if items:
                compiled[name][sparse_kernels.grid(items), sparse_kernels.BLOCK, ctx.nstream](*args)

        return run

    @hookimpl
    def optirs_sparse_stage(self, ctx: Any, tables: List[Any], values: List[Any]) -> Staged:
        # The step's stream and the capture guard (the row indices are host values, uploaded per step).
        ctx.refuse_capture(ctx.resolve_stream(tables[0] if tables else None), "a sparse optimizer step")
        staged = [_adopt(ctx, p, f"params[{i}]") for i, p in enumerate(tables)]
        dvalues = [_adopt(ctx, v, f"values[{i}]")[0] for i, v in enumerate(values)]

        def finish() -> None:
            for device, host in staged:
                if host is not None:
                    host[...] = ctx.download(device).reshape(host.shape)

        writes_back = any(host is not None for _, host in staged)
        return Staged([d for d, _ in staged], dvalues, finish if writes_back else None)

    @hookimpl
    def optirs_sparse_adam_step(self, ctx: Any, table: SparseTable, grad: SparseRows, scalars: Any,
                                dense_decay: bool) -> None:
        run, s = self._launcher(ctx), table.state
        rows, seg, order = _segments(ctx, grad)
        n, dim = grad.rows.shape[0], table.dim
        m, v = _rows(s["exp_avg"], table), _rows(s["exp_avg_sq"], table)
        if not dense_decay:
            run("adam_lazy", n * dim, table.param, m, v, rows, seg, order, grad.values, scalars)
            return
        pos = s["row_position"]
        run("scatter_positions", n, pos, rows, False)
        run("adam_dense", table.num_rows * dim, table.param, m, v, pos, seg, order, grad.values, scalars)
        run("scatter_positions", n, pos, rows, True)

    @hookimpl
    def optirs_sparse_sgd_step(self, ctx: Any, table: SparseTable, grad: SparseRows, scalars: Any,
                               first_scalars: Any, dense_decay: bool) -> None:
        run, s = self._launcher(ctx), table.state
        rows, seg, order = _segments(ctx, grad)
        n, dim = grad.rows.shape[0], table.dim
        buf = _rows(s["momentum_buffer"], table) if "momentum_buffer" in s else _stand_in(ctx, np.float32, 2)
        if not dense_decay:
            seen = s["row_seen"] if "row_seen" in s else _stand_in(ctx, np.uint8, 1)
            run("sgd_lazy", n * dim, table.param, buf, seen, rows, seg, order, grad.values, scalars, first_scalars)
            # Every thread of a row must first read the old flag: mark after the step's launch.
            if "row_seen" in s:
                run("mark_seen", n, seen, rows)
            return
        pos = s["row_position"]
        run("scatter_positions", n, pos, rows, False)
        run("sgd_dense", table.num_rows * dim, table.param, buf, pos, seg, order, grad.values, scalars)
        run("scatter_positions", n, pos, rows, True)
