"""The cpu backend's Adafactor step: the factored state layout and the loop of adafactor_kernels."""

from __future__ import annotations

from optirs.core.factored import factored_layout
from optirs.plugin.hookspecs import hookimpl


class CpuAdafactor:
    """Mixin of CpuBackend: Adafactor, one parallel loop over the model's tensors."""

    @hookimpl
    def optirs_step_adafactor(self, ctx, params, grads, state, layout, scalars) -> None:
        from optirs.backends.cpu import adafactor_kernels

        if layout.total == 0:
            return
        fl = factored_layout(layout)
        adafactor_kernels.adafactor(params, grads, state["row_var"], state["col_var"], state["variance"], fl.table,
                                    scalars)
