"""optirs: optimizer-step kernels for CUDA, OpenCL and CPU at memory bandwidth.

Importing optirs is light: no kernel compiles, no device probing and no plugin loading happen
until a backend is first needed.
"""

from __future__ import annotations

from optirs.core.errors import (BackendUnavailableError, DeviceMemoryError, GpuOptimError, InvalidParameterError,
                     PluginError, ShapeMismatchError, UnsupportedOperationError)
from optirs.core.definitions import DEFINITIONS
from optirs.core.formats import Precision
from optirs.optim.optimizers import OPTIMIZERS, GpuOptimizer, GpuOptimizerConfig
from optirs.plugin.registry import (SUPPORTED_BACKENDS, get_backend, list_backends, list_plugins, register_plugin,
                       unregister_plugin)

__version__ = "0.1.0"

# One class and one hyperparameter type per optimizer definition (GpuAdam, AdamParams, ...).
_OPTIMIZER_NAMES = [cls.__name__ for cls in OPTIMIZERS.values()]
_PARAMS_NAMES = list(dict.fromkeys(d.params_type.__name__ for d in DEFINITIONS.values()))
globals().update({cls.__name__: cls for cls in OPTIMIZERS.values()})
globals().update({d.params_type.__name__: d.params_type for d in DEFINITIONS.values()})

# The seed's re-exports from the analysis and training modules, imported on first access so
# `import optirs` stays light.
_LAZY = {
    "optirs.analysis.fusion": ["FusionGraph", "FusionGroup", "FusionOp", "FusionPlan", "FusionPlanner", "OpKind"],
    "optirs.memory": ["MemoryPool"],
    "optirs.optim.mixed_precision": ["f16_bits_to_f32", "f32_to_f16_bits", "DynamicLossScaler", "MixedPrecisionConfig",
                               "OverflowStats", "MixedPrecisionOptimizer"],
    "optirs.analysis.occupancy": ["calculate_occupancy", "optimal_block_size", "KernelResourceUsage",
                                  "OccupancyLimiter", "OccupancyResult", "SmResourceLimits"],
    "optirs.analysis.quantization": ["fake_quant_backward", "fake_quant_fp8", "fake_quant_int",
                                     "fake_quant_int_per_channel", "per_channel_params", "Fp8Format", "IntDtype",
                                     "QuantParams", "QuantScheme", "QuantTarget", "RoundingMode"],
    "optirs.optim.qat": ["QatConfig", "QatOptimizer"],
    "optirs.optim.sparse": ["CooGradient", "CsrGradient", "LazyAdamMode", "SparseAdam", "SparseAdamConfig",
                                "SparseAdamTable", "SparseSgd", "SparseSgdConfig", "SparseSgdTable"],
}
_LAZY_NAMES = {name: module for module, names in _LAZY.items() for name in names}

# Modules that moved into the layers keep their old attribute names (``from optirs import reference``).
_MOVED_MODULES = {
    "reference": "optirs.core.reference", "params": "optirs.core.params", "scalars": "optirs.core.scalars",
    "errors": "optirs.core.errors", "arrays": "optirs.core.arrays", "layout": "optirs.core.layout",
    "hookspecs": "optirs.plugin.hookspecs", "registry": "optirs.plugin.registry",
    "optimizers": "optirs.optim.optimizers", "mixed_precision": "optirs.optim.mixed_precision",
    "sparse_optimizer": "optirs.optim.sparse", "multi_gpu": "optirs.optim.data_parallel",
    "tensor_cores": "optirs.analysis.tensor_cores", "cli": "optirs.tools.cli", "bench": "optirs.tools.bench",
}


def __getattr__(name: str):
    import importlib

    if name in _MOVED_MODULES:
        value = importlib.import_module(_MOVED_MODULES[name])
        globals()[name] = value
        return value
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'optirs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY_NAMES))

__all__ = [
    "GpuOptimError", "BackendUnavailableError", "UnsupportedOperationError", "InvalidParameterError",
    "ShapeMismatchError", "DeviceMemoryError", "PluginError",
    "GpuOptimizer", "GpuOptimizerConfig", "Precision", *_OPTIMIZER_NAMES, *_PARAMS_NAMES,
    "SUPPORTED_BACKENDS", "get_backend", "list_backends", "list_plugins", "register_plugin", "unregister_plugin",
    *_LAZY_NAMES,
]
