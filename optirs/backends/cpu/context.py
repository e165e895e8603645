"""The cpu backend's context: the kernels module and the caches of typed lists, and the host's description."""

from __future__ import annotations

import os
import platform
from typing import Any, Dict, List

import numpy as np

from optirs.backends.common.identity_cache import ArrayListCache, identity_key
from optirs.backends.cpu.typed_lists import cached_typed_list, latest_typed_list


def cpu_name() -> str:
    """The host processor's model name (for device listings and benchmark records)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class CpuContext:
    """The opened CPU backend: the kernels module and a small cache of typed lists."""

    # Typed lists kept: parameter lists (the same memory step after step) and, per parameter
    # list, its latest gradient list (optirs.backends.common.identity_cache: an entry keeps no
    # array alive, so there is room for every bucket of a CPUOffload's chunks).
    CACHED = {"params": 64, "grads": 64}

    def __init__(self, kernels: Any):
        from optirs.backends.cpu.threads import StepThreads

        self.kernels = kernels
        self.threads = StepThreads()  # each step's thread count (serial when small, the free cores else)
        self.lists: Dict[str, ArrayListCache] = {role: ArrayListCache(n) for role, n in self.CACHED.items()}
        # The same for the word views the formats capability stages (optirs.backends.cpu.formats).
        self.format_lists: Dict[str, ArrayListCache] = {role: ArrayListCache(n) for role, n in self.CACHED.items()}

    def typed_lists(self, params: List[np.ndarray], grads: List[np.ndarray]) -> tuple:
        """The typed lists of one step's parameters and gradients (flat views)."""
        def flat_list(arrays: List[np.ndarray]) -> Any:
            return self.kernels.typed_list([x.reshape(-1) for x in arrays])
        return staged_lists(self.lists, params, grads, flat_list, flat_list)


def staged_lists(lists: Dict[str, ArrayListCache], params: List[Any], grads: List[Any],
                 build_params: Any, build_grads: Any) -> tuple:
    """(typed list of ``params``, of ``grads``): the parameters' cached by identity, the gradients
    as the parameters' latest."""
    ids = identity_key(params)
    return (cached_typed_list(lists["params"], params, build_params, ids),
            latest_typed_list(lists["grads"], ids, grads, build_grads))


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
