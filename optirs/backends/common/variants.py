"""Kernels specialized by constants, in a form that numba caches on disk.

numba folds a function's globals into constants, so a loop specialized per format (its branches
on the format folded away) is the same code with other constants. Written as a closure, it would
never load from numba's cache: numba keys a cached closure by its pickled cells, and a cell that
holds a compiled function pickles with an id drawn anew in every process. A variant here is a
module-level template's code with its constants, and the variants it calls, bound as globals of
its own and a qualified name of its own: numba caches it like any module-level function, in an
index per variant. numba invalidates a cached function when its own source file changes, not when
a function it calls does; a variant's name also carries the state of the sources it can call
into (the backends' and core's), so editing the shared math never loads a stale loop.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any, Callable, Dict

from optirs.core.compile_cache import source_state

# what a variant can call into, beside its own file (numba watches that one)
_SOURCES = ("backends/common", "backends/cpu", "backends/cuda", "core")


def _describe(value: Any) -> str:
    """A stable text of a constant: a compiled variant by its name, anything else by its repr."""
    py_func = getattr(value, "py_func", None)
    if py_func is not None:
        return f"{py_func.__module__}.{py_func.__qualname__}"
    return repr(value)


def variant(template: Callable[..., Any], label: str, constants: Dict[str, Any]) -> Callable[..., Any]:
    """``template`` (a module-level function without closure) with ``constants`` bound as its
    globals, named ``<template>__<label>_<digest of the constants>`` (its cache index).

    The template reads each constant as a module global of the same name; the module's own value
    of that name is never compiled.
    """
    if template.__closure__:
        raise TypeError(f"{template.__qualname__} is a closure; a variant's template binds globals only")
    glb = dict(template.__globals__)
    glb.update(constants)
    text = repr(sorted((name, _describe(value)) for name, value in constants.items())) + source_state(*_SOURCES)
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    fn = types.FunctionType(template.__code__, glb, template.__name__, template.__defaults__)
    fn.__qualname__ = f"{template.__qualname__}__{label}_{digest}"
    fn.__module__ = template.__module__
    fn.__doc__ = template.__doc__
    return fn


__all__ = ["variant"]
