"""Critical sections that a KeyboardInterrupt cannot split.

A step changes the parameters, the state and the step count; Ctrl-C landing between two of
those would leave an optimizer that is neither before nor after the step. Inside
:func:`deferred_interrupts` a SIGINT is only recorded; it is delivered (the previous handler runs,
by default raising KeyboardInterrupt) when the outermost section ends, so it lands before or after.

Only the main thread receives Python signal handlers, and only it may swap them: in any other
thread, or while another section of the main thread is open, this is a no-op.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, List

_depth = 0  # open sections of the main thread
_pending: List[Any] = []  # frames of the SIGINTs received in the open section


def _record(signum: int, frame: Any) -> None:
    _pending.append(frame)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT for the duration of the block (main thread only); deliver it on exit."""
    global _depth
    previous = signal.getsignal(signal.SIGINT) if not _depth and threading.current_thread() is threading.main_thread() else None
    if previous is None:  # not the main thread, nested, or a handler Python cannot restore
        yield
        return
    try:
        signal.signal(signal.SIGINT, _record)
    except (ValueError, OSError):  # e.g. a subinterpreter
        yield
        return
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        signal.signal(signal.SIGINT, previous)
        if _pending:
            frame = _pending[-1]
            _pending.clear()
            _deliver(previous, frame)


def _deliver(handler: Any, frame: Any) -> None:
    if callable(handler):
        handler(signal.SIGINT, frame)  # by default signal.default_int_handler: KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
    # SIG_IGN (or None: a handler installed outside Python) ignores it, as it would have.


__all__ = ["deferred_interrupts"]
