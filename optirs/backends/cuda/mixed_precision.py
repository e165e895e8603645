"""The cuda backend's mixed-precision passes: numba.cuda kernels, one launch per tensor per pass.

The caller's half tensors are separate allocations (numba device arrays, CuPy arrays, torch CUDA
tensors), so each pass launches once per tensor over its uint16 bit patterns, writing into or
reading from the flat float32 buffers at the tensor's offset. The per-element conversions are
the shared functions of :mod:`optirs.backends.common.half`, compiled as device functions: integer
and float32 arithmetic only (checked to compile for sm_90 without float64). numba.cuda is
imported on first use, never when the backend is imported.
"""

from __future__ import annotations

import math
from typing import Any, List

import numpy as np

from optirs.backends.common import half
from optirs.core.arrays import ArrayMeta, as_16bit, describe
from optirs.core.errors import InvalidParameterError
from optirs.core.layout import TensorLayout
from optirs.core.simulator import is_simulator_array
from optirs.plugin.hookspecs import hookimpl

# Threads per block: a simple elementwise pass, any multiple of the warp works.
BLOCK = 256

_kernels = None
cuda = None  # numba.cuda, imported by cuda_kernels


def cuda_kernels():
    """The unscale and narrow kernels (compiled on first launch)."""
    # ``cuda`` must be a module global for the kernels: the simulator swaps the kernels' globals.
    global _kernels, cuda
    if _kernels is not None:
        return _kernels
    from numba import cuda

    from optirs.backends.cuda.kernel_cache import jit as cached_jit

    f16_decode = cuda.jit(device=True)(half.f16_decode)
    bf16_decode = cuda.jit(device=True)(half.bf16_decode)
    f16_encode = cuda.jit(device=True)(half.f16_encode)
    bf16_encode = cuda.jit(device=True)(half.bf16_encode)

    def unscale(g, out, offset, inv_scale, bf16, found_inf):
        i = cuda.grid(1)
        if i < g.shape[0]:
            x = (bf16_decode(g[i]) if bf16 else f16_decode(g[i])) * inv_scale
            out[offset + i] = x
            if not math.isfinite(x):
                found_inf[0] = 1  # every writer stores the same value: no atomic needed

    def narrow(master_bits, p, offset, bf16):
        i = cuda.grid(1)
        if i < p.shape[0]:
            u = master_bits[offset + i]
            p[i] = bf16_encode(u) if bf16 else f16_encode(u)

    class Kernels:
        pass

    Kernels.unscale = cached_jit(unscale, "mixed_precision.unscale")
    Kernels.narrow = cached_jit(narrow, "mixed_precision.narrow")
    Kernels.cuda = cuda
    _kernels = Kernels
    return Kernels


def _as_numba(cuda_module: Any, a: Any):
    """A numba view of any CUDA array (numba's own and the simulator's pass through)."""
    if hasattr(a, "copy_to_host") and hasattr(a, "view"):
        return a
    return cuda_module.as_cuda_array(a)


def _bits(cuda_module: Any, a: Any):
    return _as_numba(cuda_module, a).reshape(-1).view(np.uint16)


def _found_flag(ctx: Any, layout: TensorLayout):
    """The device word the unscale pass raises, one per layout, cleared before each pass (on the stream in use)."""
    found = layout.cache.get("mixed_precision.cuda_found")
    if found is None:
        found = layout.cache["mixed_precision.cuda_found"] = ctx.upload(np.zeros(1, np.int32))
    else:
        ctx.write(found, np.zeros(1, np.int32))
    return found


class CudaMixedPrecision:
    """The ``mixed_precision`` capability of the cuda backend (CUDA device arrays)."""

    @hookimpl
    def optirs_mixed_precision_describe(self, ctx: Any, array: Any, what: str, half_dtype: np.dtype) -> ArrayMeta:
        if not (is_simulator_array(array) or hasattr(array, "__cuda_array_interface__")):
            raise InvalidParameterError(
                f"{what} is a {type(array).__name__}, expected a CUDA device array (numba, CuPy, torch) on the cuda backend"
            )
        try:
            meta = describe(array, what)
        except TypeError as exc:  # a typestr numpy does not know (torch's bfloat16)
            raise InvalidParameterError(
                f"{what} has a dtype numpy cannot read ({exc}), expected float16, or bfloat16 as uint16/int16 bit patterns"
            ) from exc
        return as_16bit(meta, half_dtype) if np.dtype(half_dtype).name == "bfloat16" else meta

    @hookimpl
    def optirs_mixed_precision_unscale(self, ctx: Any, grads: List[Any], out: Any, layout: TensorLayout,
                                       inv_scale: np.float32, bfloat16: bool) -> bool:
        k = cuda_kernels()
        ctx.refuse_capture(ctx.resolve_stream(grads[0] if grads else None), "a mixed-precision unscale")
        found = _found_flag(ctx, layout)
        out32 = _as_numba(k.cuda, out)
        inv, bf16 = np.float32(inv_scale), bool(bfloat16)
        for g, off in zip(grads, layout.offsets):
            g16 = _bits(k.cuda, g)
            n = g16.shape[0]
            if n:
                k.unscale[(n + BLOCK - 1) // BLOCK, BLOCK, ctx.nstream](g16, out32, int(off), inv, bf16, found)
        return bool(ctx.download(found)[0])

    @hookimpl
    def optirs_mixed_precision_narrow(self, ctx: Any, masters: Any, params: List[Any], layout: TensorLayout,
                                      bfloat16: bool) -> None:
        k = cuda_kernels()
        ctx.resolve_stream(params[0] if params else None)
        bits = _as_numba(k.cuda, masters).view(np.uint32)
        bf16 = bool(bfloat16)
        for p, off in zip(params, layout.offsets):
            p16 = _bits(k.cuda, p)
            n = p16.shape[0]
            if n:
                k.narrow[(n + BLOCK - 1) // BLOCK, BLOCK, ctx.nstream](bits, p16, int(off), bf16)
