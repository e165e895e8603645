"""The cuda backend's Adafactor step: one launch of adafactor_kernels.adafactor_step for the model."""

from __future__ import annotations

import numpy as np

from optirs.core.factored import factored_layout


class CudaAdafactor:
    """Mixin of CudaBackend: Adafactor, one block per tensor."""

    def _adafactor(self, ctx, request) -> None:
        params, grads, state, layout, scalars = (request.params, request.grads, request.state, request.layout,
                                                 request.scalars)
        import optirs.backends.cuda.adafactor_kernels as kernels
        from optirs.backends.cuda.context import device_address

        fl = factored_layout(layout)
        tables = layout.cache.get("cuda.adafactor")
        if tables is None:  # the tensor table and the row-mean scratch, once per layout
            tables = layout.cache["cuda.adafactor"] = (ctx.upload(fl.table), ctx.empty(max(1, fl.total_batches),
                                                                                             np.float32))
        table, means = tables
        compiled = ctx.compiled("adafactor_step", kernels.adafactor_step, kernels.argument_types(scalars))
        grid, block = compiled.launch_size(ctx, (layout.total + 3) // 4)
        grid = max(1, min(grid, len(fl)))
        ptrs = self._pointers(ctx, params, grads, layout)
        slots = [device_address(state[k]) for k in ("row_var", "col_var", "variance")]
        ctx.launch(compiled, (table, ptrs, len(fl), *slots, device_address(means), scalars), grid, block)
