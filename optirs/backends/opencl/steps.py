"""The opencl backend's step: one hook that picks the kernels for every optimizer, format and control.

Every elementwise optimizer runs the generic ``STEP_KERNELS`` of its family (``_elementwise``),
LAMB its norm passes (``_lamb``), Adafactor one work-group per tensor
(:mod:`optirs.backends.opencl.adafactor`), and every step format the formats kernels
(:mod:`optirs.backends.opencl.formats`), which read the found_inf flag on the device; the float32
kernels take no flag, so it is read here first.
"""

from __future__ import annotations

import numpy as np

from optirs.backends.opencl import _elementwise, _lamb
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import UnsupportedOperationError
from optirs.core.formats import FORMAT_FAMILIES
from optirs.plugin.hookspecs import StepRequest, StepSupport, hookimpl

SUPPORT = StepSupport(optimizers=tuple(DEFINITIONS),
                      formats=tuple(n for n, d in DEFINITIONS.items() if d.kernel in FORMAT_FAMILIES))


class OpenclSteps:
    """``optirs_step``: the kernels for each request, chosen here."""

    @hookimpl
    def optirs_step_support(self) -> StepSupport:
        return SUPPORT

    @hookimpl
    def optirs_step(self, ctx, request: StepRequest) -> None:
        controls, definition = request.controls, request.definition
        params, grads, state, layout, scalars = (request.params, request.grads, request.state, request.layout,
                                                 request.scalars)
        if controls.device is not None:
            raise UnsupportedOperationError(
                f"the opencl backend has no device-side scalars ({definition.name} with controls.device), expected "
                "host scalars")
        if request.fmt is not None:
            if controls.check_finite:
                self._formats_check(ctx, grads, layout, request.fmt, controls.found_inf)
            self._formats_step(ctx, definition.kernel, params, grads, state, layout, request.format_state, request.fmt,
                               scalars, controls.seed, controls.step, controls.found_inf)
            return
        if controls.check_finite:
            raise UnsupportedOperationError("check_finite on a float32 step of the opencl backend, expected a step "
                                            "format")
        if controls.found_inf is not None and int(self.optirs_to_host(ctx, controls.found_inf)[0]) != 0:
            return
        family = definition.kernel
        if definition.pointwise:
            names = definition.slot_names()
            slots = tuple(state.get(names[k]) if k < len(names) else None for k in range(3))
            _elementwise(ctx, family, params, grads, slots, layout, scalars)
        elif family == "lamb":
            _lamb(ctx, params, grads, state["exp_avg"], state["exp_avg_sq"], layout, scalars)
        elif family == "adafactor":
            self._adafactor(ctx, params, grads, state, layout, scalars)
        else:
            raise UnsupportedOperationError(f"the opencl backend has no kernel for the {family!r} family of "
                                            f"{definition.name!r}")
