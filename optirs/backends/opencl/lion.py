"""The opencl backend's Lion step (``lion_flat4``/``lion_flat1``/``lion_chunks`` of optirs_steps.cl),
driven like the other elementwise optimizers."""

from __future__ import annotations

from optirs.plugin.hookspecs import hookimpl


class OpenclLion:
    """Mixin of OpenclBackend: Lion (state slot 0: exp_avg)."""

    @hookimpl
    def optirs_step_lion(self, ctx, params, grads, state, layout, scalars) -> None:
        from optirs.backends.opencl import _elementwise
        from optirs.backends.opencl.adafactor import appended_kernels

        appended_kernels(ctx)
        _elementwise(ctx, "lion", params, grads, (state["exp_avg"], None, None), layout, scalars)
