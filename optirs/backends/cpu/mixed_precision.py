"""The cpu backend's mixed-precision passes: numba parallel loops over the model's chunk table.

Each pass is one call for the whole model: a ``prange`` over the chunks of
:meth:`optirs.core.layout.TensorLayout.chunks`, whose body runs the shared conversions of
:mod:`optirs.backends.common.half` on the arrays' uint16 bit patterns (numba has no float16 on
the CPU and no bfloat16). The kernels compile on first use and are cached on disk.
"""

from __future__ import annotations

import math
from typing import Any, List

import numpy as np

from optirs.backends.common import half
from optirs.backends.common.identity_cache import ArrayListCache
from optirs.backends.cpu.typed_lists import cached_typed_list
from optirs.core.arrays import ArrayMeta, describe
from optirs.core.errors import InvalidParameterError
from optirs.core.layout import TensorLayout
from optirs.plugin.hookspecs import hookimpl

# Cached typed lists of bit views per layout: a training loop alternates few array lists.
_BIT_LISTS = 8
_kernels = None


def cpu_kernels():
    """The njit conversions and the two parallel passes (compiled on first use)."""
    global _kernels
    if _kernels is not None:
        return _kernels
    from numba import prange
    from optirs.core.compile_cache import cached_njit

    from optirs.backends.cpu.kernels import typed_list  # (its import prepares the kernel cache)

    f16_decode = cached_njit()(half.f16_decode)
    bf16_decode = cached_njit()(half.bf16_decode)
    f16_encode = cached_njit()(half.f16_encode)
    bf16_encode = cached_njit()(half.bf16_encode)

    @cached_njit(parallel=True)
    def unscale(gs, out, offsets, chunk_tensor, chunk_start, chunk_stop, inv_scale, bf16, flags):
        # One pass: decode, multiply by 1/scale, store float32, flag non-finite results per chunk.
        for c in prange(chunk_tensor.shape[0]):
            t = chunk_tensor[c]
            g, off = gs[t], offsets[t]
            bad = 0
            for i in range(chunk_start[c], chunk_stop[c]):
                x = (bf16_decode(g[i]) if bf16 else f16_decode(g[i])) * inv_scale
                out[off + i] = x
                if not math.isfinite(x):
                    bad = 1
            flags[c] = bad

    @cached_njit(parallel=True)
    def narrow(master_bits, ps, offsets, chunk_tensor, chunk_start, chunk_stop, bf16):
        for c in prange(chunk_tensor.shape[0]):
            t = chunk_tensor[c]
            p, off = ps[t], offsets[t]
            for i in range(chunk_start[c], chunk_stop[c]):
                u = master_bits[off + i]
                p[i] = bf16_encode(u) if bf16 else f16_encode(u)

    @cached_njit(parallel=True)
    def encode_all(bits, out, bf16):
        for i in prange(bits.shape[0]):
            out[i] = bf16_encode(bits[i]) if bf16 else f16_encode(bits[i])

    @cached_njit(parallel=True)
    def decode_all(bits, out, bf16):
        for i in prange(bits.shape[0]):
            out[i] = bf16_decode(bits[i]) if bf16 else f16_decode(bits[i])

    class Kernels:
        pass

    Kernels.unscale, Kernels.narrow, Kernels.encode_all, Kernels.decode_all = unscale, narrow, encode_all, decode_all
    Kernels.typed_list = staticmethod(typed_list)
    _kernels = Kernels
    return Kernels


def encode_bits(values32: np.ndarray, dtype: Any) -> np.ndarray:
    """The narrow pass's float32 -> float16/bfloat16 rounding, as uint16 bit patterns (for tests)."""
    bf16 = half.is_bfloat16(dtype)
    bits = np.ascontiguousarray(values32, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.shape, np.uint16)
    cpu_kernels().encode_all(bits, out, bf16)
    return out


def decode_bits(bits: np.ndarray, dtype: Any) -> np.ndarray:
    """The unscale pass's float16/bfloat16 -> float32 decoding (for tests)."""
    bf16 = half.is_bfloat16(dtype)
    b = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    out = np.empty(b.shape, np.float32)
    cpu_kernels().decode_all(b, out, bf16)
    return out


def _bit_views(layout: TensorLayout, arrays: List[np.ndarray]):
    """A numba typed list of the arrays' flat uint16 views, cached in the layout."""
    cache = layout.cache.get("mixed_precision.cpu_bits")
    if cache is None:
        cache = layout.cache["mixed_precision.cpu_bits"] = ArrayListCache(_BIT_LISTS)
    return cached_typed_list(cache, arrays,
                             lambda a: cpu_kernels().typed_list([x.view(np.uint16).reshape(-1) for x in a]))


class CpuMixedPrecision:
    """The ``mixed_precision`` capability of the cpu backend (numpy half arrays)."""

    @hookimpl
    def optirs_mixed_precision_describe(self, ctx: Any, array: Any, what: str, half_dtype: np.dtype) -> ArrayMeta:
        if not isinstance(array, np.ndarray):
            raise InvalidParameterError(f"{what} is a {type(array).__name__}, expected a numpy array on the cpu backend")
        return describe(array, what)

    @hookimpl
    def optirs_mixed_precision_unscale(self, ctx: Any, grads: List[np.ndarray], out: np.ndarray, layout: TensorLayout,
                                       inv_scale: np.float32, bfloat16: bool) -> bool:
        from optirs.backends.cpu.steps import CHUNK

        chunk_tensor, chunk_start, chunk_stop = layout.chunks(CHUNK)
        flags = np.zeros(chunk_tensor.shape[0], np.uint8)
        cpu_kernels().unscale(_bit_views(layout, grads), out, layout.offsets, chunk_tensor, chunk_start, chunk_stop,
                              np.float32(inv_scale), bool(bfloat16), flags)
        return bool(flags.any())

    @hookimpl
    def optirs_mixed_precision_narrow(self, ctx: Any, masters: np.ndarray, params: List[np.ndarray],
                                      layout: TensorLayout, bfloat16: bool) -> None:
        from optirs.backends.cpu.steps import CHUNK

        cpu_kernels().narrow(masters.view(np.uint32), _bit_views(layout, params), layout.offsets,
                             *layout.chunks(CHUNK), bool(bfloat16))
