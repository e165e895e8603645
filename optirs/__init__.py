"""optirs: optimizer-step kernels for CUDA, OpenCL and CPU at memory bandwidth.

Importing optirs is light: no kernel compiles, no device probing and no plugin loading happen
until a backend is first needed.
"""

from __future__ import annotations

from .errors import (BackendUnavailableError, DeviceMemoryError, GpuOptimError, InvalidParameterError,
                     PluginError, ShapeMismatchError, UnsupportedOperationError)
from .optimizers import (GpuAdagrad, GpuAdam, GpuAdamW, GpuLamb, GpuOptimizer, GpuOptimizerConfig, GpuRmsprop,
                         GpuSgd)
from .params import AdagradParams, AdamParams, LambParams, RmspropParams, SgdParams
from .registry import (SUPPORTED_BACKENDS, get_backend, list_backends, list_plugins, register_plugin,
                       unregister_plugin)

__version__ = "0.1.0"

__all__ = [
    "GpuOptimError", "BackendUnavailableError", "UnsupportedOperationError", "InvalidParameterError",
    "ShapeMismatchError", "DeviceMemoryError", "PluginError",
    "GpuOptimizer", "GpuOptimizerConfig", "GpuAdam", "GpuAdamW", "GpuSgd", "GpuRmsprop", "GpuAdagrad", "GpuLamb",
    "AdamParams", "SgdParams", "RmspropParams", "AdagradParams", "LambParams",
    "SUPPORTED_BACKENDS", "get_backend", "list_backends", "list_plugins", "register_plugin", "unregister_plugin",
]
