"""CPU-side placement models of three classic allocators: buddy, slab and arena.

They plan where blocks would go in a device address range of a given capacity (offsets from
0), without touching a device, and report fragmentation. Running out of the modelled capacity
raises :class:`optirs.DeviceMemoryError`, as the device would.

- :class:`BuddyAllocator`: power-of-two blocks, each aligned to its own size; a freed block
  merges with its buddy (``offset ^ size``) as long as the buddy is free too.
- :class:`SlabAllocator`: fixed size classes; each slab (``slab_size`` bytes) holds objects of
  one class; empty slabs return to a shared pool of slabs.
- :class:`ArenaAllocator`: bump allocation with per-call alignment, freed all at once
  (:meth:`ArenaAllocator.reset`) or back to a :meth:`ArenaAllocator.mark` (stack discipline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from optirs.core.errors import DeviceMemoryError, InvalidParameterError

__all__ = ["AllocatorStats", "BuddyAllocator", "SlabAllocator", "ArenaAllocator"]


@dataclass(frozen=True)
class AllocatorStats:
    """Occupancy and fragmentation of a placement model.

    ``internal_fragmentation`` = 1 - requested / allocated bytes (rounding waste inside blocks);
    ``external_fragmentation`` = 1 - largest free block / free bytes (free space in pieces).
    """

    capacity: int
    allocated_bytes: int
    requested_bytes: int
    free_bytes: int
    largest_free_block: int
    allocations: int
    peak_allocated_bytes: int
    internal_fragmentation: float
    external_fragmentation: float


def _stats(capacity, allocated, requested, free, largest, count, peak) -> AllocatorStats:
    return AllocatorStats(capacity, allocated, requested, free, largest, count, peak,
                          1.0 - requested / allocated if allocated else 0.0,
                          1.0 - largest / free if free else 0.0)


def _size_arg(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidParameterError(f"{name}={value!r}, expected an integer >= {minimum}")
    return value


def _power_of_two(name: str, value) -> int:
    _size_arg(name, value, 1)
    if value & (value - 1):
        raise InvalidParameterError(f"{name}={value!r}, expected a power of two")
    return value


class BuddyAllocator:
    """Binary buddy allocator over ``capacity`` bytes (a power of two), blocks of at least ``min_block``."""

    def __init__(self, capacity: int, min_block: int = 256):
        self.capacity = _power_of_two("capacity", capacity)
        self.min_block = _power_of_two("min_block", min_block)
        if min_block > capacity:
            raise InvalidParameterError(f"min_block={min_block!r}, expected at most capacity={capacity}")
        self.max_order = (capacity // min_block).bit_length() - 1
        # order k holds blocks of min_block << k
        self._free: List[Set[int]] = [set() for _ in range(self.max_order + 1)]
        self._free[self.max_order].add(0)
        self._live: Dict[int, Tuple[int, int]] = {}  # offset -> (order, requested)
        self._allocated = self._requested = self._peak = 0

    def block_size(self, order: int) -> int:
        return self.min_block << order

    def allocate(self, size: int, alignment: int = 1) -> int:
        """Offset of a new block of at least ``size`` bytes, aligned to ``alignment`` (a power of two)."""
        _size_arg("size", size, 1)
        _power_of_two("alignment", alignment)
        need = max(size, alignment, self.min_block)  # a block is aligned to its own size
        order = max(0, (-(-need // self.min_block) - 1).bit_length())
        if order > self.max_order:
            raise DeviceMemoryError(f"size={size} (block of {need} bytes) exceeds the buddy capacity {self.capacity} bytes")
        k = order
        while k <= self.max_order and not self._free[k]:
            k += 1
        if k > self.max_order:
            raise DeviceMemoryError(
                f"no free block of {self.block_size(order)} bytes for size={size}: {self.capacity - self._allocated} bytes free "
                f"in pieces of at most {self._largest_free()} bytes"
            )
        offset = min(self._free[k])  # lowest address first keeps the low end dense
        self._free[k].remove(offset)
        while k > order:  # split, keeping the lower half
            k -= 1
            self._free[k].add(offset + self.block_size(k))
        self._live[offset] = (order, size)
        self._allocated += self.block_size(order)
        self._requested += size
        self._peak = max(self._peak, self._allocated)
        return offset

    def free(self, offset: int) -> None:
        entry = self._live.pop(offset, None)
        if entry is None:
            raise InvalidParameterError(f"offset={offset!r} is not an allocated block (or was freed twice)")
        order, size = entry
        self._allocated -= self.block_size(order)
        self._requested -= size
        while order < self.max_order:
            buddy = offset ^ self.block_size(order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def size_of(self, offset: int) -> int:
        if offset not in self._live:
            raise InvalidParameterError(f"offset={offset!r} is not an allocated block")
        return self.block_size(self._live[offset][0])

    def live_blocks(self) -> List[Tuple[int, int]]:
        return sorted((o, self.block_size(k)) for o, (k, _) in self._live.items())

    def free_blocks(self) -> List[Tuple[int, int]]:
        return sorted((o, self.block_size(k)) for k, s in enumerate(self._free) for o in s)

    def _largest_free(self) -> int:
        return max((self.block_size(k) for k, s in enumerate(self._free) if s), default=0)

    def stats(self) -> AllocatorStats:
        return _stats(self.capacity, self._allocated, self._requested, self.capacity - self._allocated,
                      self._largest_free(), len(self._live), self._peak)


class SlabAllocator:
    """Slabs of ``slab_size`` bytes carved into equal slots of one size class each.

    :param capacity: bytes in the modelled range (a multiple of ``slab_size``).
    :param size_classes: the object sizes, ascending; a request takes the smallest class that
        fits (each class divides into ``slab_size`` at least once; slots are aligned to the class
        size when it is a power of two).
    """

    def __init__(self, capacity: int, slab_size: int = 64 * 1024,
                 size_classes: Sequence[int] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)):
        self.slab_size = _size_arg("slab_size", slab_size, 1)
        self.capacity = _size_arg("capacity", capacity, slab_size)
        if capacity % slab_size:
            raise InvalidParameterError(f"capacity={capacity!r}, expected a multiple of slab_size={slab_size}")
        classes = [_size_arg("size_classes[i]", c, 1) for c in size_classes]
        if not classes or classes != sorted(set(classes)) or classes[-1] > slab_size:
            raise InvalidParameterError(
                f"size_classes={list(size_classes)!r}, expected distinct ascending sizes, at most slab_size={slab_size}"
            )
        self.size_classes = tuple(classes)
        self._free_slabs: List[int] = list(range(capacity - slab_size, -1, -slab_size))  # pop() gives the lowest
        self._partial: Dict[int, Set[int]] = {c: set() for c in classes}  # class -> slabs with free slots
        self._slab_class: Dict[int, int] = {}  # slab base -> class
        self._slab_free: Dict[int, List[int]] = {}  # slab base -> free slot offsets
        self._slab_used: Dict[int, int] = {}
        self._live: Dict[int, Tuple[int, int]] = {}  # offset -> (class, requested)
        self._allocated = self._requested = self._peak = 0

    def size_class(self, size: int) -> int:
        for c in self.size_classes:
            if c >= size:
                return c
        raise InvalidParameterError(f"size={size} exceeds the largest size class {self.size_classes[-1]}")

    def allocate(self, size: int) -> int:
        _size_arg("size", size, 1)
        cls = self.size_class(size)
        if self._partial[cls]:
            slab = min(self._partial[cls])
        else:
            if not self._free_slabs:
                raise DeviceMemoryError(
                    f"no free slab for size={size} (class {cls}): all {self.capacity // self.slab_size} slabs in use"
                )
            slab = self._free_slabs.pop()
            self._slab_class[slab] = cls
            slots = self.slab_size // cls
            self._slab_free[slab] = [slab + i * cls for i in range(slots - 1, -1, -1)]
            self._slab_used[slab] = 0
            self._partial[cls].add(slab)
        offset = self._slab_free[slab].pop()
        self._slab_used[slab] += 1
        if not self._slab_free[slab]:
            self._partial[cls].discard(slab)
        self._live[offset] = (cls, size)
        self._allocated += cls
        self._requested += size
        self._peak = max(self._peak, self._allocated)
        return offset

    def free(self, offset: int) -> None:
        entry = self._live.pop(offset, None)
        if entry is None:
            raise InvalidParameterError(f"offset={offset!r} is not an allocated object (or was freed twice)")
        cls, size = entry
        slab = offset - offset % self.slab_size
        self._allocated -= cls
        self._requested -= size
        self._slab_used[slab] -= 1
        if self._slab_used[slab] == 0:  # an empty slab goes back to every class
            self._partial[cls].discard(slab)
            for d in (self._slab_class, self._slab_free, self._slab_used):
                del d[slab]
            self._free_slabs.append(slab)
            self._free_slabs.sort(reverse=True)
        else:
            self._slab_free[slab].append(offset)
            self._partial[cls].add(slab)

    def live_blocks(self) -> List[Tuple[int, int]]:
        return sorted((o, c) for o, (c, _) in self._live.items())

    def slabs_in_use(self) -> Dict[int, int]:
        """Slab base -> its size class."""
        return dict(self._slab_class)

    def stats(self) -> AllocatorStats:
        # Free bytes: whole free slabs plus free slots of partial slabs; the largest free block is
        # a whole slab when one is free (any class can take it), else the largest free slot.
        free_slots = sum(len(v) * self._slab_class[s] for s, v in self._slab_free.items())
        free = len(self._free_slabs) * self.slab_size + free_slots
        largest = self.slab_size if self._free_slabs else max(
            (self._slab_class[s] for s, v in self._slab_free.items() if v), default=0)
        return _stats(self.capacity, self._allocated, self._requested, free, largest, len(self._live), self._peak)


class ArenaAllocator:
    """Bump allocation in ``capacity`` bytes; released all at once or back to a mark."""

    def __init__(self, capacity: int, alignment: int = 256):
        self.capacity = _size_arg("capacity", capacity, 1)
        self.alignment = _power_of_two("alignment", alignment)
        self._top = 0
        self._blocks: List[Tuple[int, int, int]] = []  # (offset, size, padding before it)
        self._requested = self._padding = self._peak = 0

    def allocate(self, size: int, alignment: Optional[int] = None) -> int:
        _size_arg("size", size, 1)
        align = self.alignment if alignment is None else _power_of_two("alignment", alignment)
        offset = -(-self._top // align) * align
        if offset + size > self.capacity:
            raise DeviceMemoryError(
                f"arena full: size={size} at offset {offset} exceeds capacity {self.capacity} ({self.capacity - self._top} bytes left)"
            )
        self._blocks.append((offset, size, offset - self._top))
        self._padding += offset - self._top
        self._requested += size
        self._top = offset + size
        self._peak = max(self._peak, self._top)
        return offset

    def free(self, offset: int) -> None:
        raise InvalidParameterError(
            f"offset={offset!r}: an arena does not free single blocks, expected reset() or release(mark)"
        )

    def mark(self) -> int:
        """A point to :meth:`release` back to (the number of blocks so far)."""
        return len(self._blocks)

    def release(self, mark: int) -> None:
        """Free every block allocated after ``mark`` (stack discipline)."""
        if isinstance(mark, bool) or not isinstance(mark, int) or not 0 <= mark <= len(self._blocks):
            raise InvalidParameterError(f"mark={mark!r}, expected a mark from 0 to {len(self._blocks)}")
        for offset, size, pad in self._blocks[mark:]:
            self._requested -= size
            self._padding -= pad
        del self._blocks[mark:]
        self._top = self._blocks[-1][0] + self._blocks[-1][1] if self._blocks else 0

    def reset(self) -> None:
        self.release(0)

    def live_blocks(self) -> List[Tuple[int, int]]:
        return [(o, s) for o, s, _ in self._blocks]

    def stats(self) -> AllocatorStats:
        # Padding counts as allocated-but-not-requested (internal fragmentation); the free space
        # is the single tail above the top, so external fragmentation is always 0.
        free = self.capacity - self._top
        return _stats(self.capacity, self._top, self._requested, free, free, len(self._blocks), self._peak)
