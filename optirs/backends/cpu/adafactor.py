"""The cpu backend's Adafactor step (called by ``optirs_step``): the factored state layout and the loop of adafactor_kernels."""

from __future__ import annotations

from optirs.core.factored import factored_layout


class CpuAdafactor:
    """Mixin of CpuBackend: Adafactor, one parallel loop over the model's tensors."""

    def _adafactor(self, ctx, request) -> None:
        params, grads, state, layout, scalars = (request.params, request.grads, request.state, request.layout,
                                                 request.scalars)
        import optirs.backends.cpu.adafactor_kernels as adafactor_kernels

        fl = factored_layout(layout)
        adafactor_kernels.adafactor(params, grads, state["row_var"], state["col_var"], state["variance"], fl.table,
                                    scalars)
