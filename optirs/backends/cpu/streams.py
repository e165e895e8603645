"""The cpu backend's ``streams`` capability: the host runs every call to completion, in order.

Its only stream is 0; asking for another is an error rather than a silent no-op.
"""

from __future__ import annotations

from typing import Any, Optional

from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.plugin.hookspecs import hookimpl


class CpuStreams:
    """Mixin of :class:`optirs.backends.cpu.CpuBackend`."""

    @hookimpl
    def optirs_use_stream(self, ctx: Any, stream: Optional[Any]) -> None:
        if stream is None or (isinstance(stream, str) and stream == "auto"):
            return
        if isinstance(stream, bool) or not isinstance(stream, int):
            raise InvalidParameterError(f"stream={stream!r}, expected 0, None or 'auto' on the cpu backend")
        if stream != 0:
            raise UnsupportedOperationError(
                f"stream={stream:#x}: the cpu backend has no device streams (every call runs to completion on "
                "the host), expected 0, None or 'auto'")

    @hookimpl
    def optirs_current_stream(self, ctx: Any) -> int:
        return 0
