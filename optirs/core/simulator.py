"""The one answer to "is numba's CUDA simulator on?" (``NUMBA_ENABLE_CUDASIM=1``).

numba reads the variable when it is first imported; asking numba's own config when it is loaded
keeps optirs and numba in agreement, and reading the environment otherwise keeps ``import optirs``
free of numba.
"""

from __future__ import annotations

import os
import sys


def cuda_simulator_enabled() -> bool:
    """True when numba.cuda runs kernels in its Python simulator instead of on a GPU."""
    config = sys.modules.get("numba.core.config")
    if config is not None and hasattr(config, "ENABLE_CUDASIM"):
        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def is_simulator_array(array: object) -> bool:
    """True for the simulator's device arrays (they wrap a numpy array and have no __cuda_array_interface__)."""
    return type(array).__module__.startswith("numba.cuda.simulator")
