"""Critical sections that a KeyboardInterrupt cannot split.

A step changes the parameters, the state and the step count; Ctrl-C landing between two of
those would leave an optimizer that is neither before nor after the step. Inside
``with deferred_interrupts():`` a SIGINT is only recorded; it is delivered (the previous handler
runs, by default raising KeyboardInterrupt) when the outermost section ends, so it lands before
or after the section, never inside.

Only the main thread receives Python signal handlers, and only it may swap them: in any other
thread this is a no-op, and nested sections of the main thread defer to the outermost one.
The handler is swapped through ``_signal`` (the C module under :mod:`signal`, whose wrappers
convert handlers to enums at a cost of microseconds): a section costs well under a microsecond.
"""

from __future__ import annotations

import os
import threading
from typing import Any, List, Optional

try:
    import _signal as _sig
except ImportError:  # pragma: no cover - not CPython
    import signal as _sig  # type: ignore[no-redef]

_SIGINT = int(_sig.SIGINT)
_get_ident = threading.get_ident
_main = [threading.main_thread().ident]  # the thread that receives signals (refreshed after fork)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _main.__setitem__(0, threading.main_thread().ident))


class _Deferred:
    """The main thread's section: a depth counter and the handler it replaced."""

    __slots__ = ("depth", "previous", "pending")

    def __init__(self) -> None:
        self.depth = 0
        self.previous: Optional[Any] = None  # None: no handler swapped (none Python can restore)
        self.pending: List[Any] = []  # frames of the SIGINTs received in the open section

    def _record(self, signum: int, frame: Any) -> None:
        self.pending.append(frame)

    # An interrupt before the swap raises out of __enter__ with nothing changed; after it, it is
    # recorded. On exit, one after the restore raises directly (the pending list is then stale and
    # is cleared when the next section opens).
    def __enter__(self) -> None:
        if _get_ident() != _main[0]:
            return
        if self.depth:
            self.depth += 1
            return
        previous = _sig.getsignal(_SIGINT)
        if previous is not None:  # None: installed outside Python, cannot be restored; leave it
            self.pending.clear()
            try:
                _sig.signal(_SIGINT, self._record)
                self.previous = previous
            except (ValueError, OSError):  # e.g. a subinterpreter
                pass
        self.depth = 1

    def __exit__(self, *exc: Any) -> None:
        if _get_ident() != _main[0]:
            return
        self.depth -= 1
        if self.depth or self.previous is None:
            return
        previous, self.previous = self.previous, None
        _sig.signal(_SIGINT, previous)
        if self.pending:
            frame = self.pending[-1]
            self.pending.clear()
            _deliver(previous, frame)


def _deliver(handler: Any, frame: Any) -> None:
    if callable(handler):
        handler(_SIGINT, frame)  # by default signal.default_int_handler: KeyboardInterrupt
    elif handler == _sig.SIG_DFL:
        _sig.raise_signal(_SIGINT)
    # SIG_IGN ignores it, as it would have without the section.


_DEFERRED = _Deferred()


def deferred_interrupts() -> _Deferred:
    """A context manager holding SIGINT for the duration of the block (main thread only)."""
    return _DEFERRED


__all__ = ["deferred_interrupts"]
