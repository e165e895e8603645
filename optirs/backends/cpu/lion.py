"""The cpu backend's Lion step (the loop is ``lion`` in optirs.backends.cpu.kernels)."""

from __future__ import annotations

from optirs.plugin.hookspecs import hookimpl


class CpuLion:
    """Mixin of CpuBackend: Lion, one parallel loop over the chunk table."""

    @hookimpl
    def optirs_step_lion(self, ctx, params, grads, state, layout, scalars) -> None:
        from optirs.backends.cpu import CHUNK

        ctx.kernels.lion(params, grads, state["exp_avg"], layout.offsets, *layout.chunks(CHUNK), scalars)
