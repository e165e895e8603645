"""The cuda backend's step hooks: one per optimizer definition.

Every elementwise optimizer is one launch of the generic step kernel of its family
(``kernels.STEP_FUNCTIONS``), with the definition's state slots as slots 0-2; LAMB runs its
norm passes (``kernels.LAMB_FUNCTIONS``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from optirs.backends.cuda import CudaContext, device_address
from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.plugin.hookspecs import hookimpl


def _pointwise_step(definition: OptimizerDefinition) -> Callable:
    names = definition.slot_names()

    def step(self, ctx, params, grads, state, layout, scalars) -> None:
        if layout.total == 0:
            return
        family = definition.kernel
        compiled, chunk, grid, block = ctx.plan(family, ctx.kernels.STEP_FUNCTIONS[family], "step", scalars, layout)
        chunks, nchunks = ctx.chunk_table(layout, chunk)
        ptrs = self._pointers(ctx, params, grads, layout)
        addrs, used = [0, 0, 0], 0
        for k, slot in enumerate(names):
            if slot in state:
                addrs[k] = device_address(state[slot])
                used |= 1 << k
        ctx.launch(compiled, (chunks, ptrs, nchunks, *addrs, used, 0, 0, scalars), grid, block)  # host scalars, no flag

    step.__name__ = step.__qualname__ = definition.hook
    step.__doc__ = f"{definition.summary} (one launch of the generic step kernel)"
    return hookimpl(step)


class CudaSteps:
    """The dense step of every optimizer definition."""

    @staticmethod
    def _pointers(ctx: CudaContext, params: Any, grads: Any, layout: Any):
        paddr = getattr(params, "addresses", None)
        gaddr = getattr(grads, "addresses", None)
        if paddr is None or gaddr is None:  # called directly with device arrays
            paddr = tuple(device_address(a) for a in params)
            gaddr = tuple(device_address(a) for a in grads)
        return ctx.pointer_table(layout, paddr, gaddr)

    @hookimpl
    def optirs_step_lamb(self, ctx, params, grads, state, layout, scalars) -> None:
        if layout.total == 0:
            return
        ptrs = self._pointers(ctx, params, grads, layout)
        ntensors = len(layout)
        acc = layout.cache.get("cuda.lamb_acc")
        if acc is None:  # per-tensor sums, two alternating rows (see cuda_kernels)
            acc = layout.cache["cuda.lamb_acc"] = [ctx.upload(np.zeros((2, 2 * ntensors + 1))), 0]
        sums, q = acc
        m, v = device_address(state["exp_avg"]), device_address(state["exp_avg_sq"])
        fns = ctx.kernels.LAMB_FUNCTIONS
        passes = (("lamb_moments", "moments", "lamb", (m, v)), ("lamb_apply", "apply", "lamb", (m, v)))
        if scalars.max_grad_norm > 0:
            passes = (("lamb_grad_norm", "grad_norm", "grad_norm", ()),) + passes
        try:
            for name, fn, family, slots in passes:
                compiled, chunk, grid, block = ctx.plan(name, fns[fn], family, scalars, layout)
                chunks, nchunks = ctx.chunk_table(layout, chunk)
                ctx.launch(compiled, (chunks, ptrs, nchunks, *slots, sums, q, ntensors, scalars), grid, block)
        except Exception:
            acc[0] = ctx.upload(np.zeros((2, 2 * ntensors + 1)))  # start the sums clean
            acc[1] = 0
            raise
        acc[1] = 1 - q




for _definition in DEFINITIONS.values():
    if _definition.pointwise:
        setattr(CudaSteps, _definition.hook, _pointwise_step(_definition))
