"""The cpu backend's ``sparse`` capability: row-sparse Adam and SGD steps on numpy tables.

The loops are :mod:`optirs.backends.cpu.sparse_loops` (numba, imported on the first step). Tables
and values are host arrays already, so staging is a check; the step passes the segment arrays
as they are (no copies), and a coalesced gradient reaches the loops without a sort.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import SparseRows, SparseTable, Staged, hookimpl

# Stand-ins for state slots the hyperparameters do not use (never indexed by the loops).
_NO_BUFFER = np.zeros((1, 1), np.float32)
_NO_FLAGS = np.zeros(1, np.uint8)


def _loops():
    import optirs.backends.cpu.sparse_loops as sparse_loops

    return sparse_loops


def _rows(flat: np.ndarray, table: SparseTable) -> np.ndarray:
    return flat.reshape(table.num_rows, table.dim)


class CpuSparse:
    """Hooks of the ``sparse`` capability (mixed into :class:`optirs.backends.cpu.CpuBackend`)."""

    @hookimpl
    def optirs_sparse_stage(self, ctx: Any, tables: List[Any], values: List[Any]) -> Staged:
        for what, arrays in (("params", tables), ("values", values)):
            for i, a in enumerate(arrays):
                if not isinstance(a, np.ndarray):
                    raise InvalidParameterError(
                        f"{what}[{i}] is a {type(a).__module__}.{type(a).__name__}, expected a numpy array "
                        "on the cpu backend")
        return Staged(list(tables), list(values))

    @hookimpl
    def optirs_sparse_adam_step(self, ctx: Any, table: SparseTable, grad: SparseRows, scalars: Any,
                                dense_decay: bool) -> None:
        loops, s = _loops(), table.state
        m, v = _rows(s["exp_avg"], table), _rows(s["exp_avg_sq"], table)
        if not dense_decay:
            loops.adam_lazy(table.param, m, v, grad.rows, grad.segments, grad.order, grad.values, scalars)
            return
        pos = s["row_position"]
        loops.scatter_positions(pos, grad.rows, False)
        try:
            loops.adam_dense(table.param, m, v, pos, grad.segments, grad.order, grad.values, scalars)
        finally:
            loops.scatter_positions(pos, grad.rows, True)

    @hookimpl
    def optirs_sparse_sgd_step(self, ctx: Any, table: SparseTable, grad: SparseRows, scalars: Any,
                               first_scalars: Any, dense_decay: bool) -> None:
        loops, s = _loops(), table.state
        buf = _rows(s["momentum_buffer"], table) if "momentum_buffer" in s else _NO_BUFFER
        if not dense_decay:
            seen = s.get("row_seen", _NO_FLAGS)
            loops.sgd_lazy(table.param, buf, seen, grad.rows, grad.segments, grad.order, grad.values,
                           scalars, first_scalars)
            return
        pos = s["row_position"]
        loops.scatter_positions(pos, grad.rows, False)
        try:
            loops.sgd_dense(table.param, buf, pos, grad.segments, grad.order, grad.values, scalars)
        finally:
            loops.scatter_positions(pos, grad.rows, True)
