"""The one step hook of the built-in backends: which kernel runs a request, decided in one place.

A backend mixes in :class:`StepDispatch` and gives its kernels as methods of ``(ctx, request)``:
``_pointwise`` (every elementwise family), ``_lamb``, ``_adafactor``, ``_formats_step`` (any step
format) and ``_device_scalars_step`` (the count, lr and scalars on the device; refused unless a
backend has it), plus ``_formats_check(ctx, grads, layout, fmt, flag)`` (the gradients' non-finite
check that ``controls.check_finite`` asks for first). ``FLAG_ON_DEVICE`` names the kinds of kernel
that read a ``found_inf`` flag themselves ("pointwise", "formats"); for the others the flag is
read on the host before anything is launched (free where the device's memory is the host's).
"""

from __future__ import annotations

from typing import Any, ClassVar, FrozenSet

import numpy as np

from optirs.core.errors import UnsupportedOperationError
from optirs.plugin.hookspecs import StepRequest, StepSupport, hookimpl


# kind of kernel -> the method that runs it
_RUNNERS = {"pointwise": "_pointwise", "lamb": "_lamb", "adafactor": "_adafactor", "formats": "_formats_step"}


class StepDispatch:
    """``optirs_step`` and ``optirs_step_support`` of a built-in backend (module docstring)."""

    NAME: ClassVar[str]
    SUPPORT: ClassVar[StepSupport]
    FLAG_ON_DEVICE: ClassVar[FrozenSet[str]] = frozenset()

    @hookimpl
    def optirs_step_support(self) -> StepSupport:
        return self.SUPPORT

    @hookimpl
    def optirs_step(self, ctx: Any, request: StepRequest) -> None:
        controls, definition = request.controls, request.definition
        if controls.device is not None:
            self._device_scalars_step(ctx, request)
            return
        if request.fmt is not None:
            kind = "formats"
            if request.fmt.state_dtype not in self.SUPPORT.state_dtypes:
                raise UnsupportedOperationError(
                    f"the {self.NAME} backend stores no state_dtype={request.fmt.state_dtype!r}, expected one of "
                    f"{list(self.SUPPORT.state_dtypes)}")
            if controls.check_finite:
                self._formats_check(ctx, request.grads, request.layout, request.fmt, controls.found_inf)
        elif controls.check_finite:
            raise UnsupportedOperationError(
                f"check_finite on a float32 {definition.name} step of the {self.NAME} backend, expected a step "
                "format (the gradients' check belongs to the formats)")
        else:
            kind = "pointwise" if definition.pointwise else definition.kernel
        run = getattr(self, _RUNNERS[kind], None) if kind in _RUNNERS else None
        if run is None:
            raise UnsupportedOperationError(f"the {self.NAME} backend has no kernel for the {definition.kernel!r} "
                                            f"family of {definition.name!r}")
        if request.layout.total == 0:
            return
        if kind not in self.FLAG_ON_DEVICE and self._flag_set(ctx, controls.found_inf):
            return
        run(ctx, request)

    def _flag_set(self, ctx: Any, flag: Any) -> bool:
        """Whether a found_inf flag is set, read on the host (None: no flag)."""
        if flag is None:
            return False
        return int(np.asarray(self.optirs_to_host(ctx, flag)).reshape(-1)[0]) != 0

    def _device_scalars_step(self, ctx: Any, request: StepRequest) -> None:
        raise UnsupportedOperationError(
            f"the {self.NAME} backend has no device-side scalars ({request.definition.name} with controls.device), "
            "expected host scalars")
