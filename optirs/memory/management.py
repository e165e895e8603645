"""Memory management policies: which resident blocks to evict, and how to compact live blocks.

- Eviction policies (:class:`LRUPolicy`, :class:`LFUPolicy`, :class:`FIFOPolicy`,
  :class:`LargestFirstPolicy`) rank resident blocks; :class:`ResidencyManager` keeps a set of
  blocks within a byte budget, evicting by the policy and never evicting pinned blocks.
- :func:`plan_defragmentation` turns a set of live blocks into a list of moves that slides them
  down to the lowest addresses (respecting alignment and blocks that may not move), so that the
  free space becomes one range. Applying the moves in order is safe with memmove semantics: every
  move goes to a lower or equal address and never overwrites a block that has not moved yet.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterable, List, Mapping, Sequence, Tuple

import numpy as np

from optirs.core.errors import DeviceMemoryError, InvalidParameterError

__all__ = ["EvictionPolicy", "LRUPolicy", "LFUPolicy", "FIFOPolicy", "LargestFirstPolicy", "POLICIES",
           "ResidencyManager", "Move", "DefragPlan", "plan_defragmentation"]


# ----------------------------------------------------------------------------- eviction


class EvictionPolicy:
    """Orders resident blocks for eviction; :meth:`order` gives the first victim first."""

    name = "base"

    def __init__(self) -> None:
        self._sizes: Dict[Hashable, int] = {}

    def inserted(self, key: Hashable, size: int) -> None:
        self._sizes[key] = size

    def accessed(self, key: Hashable) -> None:
        pass

    def removed(self, key: Hashable) -> None:
        self._sizes.pop(key, None)

    def order(self) -> List[Hashable]:
        raise NotImplementedError

    def victims(self, bytes_needed: int, exclude: Iterable[Hashable] = ()) -> List[Hashable]:
        """The blocks to evict, in order, until at least ``bytes_needed`` bytes are freed
        (all evictable blocks if that is not enough)."""
        skip = set(exclude)
        out, freed = [], 0
        for key in self.order():
            if freed >= bytes_needed:
                break
            if key in skip:
                continue
            out.append(key)
            freed += self._sizes[key]
        return out


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._recency: "OrderedDict[Hashable, None]" = OrderedDict()

    def inserted(self, key, size):
        super().inserted(key, size)
        self._recency[key] = None
        self._recency.move_to_end(key)

    def accessed(self, key):
        self._recency.move_to_end(key)

    def removed(self, key):
        super().removed(key)
        self._recency.pop(key, None)

    def order(self):
        return list(self._recency)


class FIFOPolicy(EvictionPolicy):
    """Oldest insertion first; accesses do not matter."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._seq: Dict[Hashable, int] = {}
        self._counter = itertools.count()

    def inserted(self, key, size):
        super().inserted(key, size)
        self._seq[key] = next(self._counter)

    def removed(self, key):
        super().removed(key)
        self._seq.pop(key, None)

    def order(self):
        return sorted(self._seq, key=self._seq.__getitem__)


class LFUPolicy(EvictionPolicy):
    """Fewest accesses first (since insertion); ties go to the least recently used."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: Dict[Hashable, int] = {}
        self._last: Dict[Hashable, int] = {}
        self._clock = itertools.count()

    def inserted(self, key, size):
        super().inserted(key, size)
        self._count[key] = 1
        self._last[key] = next(self._clock)

    def accessed(self, key):
        self._count[key] += 1
        self._last[key] = next(self._clock)

    def removed(self, key):
        super().removed(key)
        self._count.pop(key, None)
        self._last.pop(key, None)

    def order(self):
        return sorted(self._count, key=lambda k: (self._count[k], self._last[k]))


class LargestFirstPolicy(LRUPolicy):
    """Largest block first (fewest evictions to free a given amount); ties by least recent use."""

    name = "largest"

    def order(self):
        recency = {k: i for i, k in enumerate(self._recency)}
        return sorted(self._recency, key=lambda k: (-self._sizes[k], recency[k]))


POLICIES = {cls.name: cls for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, LargestFirstPolicy)}


class ResidencyManager:
    """Keeps blocks resident within ``capacity`` bytes, evicting by ``policy`` (name or instance)."""

    def __init__(self, capacity: int, policy: Any = "lru"):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidParameterError(f"capacity={capacity!r}, expected a number of bytes >= 0")
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise InvalidParameterError(f"policy={policy!r}, expected one of {sorted(POLICIES)}")
            policy = POLICIES[policy]()
        elif not isinstance(policy, EvictionPolicy):
            raise InvalidParameterError(f"policy={policy!r}, expected a policy name or an EvictionPolicy")
        self.capacity = capacity
        self.policy = policy
        self._sizes: Dict[Hashable, int] = {}
        self._pinned: set = set()
        self.used = 0
        self.hits = self.misses = self.evictions = 0

    def __contains__(self, key) -> bool:
        return key in self._sizes

    @property
    def resident(self) -> Dict[Hashable, int]:
        return dict(self._sizes)

    def access(self, key: Hashable, size: int) -> List[Hashable]:
        """Touch ``key`` (making it resident with ``size`` bytes if it is not); returns the evicted keys.

        :raises DeviceMemoryError: when it cannot fit even after evicting every unpinned block
            (nothing is evicted then).
        """
        if key in self._sizes:
            if size != self._sizes[key]:
                raise InvalidParameterError(f"size={size} for resident key {key!r} of {self._sizes[key]} bytes, expected the same size")
            self.hits += 1
            self.policy.accessed(key)
            return []
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidParameterError(f"size={size!r}, expected a number of bytes >= 0")
        need = self.used + size - self.capacity
        victims: List[Hashable] = []
        if need > 0:
            victims = self.policy.victims(need, exclude=self._pinned)
            if sum(self._sizes[v] for v in victims) < need:
                pinned = sum(self._sizes[k] for k in self._pinned)
                raise DeviceMemoryError(
                    f"{key!r} needs {size} bytes: capacity {self.capacity}, {self.used} in use of which {pinned} pinned; "
                    "expected enough unpinned blocks to evict"
                )
        for v in victims:
            self._evict(v)
        self.misses += 1
        self._sizes[key] = size
        self.used += size
        self.policy.inserted(key, size)
        return victims

    def _evict(self, key):
        self.used -= self._sizes.pop(key)
        self.policy.removed(key)
        self.evictions += 1

    def remove(self, key: Hashable) -> None:
        if key not in self._sizes:
            raise InvalidParameterError(f"key={key!r} is not resident")
        self._pinned.discard(key)
        self.used -= self._sizes.pop(key)
        self.policy.removed(key)

    def pin(self, key: Hashable) -> None:
        if key not in self._sizes:
            raise InvalidParameterError(f"key={key!r} is not resident, expected a resident block to pin")
        self._pinned.add(key)

    def unpin(self, key: Hashable) -> None:
        self._pinned.discard(key)


# ----------------------------------------------------------------------------- defragmentation


@dataclass(frozen=True)
class Move:
    key: Hashable
    source: int
    destination: int
    size: int


@dataclass(frozen=True)
class DefragPlan:
    """Moves to apply in order, the resulting placement, and the fragmentation before and after."""

    moves: Tuple[Move, ...]
    placement: Dict[Hashable, int]
    bytes_moved: int
    capacity: int
    fragmentation_before: float
    fragmentation_after: float
    largest_free_before: int
    largest_free_after: int

    def apply(self, memory: np.ndarray) -> None:
        """Carry out the moves on a byte buffer standing for the device range (a CPU reference)."""
        buf = memory.reshape(-1).view(np.uint8)
        for m in self.moves:
            buf[m.destination : m.destination + m.size] = buf[m.source : m.source + m.size].copy()


def _free_ranges(blocks: Sequence[Tuple[int, int]], capacity: int) -> List[Tuple[int, int]]:
    out, cursor = [], 0
    for off, size in sorted(blocks):
        if off > cursor:
            out.append((cursor, off - cursor))
        cursor = max(cursor, off + size)
    if capacity > cursor:
        out.append((cursor, capacity - cursor))
    return out


def fragmentation(blocks: Sequence[Tuple[int, int]], capacity: int) -> Tuple[float, int]:
    """(1 - largest free range / free bytes, largest free range) of live ``(offset, size)`` blocks."""
    free = _free_ranges(blocks, capacity)
    total = sum(s for _, s in free)
    largest = max((s for _, s in free), default=0)
    return (1.0 - largest / total if total else 0.0), largest


def plan_defragmentation(blocks: Mapping[Hashable, Tuple[int, int]], capacity: int, alignment: int = 1,
                         pinned: Iterable[Hashable] = ()) -> DefragPlan:
    """Plan moves that compact live ``blocks`` (key -> (offset, size)) toward offset 0.

    Blocks slide down in address order to the next ``alignment``-aligned free address; a block
    in ``pinned`` stays where it is and the others flow around it. Every block must lie in
    ``[0, capacity)``, not overlap another, and (when it may move) be aligned.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise InvalidParameterError(f"capacity={capacity!r}, expected a number of bytes >= 0")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise InvalidParameterError(f"alignment={alignment!r}, expected a power of two")
    pinned = set(pinned)
    unknown = pinned - set(blocks)
    if unknown:
        raise InvalidParameterError(f"pinned keys {sorted(map(repr, unknown))} are not among the blocks")
    items = []
    for key, (off, size) in blocks.items():
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (off, size)) or off < 0 or size < 0:
            raise InvalidParameterError(f"block {key!r} = ({off!r}, {size!r}), expected integer offset and size >= 0")
        if off + size > capacity:
            raise InvalidParameterError(f"block {key!r} ends at {off + size}, expected within capacity {capacity}")
        if key not in pinned and off % alignment:
            raise InvalidParameterError(f"block {key!r} at offset {off} is not aligned to {alignment}")
        items.append((int(off), int(size), key))
    items.sort(key=lambda t: (t[0], t[1]))
    for (o1, s1, k1), (o2, s2, k2) in zip(items, items[1:]):
        if o1 + s1 > o2:
            raise InvalidParameterError(f"blocks {k1!r} [{o1}, {o1 + s1}) and {k2!r} [{o2}, {o2 + s2}) overlap")
    moves, placement, cursor = [], {}, 0
    for off, size, key in items:
        if key in pinned:
            placement[key] = off
            cursor = max(cursor, off + size)
            continue
        # In address order the cursor never passes an unplaced block's offset, and that offset is
        # aligned: the block slides down (or stays), and pinned blocks after it are not reached.
        dst = -(-cursor // alignment) * alignment
        placement[key] = dst
        if dst != off:
            moves.append(Move(key, off, dst, size))
        cursor = dst + size
    before = [(o, s) for o, s, _ in items]
    after = [(placement[k], s) for _, s, k in items]
    fb, lb = fragmentation(before, capacity)
    fa, la = fragmentation(after, capacity)
    return DefragPlan(tuple(moves), placement, sum(m.size for m in moves), capacity, fb, fa, lb, la)
