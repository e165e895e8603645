"""The error and warning types of optirs.

Every error is a :class:`GpuOptimError`; the subclasses say what went wrong. Messages name the
offending value and what was expected ("beta1=1.2, expected 0 <= beta1 < 1").
"""

from __future__ import annotations


class GpuOptimError(Exception):
    """Base class of every error optirs raises on purpose."""


class BackendUnavailableError(GpuOptimError):
    """A backend was asked for by name and cannot open (unknown name, no device, package missing)."""


class UnsupportedOperationError(GpuOptimError):
    """The chosen backend (or the hardware) does not implement this operation."""


class InvalidParameterError(GpuOptimError, ValueError):
    """A hyperparameter or argument is outside its allowed range."""


class ShapeMismatchError(GpuOptimError, ValueError):
    """Arrays do not agree in count, shape, dtype or layout with what the step expects."""


class DeviceMemoryError(GpuOptimError, MemoryError):
    """The device could not provide the memory asked for."""


class PluginError(GpuOptimError):
    """A plugin failed to import, or its hooks do not match the specifications."""


class CompileCacheWarning(UserWarning):
    """Compiled kernels cannot be cached where they should be (docs/compile_cache.md): numba caches
    them elsewhere, or nowhere, and the warning says where and why."""


__all__ = [
    "GpuOptimError",
    "BackendUnavailableError",
    "UnsupportedOperationError",
    "InvalidParameterError",
    "ShapeMismatchError",
    "DeviceMemoryError",
    "PluginError",
    "CompileCacheWarning",
]
