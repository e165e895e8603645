"""The occupancy calculator against independently derived expectations.

Expected numbers come from NVIDIA's documents (the CUDA C++ Best Practices Guide's worked example,
device reports of real GPUs) or are worked out by hand in the comments from the documented rules
(registers per warp rounded to 256 inside four sub-partitions, shared memory plus the 1 KiB
reservation rounded to 128 B, carveout configurations). Properties that must hold for every input
are checked with hypothesis, and optimal_block_size against a brute-force search.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optirs.analysis import occupancy as occ
from optirs.tools import occupancy_cli
from optirs.analysis.occupancy import (KNOWN_COMPUTE_CAPABILITIES, UNLIMITED, KernelResourceUsage, OccupancyLimiter,
                                       SmResourceLimits, calculate_occupancy, optimal_block_size)
from optirs.core.errors import InvalidParameterError

KiB = 1024
L = SmResourceLimits.for_compute_capability


def blocks(cc, regs, block, dynamic=0, static=0, **kw):
    usage = KernelResourceUsage(registers_per_thread=regs, static_shared_mem=static,
                                max_dynamic_shared_mem=kw.pop("max_dynamic", None))
    return calculate_occupancy(L(cc), usage, block, dynamic, **kw)


# ---------------------------------------------------------------- the table against published facts


def test_every_compute_capability_of_the_issue_is_known():
    wanted = {(5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9),
              (9, 0), (10, 0), (12, 0)}
    assert wanted <= set(KNOWN_COMPUTE_CAPABILITIES)


@pytest.mark.parametrize("cc, threads, smem_sm, smem_block, regs_block", [
    # deviceQuery of a Tesla T4 (7.5), a Jetson Orin (8.7); an H100 (228 KiB = 233472 B per SM).
    ("7.5", 1024, 65536, 49152, 65536),
    ("8.7", 1536, 167936, 49152, 65536),
    ("9.0", 2048, 233472, 49152, 65536),
])
def test_table_matches_device_reports(cc, threads, smem_sm, smem_block, regs_block):
    limits = L(cc)
    assert limits.max_threads_per_sm == threads
    assert limits.shared_mem_per_sm == smem_sm
    assert limits.shared_mem_per_block == smem_block
    assert limits.registers_per_block == regs_block
    assert limits.warp_size == 32 and limits.max_threads_per_block == 1024


@pytest.mark.parametrize("cc, optin", [("7.0", 96), ("7.5", 64), ("8.0", 163), ("8.6", 99), ("8.9", 99), ("9.0", 227),
                                       ("10.0", 227), ("12.0", 99)])
def test_opt_in_shared_memory_per_block(cc, optin):
    # Programming Guide: the opt-in maximum is the largest carveout less the 1 KiB reserved per block (8.0 on).
    limits = L(cc)
    assert limits.shared_mem_per_block_optin == optin * KiB
    assert limits.shared_mem_per_block_optin + limits.reserved_shared_mem_per_block == limits.shared_mem_configs[-1]


def test_reserved_shared_memory_starts_with_ampere():
    for cc in KNOWN_COMPUTE_CAPABILITIES:
        assert L(cc).reserved_shared_mem_per_block == (1 * KiB if cc[0] >= 8 else 0), cc


# ---------------------------------------------------------------- worked examples


@pytest.mark.parametrize("block, expected_blocks, expected_occupancy", [(128, 12, 0.75), (320, 4, 0.625)])
def test_best_practices_guide_register_granularity_example(block, expected_blocks, expected_occupancy):
    # CUDA C++ Best Practices Guide, "Occupancy": on CC 7.0, 37 registers per thread give 75%
    # occupancy with 12 blocks of 128 threads, and 63% with 4 blocks of 320 threads.
    r = blocks("7.0", 37, block)
    assert r.active_blocks_per_sm == expected_blocks
    assert r.occupancy == pytest.approx(expected_occupancy)
    assert OccupancyLimiter.REGISTERS in r.limiter


def test_registers_are_allocated_per_sub_partition():
    # 128 regs x 32 threads = 4096 per warp; 16384 registers per sub-partition hold 4 warps, so 16
    # warps per SM: 8 blocks of 64 threads (a whole-SM division would also say 16 warps, but 40 regs
    # shows the difference below).
    assert blocks("9.0", 128, 64).active_blocks_per_sm == 8
    # 40 regs -> 1280 per warp; 16384 // 1280 = 12 warps per sub-partition = 48 warps, not 65536 // 1280 = 51.
    r = blocks("9.0", 40, 32)
    assert r.block_limits["registers"] == 48
    assert r.active_blocks_per_sm == 32  # the block limit binds first
    assert blocks("9.0", 40, 1024).active_blocks_per_sm == 1  # 48 warps hold one 32-warp block


def test_hardware_register_check_rounds_warps_to_sub_partitions():
    # 255 regs round to 8192 per warp: 8 warps use the whole 64K file, 9 warps do not fit.
    assert blocks("9.0", 255, 256).active_blocks_per_sm == 1
    r = blocks("9.0", 255, 288)
    assert r.active_blocks_per_sm == 0
    assert "registers" in r.reason and "9 warps" in r.reason
    # Where a block may use fewer registers than the SM has (Tegra X1: 32K of 64K), the hardware
    # check, which rounds a block's warps up to the 4 sub-partitions, refuses blocks that fit
    # otherwise: 144 regs = 4608 per warp; 7 warps need 32256 <= 32768, but are checked as 8 warps
    # (36864). The SM itself would hold 4 x (16384 // 4608) = 12 warps.
    r = blocks("5.3", 144, 7 * 32)
    assert r.active_blocks_per_sm == 0 and "4 sub-partitions" in r.reason
    assert blocks("5.2", 144, 7 * 32).active_blocks_per_sm == 1  # 64K per block: it fits


def test_gp100_refuses_what_other_pascal_gpus_cannot_run():
    # GP100 has 2 register sub-partitions: its own check of a 13-warp block of 144-register threads
    # rounds to 14 warps (64512 registers, fits); the other Pascal GPUs round to 16 (73728, does not),
    # and CUDA keeps Pascal code portable by refusing it on GP100 too.
    assert blocks("6.0", 144, 13 * 32).active_blocks_per_sm == 0
    assert "Pascal" in blocks("6.0", 144, 13 * 32).reason
    assert blocks("6.0", 144, 12 * 32).active_blocks_per_sm == 1  # 12 warps: a multiple of 4, fits both


def test_too_many_registers_per_thread():
    r = blocks("6.1", 256, 32)
    assert r.active_blocks_per_sm == 0 and "256" in r.reason and "255" in r.reason


def test_shared_memory_with_reservation_and_granularity():
    # Hopper: 32 KiB dynamic + 1 KiB reserved = 33 KiB per block; 228 KiB hold 6 of them.
    r = blocks("9.0", 32, 256, dynamic=32 * KiB)
    assert r.block_limits["shared_memory"] == 6
    assert r.allocated_shared_mem_per_block == 33 * KiB
    assert r.active_blocks_per_sm == 6 and r.limiter == OccupancyLimiter.SHARED_MEMORY
    # One byte of dynamic memory: 1025 B rounds up to 1152 (128 B units) on Ampere.
    assert blocks("8.0", 32, 32, dynamic=1).allocated_shared_mem_per_block == 1152
    # Volta: no reservation, 256 B units: 1 B static -> 256 B.
    assert blocks("7.0", 32, 32, static=1).allocated_shared_mem_per_block == 256


def test_carveout_preference():
    # No preference: the whole 228 KiB. A preference of 50% asks for 114 KiB, rounded up to the
    # 132 KiB configuration: four 33 KiB blocks.
    assert blocks("9.0", 32, 64, dynamic=32 * KiB, carveout=50).active_blocks_per_sm == 4
    assert blocks("9.0", 32, 64, dynamic=32 * KiB, carveout=50).shared_mem_per_sm == 132 * KiB
    # Maximum L1 (0%) holds no block, so the smallest configuration that holds one is taken:
    # 33 KiB -> the 64 KiB configuration, one block.
    r = blocks("9.0", 32, 64, dynamic=32 * KiB, carveout=0)
    assert r.shared_mem_per_sm == 64 * KiB and r.active_blocks_per_sm == 1
    # Even a kernel with no shared memory of its own has the 1 KiB reservation: 8 KiB config -> 8 blocks.
    assert blocks("9.0", 32, 64, carveout=0).block_limits["shared_memory"] == 8
    # Turing's smallest configuration is 32 KiB.
    assert blocks("7.5", 32, 64, carveout=0).shared_mem_per_sm == 32 * KiB
    # Maxwell and Pascal have fixed shared memory: the preference changes nothing.
    assert blocks("6.1", 32, 64, static=8 * KiB, carveout=0).block_limits["shared_memory"] == 96 // 8


def test_large_shared_memory_needs_opt_in():
    r = blocks("9.0", 32, 128, dynamic=100 * KiB)
    assert r.active_blocks_per_sm == 0 and "MAX_DYNAMIC_SHARED_SIZE_BYTES" in r.reason
    # Opted in: 101 KiB per block, 228 KiB hold two.
    assert blocks("9.0", 32, 128, dynamic=100 * KiB, max_dynamic=227 * KiB).active_blocks_per_sm == 2
    # The opt-in ceiling is 227 KiB + 1 KiB reserved.
    assert blocks("9.0", 32, 128, dynamic=227 * KiB, max_dynamic=227 * KiB).active_blocks_per_sm == 1
    over = blocks("9.0", 32, 128, static=16, dynamic=227 * KiB, max_dynamic=227 * KiB)
    assert over.active_blocks_per_sm == 0 and "shared memory" in over.reason
    # Maxwell cannot opt in beyond 48 KiB.
    assert blocks("5.2", 32, 128, dynamic=49 * KiB, max_dynamic=96 * KiB).active_blocks_per_sm == 0


def test_block_and_warp_limits_per_compute_capability():
    # One-warp blocks are held by the per-SM block limit: 32 (8.0), 16 (7.5, 8.6), 24 (8.9, 12.0).
    for cc, n in (("8.0", 32), ("7.5", 16), ("8.6", 16), ("8.9", 24), ("12.0", 24), ("9.0", 32)):
        r = blocks(cc, 16, 32)
        assert r.active_blocks_per_sm == n and OccupancyLimiter.BLOCKS in r.limiter, cc
    # 1024-thread blocks: 2 on 2048-thread SMs, 1 on 1536- and 1024-thread SMs.
    for cc, n in (("9.0", 2), ("8.6", 1), ("7.5", 1)):
        assert blocks(cc, 16, 1024).active_blocks_per_sm == n, cc
    r = blocks("9.0", 16, 1056)
    assert r.active_blocks_per_sm == 0 and "1024" in r.reason and r.limiter == OccupancyLimiter.WARPS


def test_partitioned_global_caching_confines_a_block_to_half_an_sm():
    # 20-warp blocks on CC 5.2: off -> 64 // 20 = 3; on -> each half SM (32 warps) holds one -> 2.
    assert blocks("5.2", 16, 640).active_blocks_per_sm == 3
    on = blocks("5.2", 16, 640, partitioned_caching="on")
    assert on.active_blocks_per_sm == 2 and on.partitioned_caching
    # 128 regs = 4096 per warp, 4 warps per sub-partition, 8 per half SM: a 10-warp block fits only
    # across halves, so "on" drops caching and "strict" keeps it and runs nothing.
    assert not blocks("5.2", 128, 320, partitioned_caching="on").partitioned_caching
    assert blocks("5.2", 128, 320, partitioned_caching="on").active_blocks_per_sm == 1
    assert blocks("5.2", 128, 320, partitioned_caching="strict").active_blocks_per_sm == 0
    # Not supported on 5.0, 6.0 or Volta on: ignored there.
    assert not blocks("9.0", 16, 640, partitioned_caching="strict").partitioned_caching


def test_block_barriers_from_hopper():
    usage = KernelResourceUsage(16, block_barriers=3)
    # Hopper has 2 barrier slots per resident block slot: 32 x 2 // 3 = 21 blocks.
    r = calculate_occupancy(L("9.0"), usage, 32)
    assert r.block_limits["barriers"] == 21 and r.active_blocks_per_sm == 21
    assert r.limiter == OccupancyLimiter.BARRIERS
    # Not counted before Hopper.
    assert calculate_occupancy(L("8.0"), usage, 32).active_blocks_per_sm == 32


def test_kernel_without_registers_or_shared_memory_is_unlimited_by_them():
    r = calculate_occupancy(L("5.0"), KernelResourceUsage(0), 64)
    assert r.block_limits["registers"] == UNLIMITED and r.block_limits["shared_memory"] == UNLIMITED
    assert r.active_blocks_per_sm == 32


# ---------------------------------------------------------------- optimal block size


def test_optimal_block_size_known_cases():
    h100 = L("9.0", sm_count=132)
    # 32 registers: 1024-thread blocks already fill the SM (2 x 32 warps); larger wins ties.
    s = optimal_block_size(h100, KernelResourceUsage(32))
    assert (s.block_size, s.blocks_per_sm, s.min_grid_size, s.occupancy) == (1024, 2, 264, 1.0)
    # 255 registers: only 8 warps fit; 256-thread blocks are the largest that do.
    s = optimal_block_size(h100, KernelResourceUsage(255))
    assert (s.block_size, s.blocks_per_sm, s.min_grid_size) == (256, 1, 132)
    # A limit that is not a warp multiple is tried as is: with 200 KiB of shared memory per block
    # one block fits whatever its size, so the largest allowed, 1000, wins.
    big = KernelResourceUsage(32, max_dynamic_shared_mem=227 * KiB)
    s = optimal_block_size(h100, big, 200 * KiB, block_size_limit=1000)
    assert (s.block_size, s.blocks_per_sm) == (1000, 1)
    # 32 registers and a 1000-thread limit: 2 x 1000 threads lose to 4 x 512, which fill the SM.
    s = optimal_block_size(h100, KernelResourceUsage(32), block_size_limit=1000)
    assert (s.block_size, s.blocks_per_sm) == (512, 4)
    # Without an SM count there is no minimum grid.
    assert optimal_block_size(L("9.0"), KernelResourceUsage(32)).min_grid_size is None


def test_optimal_block_size_nothing_runs():
    s = optimal_block_size(L("9.0"), KernelResourceUsage(32), dynamic_smem=300 * KiB)
    assert s.block_size == 0 and s.blocks_per_sm == 0 and s.occupancy == 0


def brute_force(limits, usage, smem_for, block_size_limit=0, carveout=-1):
    """Every candidate block size, best resident threads, ties to the larger block."""
    top = min(block_size_limit or limits.max_threads_per_block, limits.max_threads_per_block,
              usage.max_threads_per_block or limits.max_threads_per_block)
    candidates = sorted({top} | set(range(limits.warp_size, top + 1, limits.warp_size)))
    best = (0, 0)  # (threads, block)
    for b in candidates:
        n = calculate_occupancy(limits, usage, b, smem_for(b), carveout=carveout).active_blocks_per_sm
        best = max(best, (b * n, b if n else 0))
    return best


ccs = st.sampled_from(KNOWN_COMPUTE_CAPABILITIES)
usages = st.builds(KernelResourceUsage,
                   registers_per_thread=st.integers(0, 256),
                   static_shared_mem=st.integers(0, 48 * KiB),
                   max_threads_per_block=st.one_of(st.none(), st.integers(1, 1024)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cc=ccs, usage=usages, smem=st.integers(0, 64 * KiB), limit=st.integers(0, 1100))
def test_optimal_block_size_matches_brute_force(cc, usage, smem, limit):
    limits = L(cc, sm_count=7)
    s = optimal_block_size(limits, usage, smem, block_size_limit=limit)
    threads, block = brute_force(limits, usage, lambda b: smem, limit)
    assert s.block_size * s.blocks_per_sm == threads
    assert s.block_size == block
    assert s.min_grid_size == s.blocks_per_sm * 7


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cc=ccs, regs=st.integers(0, 255), per_thread=st.integers(0, 64))
def test_optimal_block_size_with_block_dependent_shared_memory(cc, regs, per_thread):
    limits = L(cc)
    usage = KernelResourceUsage(regs)
    smem_for = lambda b: b * per_thread  # noqa: E731  (e.g. one float2 per thread)
    s = optimal_block_size(limits, usage, smem_for)
    threads, block = brute_force(limits, usage, smem_for)
    assert (s.block_size * s.blocks_per_sm, s.block_size) == (threads, block)


# The H200's own answers (benchmarks/results/h200-occupancy-run1.json: driver 580.159.04, CUDA 13.0,
# 132 SMs), measured with cuOccupancyMaxPotentialBlockSize on numba.cuda kernels of 16 registers and
# no static shared memory: the real driver, so an independent reference. "dynamic" is bytes, or
# bytes per thread ("4*block") for the block-size-dependent query; limit 0 means none.
# (kernel's MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic, carveout, limit) -> (min grid, block)
H200_DRIVER_ANSWERS = [
    (48 * KiB, 4096, -1, 96, (4224, 64)),
    (48 * KiB, 0, 0, 96, (1056, 96)),
    (48 * KiB, 48128, 0, 0, (132, 1024)),
    (48 * KiB, "4*block", 0, 0, (264, 768)),
    # A preference of 25, 50 or 75 is searched as if there were none (the first run's 50 mismatches).
    (48 * KiB, 4096, 25, 96, (4224, 64)),
    (48 * KiB, 48128, 25, 0, (264, 1024)),
    (48 * KiB, 20480, 25, 1000, (528, 512)),
    (48 * KiB, "48*block", 25, 0, (264, 1024)),
    (48 * KiB, 33792, 75, 256, (792, 256)),
    (227 * KiB, 65536, 50, 1000, (396, 672)),
    (227 * KiB, 115712, 50, 0, (264, 1024)),
    (227 * KiB, 65536, 0, 96, (132, 96)),
    (227 * KiB, 232449, 50, 0, (0, 0)),
]


@pytest.mark.parametrize("max_dynamic, dynamic, carveout, limit, expected", H200_DRIVER_ANSWERS)
def test_optimal_block_size_reproduces_the_h200_driver(max_dynamic, dynamic, carveout, limit, expected):
    h200 = L("9.0", sm_count=132)  # the run found the table entry identical to the H200's attributes
    usage = KernelResourceUsage(16, 0, max_threads_per_block=1024, max_dynamic_shared_mem=max_dynamic)
    smem = (lambda b, k=int(dynamic.split("*")[0]): k * b) if isinstance(dynamic, str) else dynamic
    s = optimal_block_size(h200, usage, smem, limit, carveout=carveout)
    assert (s.min_grid_size, s.block_size) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cc=ccs, usage=usages, smem=st.integers(0, 64 * KiB), limit=st.integers(0, 1100), carveout=st.integers(-1, 100))
def test_driver_and_runtime_block_size_searches_and_the_carveout(cc, usage, smem, limit, carveout):
    limits = L(cc, sm_count=7)
    runtime = optimal_block_size(limits, usage, smem, limit, carveout=carveout, api="runtime")
    driver = optimal_block_size(limits, usage, smem, limit, carveout=carveout, api="driver")
    # The runtime's template asks the active-block query for every size: the carveout counts.
    threads, block = brute_force(limits, usage, lambda b: smem, limit, carveout=carveout)
    assert (runtime.block_size * runtime.blocks_per_sm, runtime.block_size) == (threads, block)
    # The driver's search keeps a preference of 0 and drops any other.
    kept = carveout if carveout == 0 else -1
    assert driver == optimal_block_size(limits, usage, smem, limit, carveout=kept, api="runtime")


# ---------------------------------------------------------------- invariants


@settings(max_examples=300, deadline=None)
@given(cc=ccs, usage=usages, block=st.integers(1, 1100), dynamic=st.integers(0, 240 * KiB),
       carveout=st.integers(-1, 100), opt_in=st.booleans())
def test_invariants(cc, usage, block, dynamic, carveout, opt_in):
    limits = L(cc)
    if opt_in:
        usage = KernelResourceUsage(usage.registers_per_thread, usage.static_shared_mem,
                                    max_dynamic_shared_mem=max(0, limits.shared_mem_per_block_optin - usage.static_shared_mem))
    r = calculate_occupancy(limits, usage, block, dynamic, carveout=carveout)
    n = r.active_blocks_per_sm
    # The count is the tightest per-resource count, and the limiter names exactly the ties.
    assert n == min(r.block_limits.values())
    assert {k for k, v in r.block_limits.items() if v == n} == set(r.limiter.names())
    # Never above any hardware limit.
    assert 0 <= n <= limits.max_blocks_per_sm
    assert r.active_warps_per_sm == n * math.ceil(block / 32) <= limits.max_warps_per_sm
    assert n * r.allocated_registers_per_block <= limits.registers_per_sm
    assert n * r.allocated_shared_mem_per_block <= r.shared_mem_per_sm <= limits.shared_mem_per_sm
    assert 0.0 <= r.occupancy <= 1.0
    # Zero blocks always come with a reason, and only then.
    assert (n == 0) == bool(r.reason)
    if block > limits.max_threads_per_block or usage.registers_per_thread > limits.max_registers_per_thread:
        assert n == 0
    # Only whole warps count: any block size of the same warp count has the same occupancy.
    if block <= limits.max_threads_per_block:
        same = calculate_occupancy(limits, usage, math.ceil(block / 32) * 32, dynamic, carveout=carveout)
        assert same.active_blocks_per_sm == n


@settings(max_examples=200, deadline=None)
@given(cc=ccs, regs=st.integers(0, 255), extra_regs=st.integers(0, 64), block=st.integers(1, 1024),
       dynamic=st.integers(0, 48 * KiB), extra_smem=st.integers(0, 16 * KiB), carveout=st.integers(-1, 100))
def test_monotonic_in_registers_and_shared_memory(cc, regs, extra_regs, block, dynamic, extra_smem, carveout):
    limits = L(cc)
    opted = lambda r, s: KernelResourceUsage(r, s, max_dynamic_shared_mem=limits.shared_mem_per_block_optin)  # noqa: E731
    base = calculate_occupancy(limits, opted(regs, 0), block, dynamic, carveout=carveout).active_blocks_per_sm
    more_regs = calculate_occupancy(limits, opted(regs + extra_regs, 0), block, dynamic, carveout=carveout)
    more_dynamic = calculate_occupancy(limits, opted(regs, 0), block, dynamic + extra_smem, carveout=carveout)
    more_static = calculate_occupancy(limits, opted(regs, extra_smem), block, dynamic, carveout=carveout)
    assert more_regs.active_blocks_per_sm <= base
    assert more_dynamic.active_blocks_per_sm <= base
    assert more_static.active_blocks_per_sm <= base


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, words", [
    (lambda: blocks("9.0", 32, 0), ["block_size=0"]),
    (lambda: blocks("9.0", 32, 64, dynamic=-1), ["dynamic_smem=-1"]),
    (lambda: blocks("9.0", 32, 64, carveout=101), ["carveout=101", "100"]),
    (lambda: blocks("9.0", 32, 64, partitioned_caching="maybe"), ["maybe", "strict"]),
    (lambda: KernelResourceUsage(-3), ["registers_per_thread=-3"]),
    (lambda: KernelResourceUsage(32, static_shared_mem=1.5), ["static_shared_mem=1.5"]),
    (lambda: L("4.0"), ["4.0", "9.0"]),
    (lambda: L("nine"), ["nine", "major.minor"]),
    (lambda: optimal_block_size(L("9.0"), KernelResourceUsage(32), lambda b: -1), ["returned=-1"]),
    (lambda: optimal_block_size(L("9.0"), KernelResourceUsage(32), block_size_limit=-5), ["block_size_limit=-5"]),
    (lambda: optimal_block_size(L("9.0"), KernelResourceUsage(32), carveout=101), ["carveout=101", "100"]),
    (lambda: optimal_block_size(L("9.0"), KernelResourceUsage(32), api="cuda"), ["api='cuda'", "driver", "runtime"]),
    (lambda: calculate_occupancy("9.0", KernelResourceUsage(32), 64), ["limits="]),
])
def test_bad_input_raises_with_the_value(call, words):
    with pytest.raises(InvalidParameterError) as info:
        call()
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- live device attributes (stub device)


class FakeDevice:
    """Answers attributes the way numba's Device does (CU_DEVICE_ATTRIBUTE_<NAME>), here an H100's."""

    compute_capability = (9, 0)
    name = b"NVIDIA H100 80GB HBM3"
    id = 0
    WARP_SIZE = 32
    MAX_THREADS_PER_BLOCK = 1024
    MAX_THREADS_PER_MULTIPROCESSOR = 2048
    MAX_BLOCKS_PER_MULTIPROCESSOR = 32
    MAX_REGISTERS_PER_MULTIPROCESSOR = 65536
    MAX_REGISTERS_PER_BLOCK = 65536
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 233472
    MAX_SHARED_MEMORY_PER_BLOCK = 49152
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 232448
    RESERVED_SHARED_MEMORY_PER_BLOCK = 1024
    MULTIPROCESSOR_COUNT = 132


def test_from_device_reads_attributes():
    limits = SmResourceLimits.from_device(FakeDevice())
    assert limits.sm_count == 132 and limits.name == "NVIDIA H100 80GB HBM3"
    assert limits.shared_mem_per_sm == 233472 and limits.shared_mem_per_block_optin == 232448
    assert limits.shared_mem_alloc_unit == 128 and limits.sub_partitions == 4
    # An unlisted minor version takes the allocation rules of its major version's entry.
    class Cc121(FakeDevice):
        compute_capability = (12, 1)
        MAX_THREADS_PER_MULTIPROCESSOR = 1536
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 102400
    other = SmResourceLimits.from_device(Cc121())
    assert other.compute_capability == (12, 1) and "12.0" in other.source
    with pytest.raises(InvalidParameterError):
        SmResourceLimits.from_device(type("Old", (FakeDevice,), {"compute_capability": (3, 5)})())


# ---------------------------------------------------------------- plugin and command


def test_plugin_is_registered_as_analysis():
    import optirs
    status = {p.name: p for p in optirs.list_plugins()}
    assert status["occupancy"].kind == "analysis" and status["occupancy"].summary


def test_launch_config_hook_covers_the_elements():
    from optirs.plugin.registry import REGISTRY
    usage = KernelResourceUsage(255)
    grid, block = REGISTRY.launch_config(kernel=usage, device=(9, 0), elements=10_000)
    _, best_block = brute_force(L("9.0"), usage, lambda b: 0)
    assert block == best_block
    assert grid == math.ceil(10_000 / block)
    assert REGISTRY.launch_config(kernel=usage, device=(9, 0), elements=0) == (1, block)


def test_launch_config_defers_when_it_cannot_tell():
    from numba import cuda

    def body(a):
        a[0] = 1

    lazy = cuda.jit(body)  # a dispatcher with no compiled signature
    assert occ.plugin.optirs_launch_config(lazy, (9, 0), 100) is None
    assert occ.plugin.optirs_launch_config(KernelResourceUsage(32), (4, 0), 100) is None  # unknown device
    assert occ.plugin.optirs_launch_config(KernelResourceUsage(32, max_dynamic_shared_mem=0), "9.0", 100) is not None


def test_command_prints_tables_and_plots(tmp_path, capsys):
    png = tmp_path / "occ.png"
    assert occupancy_cli.main(["--cc", "7.0", "--registers", "37", "--block-size", "320", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "SM limits" in out and "Occupancy" in out and "62.5%" in out  # the Best Practices example
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert occupancy_cli.main(["--cc", "3.5"]) == 2
    assert "3.5" in capsys.readouterr().out


def test_docs_example_runs():
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "docs" / "occupancy.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/occupancy.md", "exec"), scope)
    # The Best Practices Guide's example: 37 registers, 320-thread blocks -> 4 blocks (62.5%).
    assert scope["r"].active_blocks_per_sm == 4
    assert scope["best"].block_size * scope["best"].min_grid_size > 0


def test_from_device_of_a_larger_part_extends_the_carveouts():
    # A CC 10.x part with 328 KiB per SM (cuda_occupancy.h's 10.7 has that configuration) and one
    # barrier slot per block (10.x with minor != 0).
    class Cc107(FakeDevice):
        compute_capability = (10, 7)
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 328 * KiB
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 327 * KiB
    limits = SmResourceLimits.from_device(Cc107())
    assert limits.shared_mem_configs[-2:] == (228 * KiB, 328 * KiB)
    assert limits.barrier_slots_per_block == 1
    # 200 KiB + 1 KiB per block fits once, in the 328 KiB configuration.
    r = calculate_occupancy(limits, KernelResourceUsage(32, max_dynamic_shared_mem=327 * KiB), 128, 200 * KiB)
    assert r.active_blocks_per_sm == 1 and r.shared_mem_per_sm == 328 * KiB
