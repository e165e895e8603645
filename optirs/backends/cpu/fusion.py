"""The cpu backend's ``fusion`` capability: generated ``numba.njit(parallel=True)`` kernels on numpy arrays."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from optirs.backends.common.fusion import KernelCache, exec_source, numba_arguments, numba_signature, product
from optirs.plugin.hookspecs import CompiledFusedKernel, FusedGroupSource, hookimpl

DIALECT = "numba-parallel"
_KERNELS = KernelCache()  # numba functions belong to no context: one cache for the process


def _build(source: FusedGroupSource, text: str, params: Sequence[str]) -> Any:
    import numba

    mul = numba.njit(product)
    ns = exec_source(text, "cpu", {"np": np, "math": math, "prange": numba.prange, "mul_f32": mul, "mul_f64": mul,
                                   "f32": np.float32, "f64": np.float64, "bool": bool})
    fn = numba.njit(parallel=True, nogil=True, error_model="numpy", fastmath=False)(ns["kernel_"])
    fn.compile(numba_signature(source, params))  # compile now, not on the first run
    return fn


class CpuFusion:
    """Hook implementations of the ``fusion`` capability for :class:`optirs.backends.cpu.CpuBackend`."""

    @hookimpl
    def optirs_fusion_compile(self, ctx: Any, source: FusedGroupSource) -> CompiledFusedKernel:
        program = source.kernel(DIALECT)
        fn = _KERNELS.get(program.text, lambda: _build(source, program.text, program.params))
        return CompiledFusedKernel(source, program.text, fn, program.params)

    @hookimpl
    def optirs_fusion_run(self, ctx: Any, compiled: CompiledFusedKernel, inputs: Sequence[Any],
                          outputs: Sequence[Any], n: int) -> None:
        compiled.kernel(*numba_arguments(compiled.source, compiled.extra, inputs, outputs))
