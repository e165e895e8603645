"""A caching device memory pool, and its installation as numba.cuda's External Memory Manager.

:class:`MemoryPool` is pure bookkeeping over a *raw allocator* (anything with ``alloc(nbytes) ->
address`` raising ``MemoryError`` when the device is full, and ``free(address)``), so every rule
is tested on the CPU with a fake allocator:

- requests are rounded up to 512 bytes; requests up to 1 MiB come from 2 MiB segments shared
  by small blocks, larger ones from segments of 20 MiB (requests under 10 MiB) or the request
  rounded up to 2 MiB;
- a free block is found best-fit in its size class and split, the remainder staying cached
  (large blocks are split only when more than 1 MiB would remain, so small requests never pin
  big segments);
- a freed block is merged with free neighbours of its segment; :meth:`MemoryPool.trim` hands
  wholly free segments back to the raw allocator;
- an optional ``limit`` on reserved bytes: past it, cached segments are trimmed first, then
  :class:`optirs.DeviceMemoryError` says what was asked for and what is held.

:func:`install` makes numba.cuda allocate every device array (optirs' state buffers included)
from a pool, through numba's EMM plugin interface (:class:`PoolMemoryManager`, a subclass of
``numba.cuda.HostOnlyCUDAMemoryManager``). The pool frees blocks immediately back to its cache
without synchronizing: like numba's own deferred frees, this assumes work on one stream.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from optirs.core.errors import DeviceMemoryError, InvalidParameterError, UnsupportedOperationError

ALIGNMENT = 512
SMALL_REQUEST = 1 << 20  # requests up to this size share small segments
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
SEGMENT_ROUND = 2 << 20

__all__ = ["MemoryPool", "PoolStats", "CudaDriverAllocator", "PoolMemoryManager", "install", "current_pool"]


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool. ``bytes_in_use + bytes_cached == bytes_reserved`` always."""

    bytes_in_use: int  # handed out (rounded sizes)
    bytes_requested: int  # as asked for by callers
    bytes_cached: int  # reserved from the device but free in the pool
    bytes_reserved: int  # held from the raw allocator (all segments)
    peak_bytes_in_use: int
    peak_bytes_reserved: int
    largest_free_block: int
    fragmentation: float  # 1 - largest free block / cached bytes (0 when nothing is cached)
    segments: int
    blocks_in_use: int
    allocs: int
    frees: int
    cache_hits: int  # allocations served without asking the raw allocator
    segment_allocs: int  # raw allocations
    segment_frees: int  # raw frees (trim, limit pressure, out-of-memory retries)
    limit: Optional[int]


class _Block:
    __slots__ = ("address", "size", "requested", "segment", "free", "prev", "next", "small")

    def __init__(self, address: int, size: int, segment: int, small: bool):
        self.address, self.size, self.segment, self.small = address, size, segment, small
        self.requested = 0
        self.free = True
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


def _round(nbytes: int) -> int:
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def _segment_size(rounded: int) -> int:
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-rounded // SEGMENT_ROUND) * SEGMENT_ROUND


class MemoryPool:
    """Size-class caching with block splitting and coalescing over a raw allocator.

    :param allocator: ``alloc(nbytes) -> int`` (raising ``MemoryError`` when full) and ``free(address)``.
    :param limit: most bytes the pool may hold from the allocator (None: no limit).
    """

    def __init__(self, allocator: Any, limit: Optional[int] = None):
        if not (callable(getattr(allocator, "alloc", None)) and callable(getattr(allocator, "free", None))):
            raise InvalidParameterError(f"allocator={allocator!r}, expected an object with alloc(nbytes) and free(address)")
        self._check_limit(limit)
        self.allocator = allocator
        self._limit = limit
        self._lock = threading.RLock()
        self._segments: Dict[int, int] = {}  # segment base address -> size
        self._heads: Dict[int, _Block] = {}  # segment base -> first block
        self._live: Dict[int, _Block] = {}  # address -> block handed out
        self._free = {True: [], False: []}  # small? -> sorted [(size, address)]
        self._free_blocks: Dict[int, _Block] = {}
        self._in_use = self._requested = self._reserved = 0
        self._peak_in_use = self._peak_reserved = 0
        self._allocs = self._frees = self._hits = self._seg_allocs = self._seg_frees = 0
        self._generation = 0  # bumped by release_all: handles from before it are void

    @staticmethod
    def _check_limit(limit: Any) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidParameterError(f"limit={limit!r}, expected None or a number of bytes >= 0")

    @property
    def limit(self) -> Optional[int]:
        return self._limit

    @limit.setter
    def limit(self, limit: Optional[int]) -> None:
        """A new limit applies to later segment allocations (cached segments are trimmed to meet it)."""
        self._check_limit(limit)
        with self._lock:
            self._limit = limit
            if limit is not None and self._reserved > limit:
                self.trim()

    # ------------------------------------------------------------ allocation

    def malloc(self, nbytes: int) -> int:
        """A block of at least ``nbytes`` bytes, 512-byte aligned; returns its device address."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidParameterError(f"nbytes={nbytes!r}, expected an integer >= 0")
        size = _round(nbytes)
        small = size <= SMALL_REQUEST
        with self._lock:
            block = self._take_free(size, small)
            if block is None:
                block = self._new_segment(size, small, nbytes)
            else:
                self._hits += 1
            self._split(block, size)
            block.free, block.requested = False, nbytes
            self._live[block.address] = block
            self._in_use += block.size
            self._requested += nbytes
            self._peak_in_use = max(self._peak_in_use, self._in_use)
            self._allocs += 1
            return block.address

    @property
    def generation(self) -> int:
        """Changes when :meth:`release_all` voids every outstanding address."""
        return self._generation

    def free(self, address: int, generation: Optional[int] = None) -> None:
        """Return a block to the cache (merged with free neighbours of its segment).

        With ``generation`` (the value of :attr:`generation` when the block was allocated), a free
        that arrives after :meth:`release_all` is ignored: the address may belong to a new block.
        """
        with self._lock:
            if generation is not None and generation != self._generation:
                return
            block = self._live.pop(address, None)
            if block is None:
                raise InvalidParameterError(f"address={address:#x} was not allocated by this pool (or freed twice)")
            self._in_use -= block.size
            self._requested -= block.requested
            self._frees += 1
            block.free, block.requested = True, 0
            for other in (block.prev, block.next):
                if other is not None and other.free:
                    self._unlist(other)
            if block.prev is not None and block.prev.free:
                block = self._merge(block.prev, block)
            if block.next is not None and block.next.free:
                block = self._merge(block, block.next)
            self._list(block)

    def size_of(self, address: int) -> int:
        """The (rounded) size of a live block."""
        with self._lock:
            block = self._live.get(address)
            if block is None:
                raise InvalidParameterError(f"address={address:#x} is not a live block of this pool")
            return block.size

    def trim(self) -> int:
        """Hand every wholly free segment back to the raw allocator; returns the bytes released."""
        with self._lock:
            released = 0
            for base in [b for b, head in self._heads.items() if head.free and head.next is None]:
                released += self._release(base)
            return released

    def release_all(self) -> None:
        """Free every segment, live blocks included (a context reset: their addresses become invalid)."""
        with self._lock:
            for base in list(self._segments):
                self._release(base, force=True)
            self._live.clear()
            self._in_use = self._requested = 0
            self._generation += 1

    # ------------------------------------------------------------ statistics

    def stats(self) -> PoolStats:
        with self._lock:
            cached = self._reserved - self._in_use
            largest = max((b.size for b in self._free_blocks.values()), default=0)
            return PoolStats(
                bytes_in_use=self._in_use, bytes_requested=self._requested, bytes_cached=cached,
                bytes_reserved=self._reserved, peak_bytes_in_use=self._peak_in_use,
                peak_bytes_reserved=self._peak_reserved, largest_free_block=largest,
                fragmentation=(1.0 - largest / cached) if cached else 0.0, segments=len(self._segments),
                blocks_in_use=len(self._live), allocs=self._allocs, frees=self._frees, cache_hits=self._hits,
                segment_allocs=self._seg_allocs, segment_frees=self._seg_frees, limit=self._limit,
            )

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_in_use, self._peak_reserved = self._in_use, self._reserved

    def blocks(self) -> List[Tuple[int, int, int, bool]]:
        """Every block as (segment base, address, size, free), in address order (for inspection)."""
        with self._lock:
            out = []
            for base in sorted(self._heads):
                b = self._heads[base]
                while b is not None:
                    out.append((base, b.address, b.size, b.free))
                    b = b.next
            return out

    # ------------------------------------------------------------ internals

    def _list(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address))
        self._free_blocks[block.address] = block

    def _unlist(self, block: _Block) -> None:
        lst = self._free[block.small]
        i = bisect.bisect_left(lst, (block.size, block.address))
        del lst[i]
        del self._free_blocks[block.address]

    def _take_free(self, size: int, small: bool) -> Optional[_Block]:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        block = self._free_blocks[lst[i][1]]
        self._unlist(block)
        return block

    def _split(self, block: _Block, size: int) -> None:
        rest = block.size - size
        # Small blocks split down to the alignment; large ones only when a large block remains.
        if rest >= (ALIGNMENT if block.small else SMALL_REQUEST + 1):
            tail = _Block(block.address + size, rest, block.segment, block.small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._list(tail)

    def _merge(self, left: _Block, right: _Block) -> _Block:
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left

    def _new_segment(self, size: int, small: bool, nbytes: int) -> _Block:
        seg = _segment_size(size)
        if self._limit is not None and self._reserved + seg > self._limit:
            self.trim()
            if self._reserved + seg > self._limit:
                raise DeviceMemoryError(
                    f"memory pool limit: {nbytes} bytes asked for (a {seg}-byte segment) with {self._reserved} bytes "
                    f"reserved ({self._in_use} in use), expected at most limit={self._limit} bytes reserved"
                )
        try:
            base = int(self.allocator.alloc(seg))
        except MemoryError:
            # The device is full: give cached segments back and try once more.
            if not self.trim():
                raise DeviceMemoryError(
                    f"device out of memory: {nbytes} bytes asked for (a {seg}-byte segment); the pool holds "
                    f"{self._reserved} bytes, {self._in_use} in use, nothing cached to release"
                ) from None
            try:
                base = int(self.allocator.alloc(seg))
            except MemoryError:
                raise DeviceMemoryError(
                    f"device out of memory: {nbytes} bytes asked for (a {seg}-byte segment) after releasing the "
                    f"pool's cache; the pool holds {self._reserved} bytes, {self._in_use} in use"
                ) from None
        self._seg_allocs += 1
        self._segments[base] = seg
        block = _Block(base, seg, base, small)
        self._heads[base] = block
        self._reserved += seg
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return block

    def _release(self, base: int, force: bool = False) -> int:
        head = self._heads.pop(base)
        b = head
        while b is not None:
            if b.free:
                self._unlist(b)
            b = b.next
        size = self._segments.pop(base)
        self._reserved -= size
        self._seg_frees += 1
        self.allocator.free(base)
        return size

    def __repr__(self) -> str:
        s = self.stats()
        return f"<MemoryPool in_use={s.bytes_in_use} cached={s.bytes_cached} reserved={s.bytes_reserved} limit={s.limit}>"


# ----------------------------------------------------------------------------- numba.cuda wiring
# Thin by design: it needs a GPU and cannot run here or in the simulator. benchmarks/bench_memory_pool.py
# checks it on the device.


class CudaDriverAllocator:
    """Raw allocator over the CUDA driver (cuMemAlloc / cuMemFree), through numba's driver binding."""

    def __init__(self) -> None:
        from numba.cuda.cudadrv import driver as drv

        self._drv = drv

    def alloc(self, nbytes: int) -> int:
        drv = self._drv
        try:
            ptr = drv.driver.cuMemAlloc(nbytes)
        except drv.CudaAPIError as exc:
            if exc.code == drv.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise MemoryError(f"cuMemAlloc({nbytes}) failed: out of memory") from exc
            raise
        return int(ptr)

    def free(self, address: int) -> None:
        drv = self._drv
        drv.driver.cuMemFree(drv.binding.CUdeviceptr(address))


_settings: Dict[str, Any] = {"limit": None}
_manager_class = None


def _make_manager_class():
    global _manager_class
    if _manager_class is not None:
        return _manager_class
    import ctypes
    import weakref

    from numba import cuda
    from numba.cuda.cudadrv.driver import GetIpcHandleMixin, MemoryInfo, MemoryPointer

    class PoolMemoryManager(GetIpcHandleMixin, cuda.HostOnlyCUDAMemoryManager):
        """numba.cuda EMM plugin: device allocations come from an optirs :class:`MemoryPool`."""

        def initialize(self) -> None:
            # numba calls this every time the context is prepared for use: create the pool once.
            if getattr(self, "pool", None) is None:
                self.pool = MemoryPool(CudaDriverAllocator(), limit=_settings["limit"])

        def memalloc(self, size: int):
            pool = self.pool
            address = pool.malloc(int(size))
            generation = pool.generation
            # The finalizer only returns the block to the pool's cache: no driver call, no sync.
            # After a context reset (release_all) it is a no-op: the address may be reused.
            return MemoryPointer(weakref.proxy(self.context), ctypes.c_void_p(address), size,
                                 finalizer=lambda: pool.free(address, generation))

        def get_memory_info(self):
            from numba.cuda.cudadrv.driver import driver

            free, total = driver.cuMemGetInfo()
            return MemoryInfo(free=free + self.pool.stats().bytes_cached, total=total)

        def reset(self) -> None:
            super().reset()
            if hasattr(self, "pool"):
                self.pool.release_all()

        @property
        def interface_version(self) -> int:
            return 1

    _manager_class = PoolMemoryManager
    return PoolMemoryManager


def __getattr__(name: str):
    # ``NUMBA_CUDA_MEMORY_MANAGER=optirs.memory.pool`` makes numba look up this attribute.
    if name in ("PoolMemoryManager", "_numba_memory_manager"):
        return _make_manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(limit: Optional[int] = None) -> None:
    """Make numba.cuda allocate device memory from a :class:`MemoryPool` (one per context).

    Call before the first CUDA context is created (before any device array or kernel launch);
    contexts that already exist keep numba's own manager. :func:`current_pool` returns the pool.
    """
    MemoryPool._check_limit(limit)
    from numba import config

    if config.ENABLE_CUDASIM:
        raise UnsupportedOperationError("the memory pool cannot be installed in numba's CUDA simulator (no device memory)")
    from numba import cuda

    _settings["limit"] = limit
    cuda.set_memory_manager(_make_manager_class())


def current_pool() -> Optional[MemoryPool]:
    """The pool of the current CUDA context, or None when it does not use one."""
    from numba import cuda

    return getattr(cuda.current_context().memory_manager, "pool", None)
