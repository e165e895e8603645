"""Device memory: a caching pool for the CUDA backend, and CPU-side allocator and policy models.

- :class:`MemoryPool` (:mod:`optirs.memory.pool`): size-class caching with block splitting over
  any raw allocator; :func:`optirs.memory.pool.install` makes numba.cuda (and so optirs' CUDA
  backend) allocate from it through numba's External Memory Manager interface.
- :mod:`optirs.memory.allocation`: buddy, slab and arena placement models with fragmentation stats.
- :mod:`optirs.memory.management`: eviction policies and defragmentation planning.
"""

from __future__ import annotations

from optirs.memory.pool import MemoryPool, PoolStats, current_pool, install

__all__ = ["MemoryPool", "PoolStats", "install", "current_pool", "allocation", "management"]


def __getattr__(name: str):
    if name in ("allocation", "management"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
