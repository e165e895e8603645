"""The row-sparse gradient arithmetic shared by the cpu and cuda sparse kernels (numba).

A row-sparse gradient reaches a kernel as :class:`optirs.plugin.hookspecs.SparseRows`:

- ``rows``: the touched table rows, sorted and unique (int64, ``n``);
- ``segments``: ``n + 1`` offsets; the k-th touched row receives the sum of the gradient rows
  ``values[order[segments[k]]], ..., values[order[segments[k + 1] - 1]]`` (duplicates summed in
  the order they were given);
- ``order``: indices into ``values``' rows (int64, ``nnz``);
- ``values``: the gradient rows, float32 ``(nnz, dim)``.

The lazy kernels run over the ``n * dim`` touched elements only. The dense-decay kernels run over
the whole table and look a row's gradient up in ``row_position`` (``row_position[row] = k``, or -1
for a row with no gradient, whose gradient is zero); it is scattered before and cleared after the
step, so it costs O(n), not O(num_rows).

The segment sums below are the one definition of that order; the per-element optimizer math is
:mod:`optirs.backends.common.elementwise`. The loops are in ``optirs/backends/cpu/sparse.py`` and
``optirs/backends/cuda/sparse.py``; the OpenCL transcription is ``kernels/optirs_sparse.cl``.
"""

from __future__ import annotations

from optirs.core.compile_cache import cached_njit, prepare_kernel_compilation

prepare_kernel_compilation()  # before the first decorator: numba picks the cache directory there


@cached_njit()
def gathered_grad(values, order, start, stop, j):
    """Column ``j`` of the summed gradient rows ``order[start:stop]`` (a non-empty segment).

    One element at a time, for kernels with one thread per (row, column) element (cuda)."""
    g = values[order[start], j]
    for q in range(start + 1, stop):
        g += values[order[q], j]
    return g


@cached_njit()
def row_gradient(values, order, start, stop):
    """The summed gradient row of one segment: a view when it has one contribution (the common
    case), else a new row summed in the given order (the same order as gathered_grad).

    A whole row at a time, for loops over rows (cpu): the column loop then vectorizes."""
    g = values[order[start]]
    if stop - start == 1:
        return g
    acc = g.copy()
    for q in range(start + 1, stop):
        acc += values[order[q]]
    return acc
