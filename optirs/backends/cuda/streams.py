"""The cuda backend's ``streams`` capability: which CUDA stream its launches and copies go on.

The stream lives in the context (:class:`optirs.backends.cuda.CudaContext`): ``stream`` (the raw
handle passed to cuLaunchKernel) and ``nstream`` (the same stream as numba's launches and copies
take it). It is pinned by the open option ``stream`` or :func:`optirs_use_stream`; otherwise
each call resolves it from its arrays (``CudaContext.resolve_stream``): torch's current stream
of a torch CUDA tensor's device at the time of the call, else the legacy default stream 0.
"""

from __future__ import annotations

from typing import Any, Optional

from optirs.plugin.hookspecs import hookimpl


class CudaStreams:
    """Mixin of :class:`optirs.backends.cuda.CudaBackend`."""

    @hookimpl
    def optirs_use_stream(self, ctx: Any, stream: Optional[Any]) -> None:
        ctx.use_stream(stream)

    @hookimpl
    def optirs_current_stream(self, ctx: Any) -> int:
        return int(ctx.stream)
