"""The cuda backend's Lion step: the generic one-launch step kernel around ``lion_update``."""

from __future__ import annotations

from optirs.plugin.hookspecs import hookimpl


class CudaLion:
    """Mixin of CudaBackend: Lion (state slot 0: exp_avg)."""

    @hookimpl
    def optirs_step_lion(self, ctx, params, grads, state, layout, scalars) -> None:
        self._generic(ctx, "lion", params, grads, state, layout, scalars, ("exp_avg", None, None))
