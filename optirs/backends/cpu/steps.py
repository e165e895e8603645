"""The cpu backend's step: one hook that picks the loop for every optimizer, format and control.

Every elementwise optimizer runs the one generic chunk loop (``kernels.pointwise``) with its
state slots in the definition's order; LAMB runs its norm passes (``kernels.lamb``), Adafactor
its factored loop (:mod:`optirs.backends.cpu.adafactor`), and every step format the formats loops
(:mod:`optirs.backends.cpu.formats`). Host memory is this backend's memory, so a ``found_inf``
flag is read here, before anything is written.
"""

from __future__ import annotations

import numpy as np

from optirs.core.definitions import DEFINITIONS, OptimizerDefinition
from optirs.core.errors import UnsupportedOperationError
from optirs.core.formats import FORMAT_FAMILIES
from optirs.plugin.hookspecs import StepRequest, StepSupport, hookimpl

# Elements per chunk: large enough to amortise the loop's bookkeeping, small enough to balance
# a model of uneven tensors over the threads.
CHUNK = 1 << 15

# Stands in for a state slot the hyperparameters do not use (never indexed).
_EMPTY = np.zeros(0, dtype=np.float32)

SUPPORT = StepSupport(optimizers=tuple(DEFINITIONS),
                      formats=tuple(n for n, d in DEFINITIONS.items() if d.kernel in FORMAT_FAMILIES))


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


def flag_set(flag) -> bool:
    """Whether a host found_inf flag (a 1-element array) is non-zero."""
    return flag is not None and int(np.asarray(flag).reshape(-1)[0]) != 0


class CpuSteps:
    """``optirs_step``: the loop for each request, chosen here."""

    @hookimpl
    def optirs_step_support(self) -> StepSupport:
        return SUPPORT

    @hookimpl
    def optirs_step(self, ctx, request: StepRequest) -> None:
        controls, definition = request.controls, request.definition
        if controls.device is not None:
            raise UnsupportedOperationError(
                f"the cpu backend has no device-side scalars ({definition.name} with controls.device), expected "
                "host scalars: a host step has no CUDA graph to capture")
        if request.fmt is not None:
            if controls.check_finite:
                self._formats_check(ctx, request.grads, request.layout, request.fmt, controls.found_inf)
            if flag_set(controls.found_inf):
                return
            self._formats_step(ctx, definition.kernel, request.params, request.grads, request.state, request.layout,
                               request.format_state, request.fmt, request.scalars, controls.seed, controls.step)
            return
        if controls.check_finite:
            raise UnsupportedOperationError("check_finite on a float32 step of the cpu backend, expected a step format")
        if flag_set(controls.found_inf) or request.layout.total == 0:
            return
        family = definition.kernel
        params, grads, state, layout, scalars = (request.params, request.grads, request.state, request.layout,
                                                 request.scalars)
        if family == "lamb":
            ctx.kernels.lamb(params, grads, state["exp_avg"], state["exp_avg_sq"], layout.offsets,
                             *layout.chunks(CHUNK), len(layout), scalars)
        elif family == "adafactor":
            self._adafactor(ctx, params, grads, state, layout, scalars)
        elif definition.pointwise:
            buffers, used = slot_buffers(definition, state)
            ctx.kernels.pointwise(params, grads, *buffers, used, layout.offsets, *layout.chunks(CHUNK), scalars)
        else:
            raise UnsupportedOperationError(f"the cpu backend has no loop for the {family!r} family of "
                                            f"{definition.name!r}")
