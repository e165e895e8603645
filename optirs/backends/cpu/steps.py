"""The cpu backend's step hooks: one per optimizer definition.

Every elementwise optimizer runs the one generic chunk loop (``kernels.pointwise``) with its
state slots in the definition's order; LAMB runs its norm passes (``kernels.lamb``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.plugin.hookspecs import hookimpl

# Elements per chunk: large enough to amortise the loop's bookkeeping, small enough to balance
# a model of uneven tensors over the threads.
CHUNK = 1 << 15

# Stands in for a state slot the hyperparameters do not use (never indexed).
_EMPTY = np.zeros(0, dtype=np.float32)


def slot_buffers(definition: OptimizerDefinition, state, count: int = 3):
    """The definition's first ``count`` slots as buffers (``_EMPTY`` where absent) and the bit mask of present ones."""
    names = definition.slot_names()
    buffers, used = [], 0
    for k in range(count):
        if k < len(names) and names[k] in state:
            buffers.append(state[names[k]])
            used |= 1 << k
        else:
            buffers.append(_EMPTY)
    return buffers, used


def _pointwise_step(definition: OptimizerDefinition) -> Callable:
    def step(self, ctx, params, grads, state, layout, scalars) -> None:
        buffers, used = slot_buffers(definition, state)
        ctx.kernels.pointwise(params, grads, *buffers, used, layout.offsets, *layout.chunks(CHUNK), scalars)

    step.__name__ = step.__qualname__ = definition.hook
    step.__doc__ = f"{definition.summary} (the generic chunk loop)"
    return hookimpl(step)


class CpuSteps:
    """The dense step of every optimizer definition."""

    @hookimpl
    def optirs_step_lamb(self, ctx, params, grads, state, layout, scalars) -> None:
        ctx.kernels.lamb(params, grads, state["exp_avg"], state["exp_avg_sq"], layout.offsets,
                         *layout.chunks(CHUNK), len(layout), scalars)


for _definition in DEFINITIONS.values():
    if _definition.pointwise:
        setattr(CpuSteps, _definition.hook, _pointwise_step(_definition))
