"""The cpu backend's ``fake_quant`` capability: numba parallel loops over host arrays.

The loops call the shared per-element math (:func:`optirs.backends.common.fake_quant.fq_element`,
compiled here with ``njit``). They are compiled on first use, so opening the registry does not
import numba; ``cache=True`` keeps the machine code on disk for the next process.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from optirs.backends.common.fake_quant import NO_KEY, ZERO, fq_element
from optirs.core.errors import UnsupportedOperationError
from optirs.plugin.hookspecs import FakeQuantGrid, StochasticKeys, hookimpl

# Elements per parallel task. Each task walks its range in runs of one channel, with that
# channel's scalars hoisted: the inner loops are plain loops that LLVM vectorizes.
CPU_BLOCK = 1 << 14

_LOOPS: Optional[Tuple[Any, Any]] = None


def _build_loops() -> Tuple[Any, Any]:
    from numba import prange
    from optirs.core.compile_cache import cached_njit

    from optirs.core.compile_cache import prepare_kernel_compilation

    prepare_kernel_compilation()

    fq = cached_njit(inline="always")(fq_element)

    @cached_njit(parallel=True)
    def forward(x, out, mask, inv, scale, zp, inner, nch, qmin, qmax, int64_cast, stochastic, key_lo, key_hi):
        """Forward over a flat float32 array; element i belongs to channel (i // inner) % nch."""
        n = x.size
        for b in prange((n + CPU_BLOCK - 1) // CPU_BLOCK):
            i = b * CPU_BLOCK
            stop = min(i + CPU_BLOCK, n)
            while i < stop:
                row = i // inner
                end = min(stop, (row + 1) * inner)
                c = row % nch
                iv, s, z = inv[c], scale[c], zp[c]
                # The flags are constant per call: one branch per run keeps each inner loop simple.
                if stochastic:
                    for j in range(i, end):
                        out[j], mask[j] = fq(x[j] * iv, s, z, qmin, qmax, int64_cast, True, key_lo, key_hi, j)
                elif int64_cast:
                    for j in range(i, end):
                        out[j], mask[j] = fq(x[j] * iv, s, z, qmin, qmax, True, False, key_lo, key_hi, j)
                else:
                    for j in range(i, end):
                        out[j], mask[j] = fq(x[j] * iv, s, z, qmin, qmax, False, False, key_lo, key_hi, j)
                i = end

    @cached_njit(parallel=True)
    def backward(x, g, gin, inv, scale, zp, inner, nch, qmin, qmax, int64_cast):
        """Straight-through gradient: ``g`` inside the range (bits unchanged), ``g * 0`` outside (as torch)."""
        n = x.size
        for b in prange((n + CPU_BLOCK - 1) // CPU_BLOCK):
            i = b * CPU_BLOCK
            stop = min(i + CPU_BLOCK, n)
            while i < stop:
                row = i // inner
                end = min(stop, (row + 1) * inner)
                c = row % nch
                iv, s, z = inv[c], scale[c], zp[c]
                for j in range(i, end):
                    o, m = fq(x[j] * iv, s, z, qmin, qmax, int64_cast, False, NO_KEY, NO_KEY, j)
                    gin[j] = g[j] if m else g[j] * ZERO  # selection keeps a NaN gradient's bits
                i = end

    return forward, backward


def loops() -> Tuple[Any, Any]:
    """The compiled (forward, backward) loops."""
    global _LOOPS
    if _LOOPS is None:
        _LOOPS = _build_loops()
    return _LOOPS


def _host(a: Any, name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise UnsupportedOperationError(
            f"{name} of type {type(a).__module__}.{type(a).__qualname__} is a device array but backend='cpu', "
            "expected a numpy array")
    return np.ascontiguousarray(a).reshape(-1)


def _grid_args(grid: FakeQuantGrid):
    return (grid.inv_scale, grid.scale, grid.zero_point, grid.inner, grid.channels, grid.quant_min,
            grid.quant_max, grid.int64_cast)


class CpuFakeQuant:
    """Integer fake-quant and its straight-through gradient on host arrays."""

    @hookimpl
    def optirs_fake_quant_forward(self, ctx: Any, x: Any, grid: FakeQuantGrid,
                                  rounding: Optional[StochasticKeys]) -> Tuple[np.ndarray, np.ndarray]:
        flat = _host(x, "x")
        out, mask = np.empty(grid.size, np.float32), np.empty(grid.size, np.bool_)
        if grid.size:
            keys = rounding if rounding is not None else (NO_KEY, NO_KEY)
            loops()[0](flat, out, mask, *_grid_args(grid), rounding is not None, *keys)
        return out.reshape(grid.shape), mask.reshape(grid.shape)

    @hookimpl
    def optirs_fake_quant_backward(self, ctx: Any, x: Any, grad: Any, grid: FakeQuantGrid) -> np.ndarray:
        flat, g = _host(x, "x"), _host(grad, "grad")
        gin = np.empty(grid.size, np.float32)
        if grid.size:
            loops()[1](flat, g, gin, *_grid_args(grid))
        return gin.reshape(grid.shape)
