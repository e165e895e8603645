"""The opencl backend's ``fusion`` capability: generated OpenCL C kernels on the backend's context and queue.

Programs are built from the generated text with its headers inlined by
:mod:`optirs.backends.common.opencl_source`, with correctly rounded division and sqrt where the
device offers it (numpy's are; OpenCL otherwise allows 2.5 and 3 ulp).
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from optirs.backends.common.fusion import KernelCache, chunks, reduction_identity, work_items
from optirs.backends.common.opencl_source import expand_includes
from optirs.core.errors import GpuOptimError, UnsupportedOperationError
from optirs.plugin.hookspecs import CompiledFusedKernel, FusedGroupSource, hookimpl

DIALECT = "opencl-c"
MAX_GROUPS = 8192
_KERNELS = KernelCache()  # keyed by (context, text): a program belongs to one context


def _build(ctx: Any, text: str) -> Any:
    cl = ctx.cl
    device = ctx.device
    if "cl_khr_fp64" in text and "cl_khr_fp64" not in device.extensions:
        raise UnsupportedOperationError(
            f"backend 'opencl': device {device.name.strip()!r} lacks cl_khr_fp64, which this fused group needs "
            "(float64 values or float64 reduction accumulators)"
        )
    exact = bool(device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT)
    options = ["-cl-fp32-correctly-rounded-divide-sqrt"] if exact else []
    program = cl.Program(ctx.context, text)
    try:
        program = program.build(options=options, devices=[device])
    except cl.Error as exc:
        raise GpuOptimError(f"building a fused OpenCL kernel failed on {device.name.strip()!r}: {exc}") from exc
    # looked up once: program.<name> builds a new wrapper each time
    return program.kernel_, (program.finish_ if "finish_" in text else None), ctx


class OpenclFusion:
    """Hook implementations of the ``fusion`` capability for :class:`optirs.backends.opencl.OpenclBackend`."""

    @hookimpl
    def optirs_fusion_compile(self, ctx: Any, source: FusedGroupSource) -> CompiledFusedKernel:
        program = source.kernel(DIALECT)
        text = expand_includes(program.text)
        kernel, finish, _ = _KERNELS.get((id(ctx), text), lambda: _build(ctx, text))
        return CompiledFusedKernel(source, text, kernel, (finish, program.params))

    @hookimpl
    def optirs_fusion_run(self, ctx: Any, compiled: CompiledFusedKernel, inputs: Sequence[Any],
                          outputs: Sequence[Any], n: int) -> None:
        import pyopencl.array as cla

        source = compiled.source
        finish, params = compiled.extra
        stores = len(outputs) - len(source.reductions)
        parts: List[Any] = []
        if finish is not None:
            parts = [cla.to_device(ctx.queue, np.full(chunks(source), reduction_identity(kind))) for kind in source.reductions]

        def buffer(array: Any) -> Any:
            # an empty array has no buffer; the kernel never reads it, but the argument needs one
            return array.base_data if array.size else ctx.dummy

        vals = []
        for name in params:
            if name == "n":
                vals.append(np.int64(source.elements))
            elif name in ("A_", "K_", "B_"):
                vals.append(np.int64(source.layout["AKB".index(name[0])]))
            elif name == "chunk":
                vals.append(np.int64(source.chunk))
            elif name.startswith("d") and name[1:].isdigit():
                vals.append(np.int64(source.domain[int(name[1:])]))
            elif name.startswith("s") and "_" in name:
                j, k = name[1:].split("_")
                vals.append(np.int64(source.input_strides[int(j)][int(k)]))
            elif name.startswith("in"):
                vals.append(buffer(inputs[int(name[2:])]))
            elif name.startswith("out"):
                vals.append(buffer(outputs[int(name[3:])]))
            elif name.startswith("red"):
                vals.append(buffer(outputs[stores + int(name[3:])]))
            elif name.startswith("part"):
                vals.append(parts[int(name[4:])].base_data)
        work = work_items(source)
        if work > 0:
            block = ctx.work_group
            groups = max(1, min(-(-work // block), MAX_GROUPS))
            compiled.kernel(ctx.queue, (groups * block,), (block,), *vals)
        if finish is not None:
            reds = [buffer(a) for a in outputs[stores:]]
            finish(ctx.queue, (1,), (1,), np.int64(chunks(source)), *[p.base_data for p in parts], *reds)
