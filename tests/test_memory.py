"""optirs.memory: the pool over a fake raw allocator, the EMM wiring with a fake context, the
buddy/slab/arena models, eviction policies and defragmentation plans (hypothesis invariants)."""

from __future__ import annotations

import gc
import os
import re
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optirs.core.errors import DeviceMemoryError, InvalidParameterError, UnsupportedOperationError
from optirs.memory import MemoryPool, pool as poolmod
from optirs.memory.allocation import ArenaAllocator, BuddyAllocator, SlabAllocator
from optirs.memory.management import (POLICIES, FIFOPolicy, LargestFirstPolicy, LFUPolicy, LRUPolicy,
                                      ResidencyManager, fragmentation, plan_defragmentation)

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MiB = 1 << 20


class FakeAllocator:
    """Stands in for cuMemAlloc/cuMemFree: disjoint 512-aligned ranges, an optional capacity."""

    def __init__(self, capacity=None):
        self.capacity = capacity
        self.live = {}
        self.next = 0x7F00_0000_0000
        self.alloc_calls = self.free_calls = 0

    def alloc(self, nbytes):
        self.alloc_calls += 1
        if self.capacity is not None and sum(self.live.values()) + nbytes > self.capacity:
            raise MemoryError("fake device full")
        addr = self.next
        self.next += nbytes + 4096  # gaps between segments: merging across them would be a bug
        self.live[addr] = nbytes
        return addr

    def free(self, address):
        self.free_calls += 1
        del self.live[address]  # KeyError: the pool freed something it did not get


def check_pool(pool: MemoryPool, fake: FakeAllocator, live: dict):
    """Every invariant of the pool against the fake allocator and the caller's view of live blocks."""
    s = pool.stats()
    blocks = pool.blocks()
    # Segments are exactly what the allocator holds; blocks tile each segment with no gap or overlap.
    segments = {}
    for base, addr, size, free in blocks:
        segments.setdefault(base, []).append((addr, size, free))
    assert set(segments) == set(fake.live)
    for base, bl in segments.items():
        cursor = base
        for i, (addr, size, free) in enumerate(bl):
            assert addr == cursor and size > 0 and addr % 512 == 0
            cursor += size
            if i and free:
                assert not bl[i - 1][2], "two adjacent free blocks were not merged"
        assert cursor == base + fake.live[base]
    used = {addr: size for _, addr, size, free in blocks if not free}
    assert set(used) == set(live)
    for addr, requested in live.items():
        assert used[addr] >= requested
    assert s.bytes_in_use == sum(used.values()) and s.bytes_requested == sum(live.values())
    assert s.bytes_reserved == sum(fake.live.values()) == s.bytes_in_use + s.bytes_cached
    free_sizes = [size for _, _, size, free in blocks if free]
    assert s.largest_free_block == max(free_sizes, default=0) and s.bytes_cached == sum(free_sizes)
    assert 0.0 <= s.fragmentation < 1.0
    assert s.fragmentation == (1 - s.largest_free_block / s.bytes_cached if s.bytes_cached else 0.0)
    assert s.peak_bytes_in_use >= s.bytes_in_use and s.peak_bytes_reserved >= s.bytes_reserved
    assert s.blocks_in_use == len(live) and s.segments == len(fake.live)
    if s.limit is not None:
        assert s.bytes_reserved <= s.limit


SIZES = st.one_of(st.integers(0, 4096), st.integers(4097, MiB + 1024), st.integers(MiB + 1, 24 * MiB))
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "trim"]), SIZES, st.integers(0, 10**6)),
               min_size=1, max_size=60)


@FAST
@given(ops=OPS, limit=st.one_of(st.none(), st.integers(30 * MiB, 120 * MiB)))
def test_pool_invariants_under_random_traffic(ops, limit):
    fake = FakeAllocator()
    pool = MemoryPool(fake, limit=limit)
    live = {}
    for op, size, pick in ops:
        if op == "alloc":
            before = pool.stats()
            try:
                addr = pool.malloc(size)
            except DeviceMemoryError as exc:
                assert limit is not None and f"limit={limit}" in str(exc)
                assert pool.stats().bytes_in_use == before.bytes_in_use
            else:
                assert addr not in live
                live[addr] = size
        elif op == "free" and live:
            addr = sorted(live)[pick % len(live)]
            pool.free(addr)
            del live[addr]
        elif op == "trim":
            pool.trim()
            assert all(not (free and a == base and size == fake.live[base])
                       for base, a, size, free in pool.blocks()), "a wholly free segment survived trim"
        check_pool(pool, fake, live)
    for addr in list(live):
        pool.free(addr)
        del live[addr]
    check_pool(pool, fake, live)
    # Everything freed: each segment is one free block again, and trim gives all of it back.
    assert all(free for *_, free in pool.blocks())
    assert len(pool.blocks()) == len(fake.live)
    reserved = pool.stats().bytes_reserved
    assert pool.trim() == reserved
    assert not fake.live and pool.stats().bytes_reserved == 0


def test_reuse_split_and_size_classes():
    fake = FakeAllocator()
    pool = MemoryPool(fake)
    a = pool.malloc(1000)
    b = pool.malloc(3000)
    assert fake.alloc_calls == 1 and list(fake.live.values()) == [poolmod.SMALL_SEGMENT]  # split, one segment
    assert pool.size_of(a) == 1024 and pool.size_of(b) == 3072 and b == a + 1024
    pool.free(a)
    assert pool.malloc(600) == a  # best fit: the freed 1024-byte block
    assert pool.stats().cache_hits == 2
    big = pool.malloc(3 * MiB)  # large, under 10 MiB: its own 20 MiB segment
    assert fake.live[big] == poolmod.LARGE_SEGMENT
    huge = pool.malloc(24 * MiB + 1)  # does not fit the 17 MiB left: a segment rounded up to 2 MiB
    assert fake.live[huge] == 26 * MiB
    small_after = pool.malloc(512)  # small requests never take from large segments
    segment_of = {addr: base for base, addr, _, _ in pool.blocks()}
    assert fake.live[segment_of[small_after]] == poolmod.SMALL_SEGMENT
    pool.free(big)
    again = pool.malloc(5 * MiB)
    assert again == big and fake.alloc_calls == 3  # the cached large segment is split, not re-reserved


def test_limit_trims_cache_then_raises_and_changes_nothing():
    fake = FakeAllocator()
    pool = MemoryPool(fake, limit=42 * MiB)
    a = pool.malloc(3 * MiB)  # a 20 MiB segment, 17 MiB of it cached
    c = pool.malloc(18 * MiB)  # does not fit the 17: an 18 MiB segment, 38 MiB reserved
    pool.free(c)
    before = pool.stats()
    with pytest.raises(DeviceMemoryError, match=re.escape(f"limit={42 * MiB}")) as info:
        pool.malloc(30 * MiB)  # 20 + 30 > 42 even after trimming the cached 18 MiB segment
    assert str(30 * MiB) in str(info.value)
    after = pool.stats()
    assert (after.bytes_in_use, after.blocks_in_use, after.allocs) == (before.bytes_in_use, before.blocks_in_use, before.allocs)
    assert after.bytes_reserved == 20 * MiB  # the cache was trimmed under pressure
    pool.free(pool.malloc(18 * MiB))  # cached again: 38 MiB reserved
    d = pool.malloc(20 * MiB + 1)  # a 22 MiB segment fits once the cached 18 MiB is trimmed
    assert pool.stats().bytes_reserved == 42 * MiB and pool.stats().segment_frees == 2
    check_pool(pool, fake, {a: 3 * MiB, d: 20 * MiB + 1})
    pool.free(a), pool.free(d)
    pool.limit = 0  # lowering the limit trims what it can
    assert pool.stats().bytes_reserved == 0 and not fake.live


def test_device_out_of_memory_releases_cache_and_retries():
    fake = FakeAllocator(capacity=40 * MiB)
    pool = MemoryPool(fake)
    a = pool.malloc(11 * MiB)  # a 12 MiB segment
    b = pool.malloc(3 * MiB)  # a 20 MiB segment, 17 MiB of it cached
    pool.free(a)
    c = pool.malloc(19 * MiB)  # no cached block fits; 8 MiB free on the device: the cached segment goes
    assert sum(fake.live.values()) == pool.stats().bytes_reserved == 40 * MiB
    assert pool.stats().segment_frees == 1 and fake.alloc_calls == 4  # one failed call, then the retry
    with pytest.raises(DeviceMemoryError, match="nothing cached to release"):
        pool.malloc(19 * MiB)
    check_pool(pool, fake, {b: 3 * MiB, c: 19 * MiB})


def test_bad_arguments():
    pool = MemoryPool(FakeAllocator())
    with pytest.raises(InvalidParameterError, match="nbytes=-1"):
        pool.malloc(-1)
    with pytest.raises(InvalidParameterError, match="was not allocated by this pool"):
        pool.free(12345)
    a = pool.malloc(10)
    pool.free(a)
    with pytest.raises(InvalidParameterError, match="freed twice"):
        pool.free(a)
    with pytest.raises(InvalidParameterError, match="limit=-5"):
        MemoryPool(FakeAllocator(), limit=-5)
    with pytest.raises(InvalidParameterError, match="expected an object with alloc"):
        MemoryPool(object())


def test_release_all_frees_live_segments_too():
    fake = FakeAllocator()
    pool = MemoryPool(fake)
    pool.malloc(100), pool.malloc(5 * MiB)
    pool.release_all()
    assert not fake.live and pool.stats().bytes_in_use == 0 and pool.blocks() == []


# ----------------------------------------------------------------------------- numba EMM wiring


@pytest.mark.skipif(SIM, reason="numba's EMM classes are not part of the simulator")
def test_emm_plugin_allocates_from_the_pool_and_frees_on_release():
    """The manager class numba would use, driven with a fake context and a pool over the fake allocator."""
    from numba import cuda

    cls = poolmod._numba_memory_manager
    assert issubclass(cls, cuda.HostOnlyCUDAMemoryManager)
    assert cls(context=None).interface_version == 1  # what cuda.set_memory_manager checks

    class Ctx:  # numba keeps only a weak proxy of the context
        pass

    ctx = Ctx()
    mgr = cls(context=ctx)
    fake = FakeAllocator()
    mgr.pool = MemoryPool(fake)  # initialize() would put a CudaDriverAllocator here
    mem = mgr.memalloc(1000)
    assert mem.size == 1000 and mem.device_pointer_value == min(fake.live)
    assert mgr.pool.stats().blocks_in_use == 1
    del mem
    gc.collect()
    assert mgr.pool.stats().blocks_in_use == 0 and mgr.pool.stats().bytes_cached == poolmod.SMALL_SEGMENT
    # A context reset frees everything; a pointer dropped afterwards must not free a new block
    # that happens to get the same address.
    stale = mgr.memalloc(2000)
    base = min(fake.live)
    mgr.reset()
    assert not fake.live
    fake.next = base  # the driver hands the same range out again
    fresh_block = mgr.pool.malloc(2000)
    assert fresh_block == stale.device_pointer_value
    del stale
    gc.collect()
    assert mgr.pool.stats().blocks_in_use == 1 and mgr.pool.size_of(fresh_block) == 2048
    # numba prepares a context (calling initialize) more than once: the pool must survive it.
    fresh = cls(context=ctx)
    fresh.initialize()
    first = fresh.pool
    fresh.initialize()
    assert fresh.pool is first and isinstance(first.allocator, poolmod.CudaDriverAllocator)


@pytest.mark.skipif(not SIM, reason="checks the simulator refusal")
def test_install_is_refused_in_the_simulator():
    with pytest.raises(UnsupportedOperationError, match="simulator"):
        poolmod.install()


# ----------------------------------------------------------------------------- buddy


def check_buddy(b: BuddyAllocator, live: dict):
    blocks = b.live_blocks()
    free = b.free_blocks()
    assert [o for o, _ in blocks] == sorted(live)
    tiles = sorted(blocks + free)
    cursor = 0
    for off, size in tiles:  # live and free blocks tile the whole range: no overlap, no hole
        assert off == cursor and size & (size - 1) == 0 and off % size == 0
        cursor += size
    assert cursor == b.capacity
    for off, size in blocks:
        requested, alignment = live[off]
        assert size >= requested and off % alignment == 0
    free_set = set(free)
    for off, size in free:  # coalescing: a free block's buddy is never free at the same size
        if size < b.capacity:
            assert (off ^ size, size) not in free_set
    s = b.stats()
    assert s.allocated_bytes == sum(sz for _, sz in blocks) and s.free_bytes == b.capacity - s.allocated_bytes
    assert s.requested_bytes == sum(r for r, _ in live.values()) and s.allocations == len(live)
    assert s.largest_free_block == max((sz for _, sz in free), default=0)


@FAST
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 70_000), st.sampled_from([1, 64, 4096, 32768]),
                              st.integers(0, 999)), max_size=80))
def test_buddy_invariants(ops):
    b = BuddyAllocator(1 << 20, min_block=256)
    live = {}
    for is_alloc, size, align, pick in ops:
        if is_alloc or not live:
            try:
                off = b.allocate(size, align)
            except DeviceMemoryError:
                continue
            live[off] = (size, align)
        else:
            off = sorted(live)[pick % len(live)]
            b.free(off)
            del live[off]
        check_buddy(b, live)
    for off in list(live):
        b.free(off)
        del live[off]
    assert b.free_blocks() == [(0, b.capacity)]  # fully coalesced


def test_buddy_errors_and_fragmentation():
    b = BuddyAllocator(4096, min_block=256)
    offs = [b.allocate(256) for _ in range(16)]
    for o in offs[::2]:
        b.free(o)
    s = b.stats()
    assert s.free_bytes == 2048 and s.largest_free_block == 256 and s.external_fragmentation == pytest.approx(1 - 256 / 2048)
    with pytest.raises(DeviceMemoryError, match="pieces of at most 256"):
        b.allocate(512)
    with pytest.raises(DeviceMemoryError, match="exceeds the buddy capacity"):
        b.allocate(8192)
    with pytest.raises(InvalidParameterError, match="capacity=1000, expected a power of two"):
        BuddyAllocator(1000)
    with pytest.raises(InvalidParameterError, match="not an allocated block"):
        b.free(offs[0])
    assert b.allocate(100) in offs[::2]
    assert b.stats().internal_fragmentation > 0


# ----------------------------------------------------------------------------- slab


@FAST
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 8192), st.integers(0, 999)), max_size=120))
def test_slab_invariants(ops):
    s = SlabAllocator(capacity=16 * 8192, slab_size=8192, size_classes=(64, 256, 1024, 8192))
    live = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            try:
                off = s.allocate(size)
            except DeviceMemoryError:
                assert len(s.slabs_in_use()) == 16
                continue
            live[off] = size
        else:
            off = sorted(live)[pick % len(live)]
            s.free(off)
            del live[off]
        blocks = s.live_blocks()
        assert [o for o, _ in blocks] == sorted(live)
        for (o1, c1), (o2, _) in zip(blocks, blocks[1:]):
            assert o1 + c1 <= o2  # no overlap
        classes = s.slabs_in_use()
        for off, cls in blocks:
            assert cls == s.size_class(live[off]) and off % cls == 0
            assert classes[off - off % s.slab_size] == cls and off + cls <= s.capacity
        st_ = s.stats()
        assert st_.allocated_bytes == sum(c for _, c in blocks) and st_.requested_bytes == sum(live.values())
        slot_free = sum(s.slab_size - sum(c for o, c in blocks if o - o % s.slab_size == base) for base in classes)
        assert st_.free_bytes == (16 - len(classes)) * s.slab_size + slot_free
    for off in list(live):
        s.free(off)
    assert s.slabs_in_use() == {} and s.stats().free_bytes == s.capacity


def test_slab_errors():
    s = SlabAllocator(capacity=2 * 4096, slab_size=4096, size_classes=(512, 4096))
    with pytest.raises(InvalidParameterError, match="exceeds the largest size class 4096"):
        s.allocate(5000)
    s.allocate(4096), s.allocate(4000)
    with pytest.raises(DeviceMemoryError, match="all 2 slabs in use"):
        s.allocate(10)
    with pytest.raises(InvalidParameterError, match="multiple of slab_size"):
        SlabAllocator(capacity=5000, slab_size=4096)
    with pytest.raises(InvalidParameterError, match="ascending"):
        SlabAllocator(capacity=8192, slab_size=4096, size_classes=(256, 128))


# ----------------------------------------------------------------------------- arena


@FAST
@given(sizes=st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([None, 1, 16, 1024])), max_size=40),
       cut=st.integers(0, 40))
def test_arena_invariants(sizes, cut):
    a = ArenaAllocator(64 * 1024, alignment=256)
    placed = []
    for size, align in sizes:
        try:
            off = a.allocate(size, align)
        except DeviceMemoryError:
            assert a.stats().free_bytes < size + (align or 256)
            continue
        assert off % (align or 256) == 0 and (not placed or off >= placed[-1][0] + placed[-1][1])
        placed.append((off, size))
    assert a.live_blocks() == placed
    s = a.stats()
    assert s.requested_bytes == sum(sz for _, sz in placed) and s.external_fragmentation == 0.0
    assert s.allocated_bytes == (placed[-1][0] + placed[-1][1] if placed else 0)
    mark = min(cut, a.mark())
    a.release(mark)
    assert a.live_blocks() == placed[:mark]
    if mark < len(placed):  # the next allocation reuses the released space
        assert a.allocate(placed[mark][1], 1) <= placed[mark][0]
    a.reset()
    assert a.live_blocks() == [] and a.stats().allocated_bytes == 0


def test_arena_errors():
    a = ArenaAllocator(1024)
    with pytest.raises(InvalidParameterError, match="does not free single blocks"):
        a.free(a.allocate(10))
    with pytest.raises(DeviceMemoryError, match="arena full"):
        a.allocate(1000)
    with pytest.raises(InvalidParameterError, match="mark=5"):
        a.release(5)


# ----------------------------------------------------------------------------- defragmentation


@st.composite
def layouts(draw):
    align = draw(st.sampled_from([1, 8, 64]))
    capacity = 1 << 14
    n = draw(st.integers(0, 25))
    cursor, blocks = 0, {}
    for i in range(n):
        gap = draw(st.integers(0, 300))
        off = -(-(cursor + gap) // align) * align
        size = draw(st.integers(0, 400))
        if off + size > capacity:
            break
        blocks[f"b{i}"] = (off, size)
        cursor = off + size
    pinned = draw(st.sets(st.sampled_from(sorted(blocks)), max_size=3)) if blocks else set()
    return blocks, capacity, align, pinned


@FAST
@given(layout=layouts(), seed=st.integers(0, 2**31))
def test_defragmentation_plan_preserves_data_and_compacts(layout, seed):
    blocks, capacity, align, pinned = layout
    plan = plan_defragmentation(blocks, capacity, align, pinned)
    memory = np.random.default_rng(seed).integers(0, 256, capacity, dtype=np.uint8)
    contents = {k: memory[o : o + s].copy() for k, (o, s) in blocks.items()}
    # Moving in order: each move's destination overlaps no block that is still at its old place.
    where = dict((k, o) for k, (o, _) in blocks.items())
    for m in plan.moves:
        assert m.destination < m.source and m.key not in pinned
        for k, o in where.items():
            if k != m.key and blocks[k][1]:
                assert m.destination + m.size <= o or o + blocks[k][1] <= m.destination
        where[m.key] = m.destination
    plan.apply(memory)
    for k, (o, s) in blocks.items():
        new = plan.placement[k]
        assert new % align == 0 or k in pinned
        assert np.array_equal(memory[new : new + s], contents[k]), k
    assert all(plan.placement[k] == blocks[k][0] for k in pinned)
    placed = sorted((plan.placement[k], s) for k, (_, s) in blocks.items())
    for (o1, s1), (o2, _) in zip(placed, placed[1:]):
        assert o1 + s1 <= o2
    assert plan.bytes_moved == sum(m.size for m in plan.moves)
    assert plan.largest_free_after >= plan.largest_free_before
    if not pinned:
        # Everything slid to the bottom: only alignment padding is left between blocks.
        cursor = 0
        for o, s in placed:
            assert o == -(-cursor // align) * align
            cursor = o + s
        if align == 1:
            assert plan.fragmentation_after == 0.0


def test_defragmentation_rejects_bad_layouts():
    with pytest.raises(InvalidParameterError, match="overlap"):
        plan_defragmentation({"a": (0, 100), "b": (50, 10)}, 1000)
    with pytest.raises(InvalidParameterError, match="not aligned to 64"):
        plan_defragmentation({"a": (10, 100)}, 1000, alignment=64)
    with pytest.raises(InvalidParameterError, match="within capacity 100"):
        plan_defragmentation({"a": (50, 60)}, 100)
    with pytest.raises(InvalidParameterError, match="are not among the blocks"):
        plan_defragmentation({"a": (0, 10)}, 100, pinned=["z"])
    f, largest = fragmentation([(0, 10), (20, 10)], 40)
    assert largest == 10 and f == pytest.approx(0.5)


# ----------------------------------------------------------------------------- eviction


class ModelLRU:
    """A textbook LRU cache of unit-size entries, to compare ResidencyManager against."""

    def __init__(self, capacity):
        self.capacity, self.entries = capacity, OrderedDict()

    def access(self, key):
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        evicted = []
        while len(self.entries) >= self.capacity:
            evicted.append(self.entries.popitem(last=False)[0])
        self.entries[key] = None
        return evicted


@FAST
@given(trace=st.lists(st.integers(0, 12), max_size=200), capacity=st.integers(1, 8))
def test_lru_matches_textbook_model(trace, capacity):
    mgr, model = ResidencyManager(capacity, "lru"), ModelLRU(capacity)
    for key in trace:
        assert mgr.access(key, 1) == model.access(key)
        assert set(mgr.resident) == set(model.entries) and mgr.used <= capacity


@FAST
@given(trace=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 40)), max_size=150),
       policy=st.sampled_from(sorted(POLICIES)), pin=st.integers(0, 15))
def test_residency_invariants_every_policy(trace, policy, pin):
    mgr = ResidencyManager(100, policy)
    sizes = {}
    for key, size in trace:
        size = sizes.setdefault(key, size)
        pinned_before = set(mgr._pinned)
        try:
            evicted = mgr.access(key, size)
        except DeviceMemoryError:
            continue
        assert not (set(evicted) & pinned_before) and key in mgr and mgr.used <= 100
        assert mgr.used == sum(mgr.resident.values())
        if key == pin:
            mgr.pin(key)


def test_policy_orders():
    for cls, expected in ((LRUPolicy, ["b", "c", "a"]), (FIFOPolicy, ["a", "b", "c"]),
                          (LFUPolicy, ["b", "c", "a"]), (LargestFirstPolicy, ["c", "b", "a"])):
        p = cls()
        for k, size in (("a", 1), ("b", 2), ("c", 3)):
            p.inserted(k, size)
        p.accessed("a")
        assert p.order() == expected, cls.__name__
        assert p.victims(3) == expected[: 1 + (p._sizes[expected[0]] < 3)]
    lfu = LFUPolicy()
    for k in "xyz":
        lfu.inserted(k, 1)
    lfu.accessed("x"), lfu.accessed("x"), lfu.accessed("y")
    assert lfu.order() == ["z", "y", "x"]
    mgr = ResidencyManager(10, "lru")
    mgr.access("a", 6)
    mgr.pin("a")
    with pytest.raises(DeviceMemoryError, match="6 pinned"):
        mgr.access("b", 5)
    assert set(mgr.resident) == {"a"}
    with pytest.raises(InvalidParameterError, match="policy='mru'"):
        ResidencyManager(10, "mru")


def test_docs_examples_run():
    """Every python block of docs/memory.md runs."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, "docs/memory.md", "exec"), {})
