"""The cuda backend's ``fusion`` capability: generated ``numba.cuda`` kernels on device arrays.

Products go through libdevice's ``fmul_rn``/``dmul_rn`` so that NVVM cannot contract a * b + c
into one fma (numpy rounds twice). Under numba's simulator the kernels run as Python: products
are plain, and ``math`` is numpy's scalar functions, which return the IEEE results (NaN, -inf)
where Python's math raises.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from optirs.backends.common.fusion import (KernelCache, chunks, exec_source, numba_arguments, numba_signature, product,
                                           reduction_identity, work_items)
from optirs.core.simulator import cuda_simulator_enabled
from optirs.plugin.hookspecs import CompiledFusedKernel, FusedGroupSource, hookimpl

DIALECT = "numba-cuda"
BLOCK = 256  # threads per block when no analysis plugin answers; the kernels loop grid-stride
MAX_GRID = 8192
SIM_BLOCK, SIM_GRID = 32, 2  # the simulator runs every thread as a Python thread: keep it tiny
_KERNELS = KernelCache()


class _SimMath:
    """``math`` for kernels run by numba's CUDA simulator, which executes them as Python.

    Python's math raises on sqrt(-1) or log(0) where the device returns NaN or -inf; numpy's
    scalar functions give the IEEE results the compiled kernel does, in the operand's dtype.
    """

    nan, inf = math.nan, math.inf

    def __getattr__(self, name):
        fn = getattr(np, {"pow": "power"}.get(name, name))

        def ieee(*args):
            with np.errstate(all="ignore"):
                return fn(*args)

        return ieee


def _namespace(simulator: bool) -> Dict[str, object]:
    """The globals a generated numba.cuda kernel sees."""
    import numba
    from numba import cuda

    if simulator:  # kernels run as Python: a plain product is already rounded on its own
        products = {"mul_f32": product, "mul_f64": product}
    else:
        from numba.cuda import libdevice

        products = {"mul_f32": libdevice.fmul_rn, "mul_f64": libdevice.dmul_rn}
    return {"np": np, "math": _SimMath() if simulator else math, "cuda": cuda, **products,
            "f32": numba.float32, "f64": numba.float64, "bool": numba.boolean}


def _build(text: str, simulator: bool) -> Tuple[Any, Any]:
    from numba import cuda

    ns = exec_source(text, "cuda", _namespace(simulator))
    finish = cuda.jit(ns["finish_"]) if "finish_" in ns else None
    return cuda.jit(ns["kernel_"]), finish


def compile_ptx(source: FusedGroupSource, cc: Tuple[int, int] = (9, 0)) -> str:
    """PTX of one group's kernel for compute capability ``cc`` (no GPU needed, the CUDA toolkit is)."""
    from numba import cuda

    program = source.kernel(DIALECT)
    ns = exec_source(program.text, "cuda-ptx", _namespace(False))
    ptx, _ = cuda.compile_ptx(ns["kernel_"], numba_signature(source, program.params), cc=cc)
    return ptx


def _launch(kernel: Any, work: int) -> Tuple[int, int]:
    """(grid, block) from the analysis plugins (occupancy), else 256-thread blocks."""
    from numba import cuda

    from optirs.plugin.registry import REGISTRY

    if cuda_simulator_enabled():
        return SIM_GRID, SIM_BLOCK
    config = REGISTRY.launch_config(kernel, cuda.get_current_device(), work)
    if config is not None:
        return int(config[0]), int(config[1])
    return max(1, min(-(-work // BLOCK), MAX_GRID)), BLOCK


class CudaFusion:
    """Hook implementations of the ``fusion`` capability for :class:`optirs.backends.cuda.CudaBackend`."""

    @hookimpl
    def optirs_fusion_compile(self, ctx: Any, source: FusedGroupSource) -> CompiledFusedKernel:
        program = source.kernel(DIALECT)
        simulator = cuda_simulator_enabled()
        kernel, finish = _KERNELS.get((simulator, program.text), lambda: _build(program.text, simulator))
        return CompiledFusedKernel(source, program.text, kernel, (finish, program.params))

    @hookimpl
    def optirs_fusion_run(self, ctx: Any, compiled: CompiledFusedKernel, inputs: Sequence[Any],
                          outputs: Sequence[Any], n: int) -> None:
        source = compiled.source
        finish, params = compiled.extra
        ctx.resolve_stream(next(iter(inputs), None) if inputs else (outputs[0] if outputs else None))
        parts = []
        if finish is not None:
            # chunk 0's partial starts as the identity: it is what finish_ sees when n == 0
            parts = [ctx.upload(np.full(chunks(source), reduction_identity(kind))) for kind in source.reductions]
        args = numba_arguments(source, params, inputs, outputs, parts)
        work = work_items(source)
        if work > 0:
            grid, block = _launch(compiled.kernel, work)
            compiled.kernel[grid, block, ctx.nstream](*args)
        if finish is not None:
            reds = outputs[len(outputs) - len(source.reductions):]
            finish[1, 1, ctx.nstream](np.int64(chunks(source)), *parts, *reds)
