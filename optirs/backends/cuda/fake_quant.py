"""The cuda backend's ``fake_quant`` capability: one numba.cuda grid kernel per direction.

The kernels call the shared per-element math (:func:`optirs.backends.common.fake_quant.fq_element`,
compiled here as a device function), one element per thread. ``x * inv_scale`` is multiplied
with ``libdevice.fmul_rn`` so NVVM never contracts it into an FMA (torch rounds the product to
float32 before ``nearbyint``). Host numpy inputs are uploaded and the results read back; the
backend's own device arrays (numba's, or anything with ``__cuda_array_interface__``) are read
in place and the results stay on the device.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from optirs.backends.common.fake_quant import NO_KEY, ZERO, fq_element
from optirs.core.errors import ShapeMismatchError, UnsupportedOperationError
from optirs.core.simulator import cuda_simulator_enabled
from optirs.plugin.hookspecs import FakeQuantGrid, StochasticKeys, hookimpl

BLOCK = 256  # threads per block; the kernel is one element per thread, memory-bound

_KERNELS: Optional[Tuple[Any, Any]] = None
cuda = None  # numba.cuda, set by kernels(): the kernels below read it as a module global


def kernels() -> Tuple[Any, Any]:
    """(forward, backward) numba.cuda kernels, compiled on first use."""
    global _KERNELS, cuda
    if _KERNELS is None:
        from numba import cuda as _cuda

        from optirs.backends.cuda.kernel_cache import jit as cached_jit

        cuda = _cuda
        fq = cuda.jit(device=True)(fq_element)
        if cuda_simulator_enabled():
            def mul(a, b):  # numpy scalars under the simulator: overflow to inf is expected here
                with np.errstate(over="ignore", invalid="ignore"):
                    return a * b
        else:
            from numba.cuda import libdevice

            def mul(a, b):
                return libdevice.fmul_rn(a, b)  # never contracted into an FMA
        mul = cuda.jit(device=True)(mul)

        def forward(x, out, mask, inv, scale, zp, inner, nch, qmin, qmax, int64_cast, stochastic, key_lo, key_hi):
            i = cuda.grid(1)
            if i < x.size:
                c = (i // inner) % nch
                o, m = fq(mul(x[i], inv[c]), scale[c], zp[c], qmin, qmax, int64_cast, stochastic, key_lo, key_hi, i)
                out[i] = o
                mask[i] = m

        def backward(x, g, gin, inv, scale, zp, inner, nch, qmin, qmax, int64_cast):
            i = cuda.grid(1)
            if i < x.size:
                c = (i // inner) % nch
                o, m = fq(mul(x[i], inv[c]), scale[c], zp[c], qmin, qmax, int64_cast, False, NO_KEY, NO_KEY, i)
                gin[i] = g[i] if m else g[i] * ZERO  # selection keeps a NaN gradient's bits

        _KERNELS = (cached_jit(forward, "fake_quant.forward"), cached_jit(backward, "fake_quant.backward"))
    return _KERNELS


def _is_device_array(a: Any) -> bool:
    return hasattr(a, "__cuda_array_interface__") or (hasattr(a, "copy_to_host") and hasattr(a, "is_c_contiguous"))


def _flat(ctx: Any, a: Any, name: str, size: int) -> Tuple[Any, bool]:
    """(a flat device view or upload of ``a``, whether ``a`` was on the device already)."""
    if isinstance(a, np.ndarray):
        return ctx.upload(np.ascontiguousarray(a).reshape(-1)), False
    if not _is_device_array(a):
        raise UnsupportedOperationError(
            f"{name} of type {type(a).__module__}.{type(a).__qualname__} is neither a numpy array nor a CUDA "
            "device array, expected one of those on backend='cuda'")
    if not hasattr(a, "copy_to_host"):
        a = ctx.cuda.as_cuda_array(a)
    if not a.is_c_contiguous():
        raise ShapeMismatchError(f"{name} is not C-contiguous, expected a contiguous device array")
    return a.reshape(size), True


def _grid_args(ctx: Any, grid: FakeQuantGrid):
    return ([ctx.upload(a) for a in (grid.inv_scale, grid.scale, grid.zero_point)]
            + [grid.inner, grid.channels, grid.quant_min, grid.quant_max, grid.int64_cast])


class CudaFakeQuant:
    """Integer fake-quant and its straight-through gradient as numba.cuda kernels."""

    @hookimpl
    def optirs_fake_quant_forward(self, ctx: Any, x: Any, grid: FakeQuantGrid,
                                  rounding: Optional[StochasticKeys]) -> Tuple[Any, Any]:
        if grid.size == 0:
            if isinstance(x, np.ndarray):
                return x.copy(), np.zeros(grid.shape, np.bool_)
            return x, x  # an empty device array: nothing to compute, nothing to share
        ctx.resolve_stream(x)
        dx, on_device = _flat(ctx, x, "x", grid.size)
        d_out = ctx.cuda.device_array(grid.size, np.float32)
        d_mask = ctx.cuda.device_array(grid.size, np.bool_)
        keys = rounding if rounding is not None else (NO_KEY, NO_KEY)
        blocks = (grid.size + BLOCK - 1) // BLOCK
        kernels()[0][blocks, BLOCK, ctx.nstream](dx, d_out, d_mask, *_grid_args(ctx, grid), rounding is not None, *keys)
        if on_device:
            return d_out.reshape(grid.shape), d_mask.reshape(grid.shape)
        return ctx.download(d_out).reshape(grid.shape), ctx.download(d_mask).reshape(grid.shape)

    @hookimpl
    def optirs_fake_quant_backward(self, ctx: Any, x: Any, grad: Any, grid: FakeQuantGrid) -> Any:
        if grid.size == 0:
            return grad.copy() if isinstance(grad, np.ndarray) else grad
        ctx.resolve_stream(x)
        dx, on_device = _flat(ctx, x, "x", grid.size)
        dg, _ = _flat(ctx, grad, "grad", grid.size)
        d_gin = ctx.cuda.device_array(grid.size, np.float32)
        blocks = (grid.size + BLOCK - 1) // BLOCK
        kernels()[1][blocks, BLOCK, ctx.nstream](dx, dg, d_gin, *_grid_args(ctx, grid))
        return d_gin.reshape(grid.shape) if on_device else ctx.download(d_gin).reshape(grid.shape)
