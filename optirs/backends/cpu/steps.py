"""The cpu backend's kernels for the one step hook (:mod:`optirs.backends.common.steps` picks them).

Every elementwise optimizer runs the one generic chunk loop (``kernels.pointwise``) with its
state slots in the definition's order; LAMB runs its norm passes (``kernels.lamb``), Adafactor
its factored loop (:mod:`optirs.backends.cpu.adafactor`), and every step format the formats loops
(:mod:`optirs.backends.cpu.formats`). Host memory is this backend's memory, so a ``found_inf``
flag is read before anything is written.
"""

from __future__ import annotations

import numpy as np

from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.formats import FORMAT_FAMILIES, STATE_DTYPES
from optirs.backends.common.steps import StepDispatch
from optirs.plugin.hookspecs import StepRequest, StepSupport, hookimpl

# Elements per chunk: large enough to amortise the loop's bookkeeping, small enough to balance
# a model of uneven tensors over the threads.
CHUNK = 1 << 15

# Stands in for a state slot the hyperparameters do not use (never indexed).
_EMPTY = np.zeros(0, dtype=np.float32)

SUPPORT = StepSupport(optimizers=tuple(DEFINITIONS),
                      formats=tuple(n for n, d in DEFINITIONS.items() if d.kernel in FORMAT_FAMILIES),
                      state_dtypes=STATE_DTYPES)


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


class CpuSteps(StepDispatch):
    """The cpu backend's kernels for :class:`~optirs.backends.common.steps.StepDispatch` (host memory:
    every found_inf flag is read here, before anything is written)."""

    NAME = "cpu"
    SUPPORT = SUPPORT

    @hookimpl
    def optirs_step(self, ctx, request: StepRequest) -> None:
        with ctx.threads.running(request.layout.total):  # optirs.backends.cpu.threads
            super().optirs_step(ctx, request)

    def _pointwise(self, ctx, request: StepRequest) -> None:
        buffers, used = slot_buffers(request.definition, request.state)
        layout = request.layout
        ctx.kernels.pointwise(request.params, request.grads, *buffers, used, layout.offsets, *layout.chunks(CHUNK),
                              request.scalars)

    def _lamb(self, ctx, request: StepRequest) -> None:
        layout, state = request.layout, request.state
        ctx.kernels.lamb(request.params, request.grads, state["exp_avg"], state["exp_avg_sq"], layout.offsets,
                         *layout.chunks(CHUNK), len(layout), request.scalars)
