"""The cpu backend's context: the kernels module and the caches of typed lists, and the host's description."""

from __future__ import annotations

import os
import platform
from collections import OrderedDict
from typing import Any, Dict, List

import numpy as np

from optirs.backends.cpu.typed_lists import cached_typed_list


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

    # Cached typed lists per role. An entry keeps its arrays alive (so the ids stay theirs):
    # parameters are the same memory step after step, but gradients are often new arrays every
    # step (torch's zero_grad(set_to_none=True)), so only the latest gradient list is kept;
    # a longer cache would hold old gradients, a model's worth each.
    CACHED = {"params": 4, "grads": 1}

    def __init__(self, kernels: Any):
        self.kernels = kernels
        # The numba typed lists of recent lists, keyed by the arrays' identities.
        self.lists: Dict[str, "OrderedDict[tuple, tuple]"] = {role: OrderedDict() for role in self.CACHED}
        # The same for the word views the formats capability stages (optirs.backends.cpu.formats).
        self.format_lists: Dict[str, "OrderedDict[tuple, tuple]"] = {role: OrderedDict() for role in self.CACHED}

    def typed_list(self, arrays: List[np.ndarray], role: str = "params"):
        return cached_typed_list(self.lists[role], arrays, self.CACHED[role],
                                 lambda a: self.kernels.typed_list([x.reshape(-1) for x in a]))


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
