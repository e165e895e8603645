"""The CUDA occupancy calculator: how many blocks of a kernel fit on one SM, and which block size to launch.

:func:`calculate_occupancy` answers what ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` answers and
:func:`optimal_block_size` what ``cuOccupancyMaxPotentialBlockSize`` answers (or, with
``api="runtime"``, the runtime's ``cudaOccupancyMaxPotentialBlockSize``; they differ only for a
carveout preference other than 0), on the CPU, for any compute capability from 5.0 to 12.0,
following the rules of NVIDIA's ``cuda_occupancy.h`` (CUDA 13):

- registers are allocated per warp, rounded up to 256, inside each of the SM's sub-partitions (so the
  register file holds ``sub_partitions * floor(regs_per_sm / sub_partitions / regs_per_warp)`` warps);
  a block is refused when its registers exceed the per-block file (checked twice, as the hardware does:
  once with its warps rounded up to the sub-partition count);
- shared memory is the kernel's static plus dynamic bytes plus the driver's per-block reservation
  (1 KiB from CC 8.0), rounded up to the allocation unit; the per-SM amount is the carveout the kernel
  prefers, rounded up to a configuration the SM has, or grown to the smallest configuration that holds
  one block when the preference holds none (Volta and later);
- the per-SM block and warp limits of the compute capability, and on Hopper and later the block-barrier
  slots.

A configuration that cannot run reports 0 active blocks and says why (``OccupancyResult.reason``);
malformed input (negative sizes, an unknown compute capability) raises
:class:`optirs.InvalidParameterError`.

The module is also the ``occupancy`` analysis plugin: it answers ``optirs_launch_config`` for compiled
numba.cuda kernels. The ``optirs occupancy`` command (tables) is :mod:`optirs.tools.occupancy_cli`
and its curves are drawn by :func:`optirs.tools.plots.occupancy_curves`.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from optirs.core.errors import BackendUnavailableError, InvalidParameterError
from optirs.core.simulator import cuda_simulator_enabled
from optirs.plugin.hookspecs import hookimpl

__all__ = [
    "calculate_occupancy",
    "optimal_block_size",
    "driver_potential_carveout",
    "KernelResourceUsage",
    "OccupancyLimiter",
    "OccupancyResult",
    "SmResourceLimits",
    "BlockSizeSuggestion",
    "KNOWN_COMPUTE_CAPABILITIES",
    "launch_config",
    "block_sizes",
    "plugin",
]

KiB = 1024
UNLIMITED = 2**31 - 1
"""A per-limit block count that does not bind (the calculator's INT_MAX: no registers, no shared memory)."""

# Carveout preferences, as CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT takes them.
CARVEOUT_DEFAULT = -1
CARVEOUT_MAX_L1 = 0
CARVEOUT_MAX_SHARED = 100

_CACHING = ("off", "on", "strict")


# ---------------------------------------------------------------- device limits


@dataclass(frozen=True)
class SmResourceLimits:
    """What one streaming multiprocessor of a compute capability offers, and how it allocates it.

    Sizes are in bytes and registers are 32-bit registers. The table entries
    (:meth:`for_compute_capability`) come from the CUDA C++ Programming Guide's per-compute-capability
    table and the rules of ``cuda_occupancy.h``; :meth:`from_device` reads the same quantities from a
    live device. ``sm_count`` is a property of a product, not of a compute capability, so table entries
    leave it unset unless asked.
    """

    compute_capability: Tuple[int, int]
    architecture: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    shared_mem_per_sm: int
    """The largest shared-memory carveout of the SM (``sharedMemPerMultiprocessor``)."""
    shared_mem_per_block_optin: int
    """The most a block may use after opting in (``sharedMemPerBlockOptin``)."""
    warp_size: int = 32
    max_threads_per_block: int = 1024
    registers_per_sm: int = 64 * KiB
    registers_per_block: int = 64 * KiB
    max_registers_per_thread: int = 255
    """The per-thread check of ``cuda_occupancy.h``: 255 up to CC 6.x, 256 from 7.0 (ptxas never assigns more than 255)."""
    register_alloc_unit: int = 256
    """Registers are allocated to a warp in multiples of this many (per warp, not per thread)."""
    sub_partitions: int = 4
    """Register-file partitions (one per warp scheduler); a warp's registers live in one of them."""
    shared_mem_per_block: int = 48 * KiB
    """The per-block limit without opting in (``sharedMemPerBlock``)."""
    reserved_shared_mem_per_block: int = 0
    """Shared memory the driver reserves in every block (1 KiB from CC 8.0)."""
    shared_mem_alloc_unit: int = 256
    shared_mem_configs: Tuple[int, ...] = ()
    """The per-SM shared-memory sizes the L1/shared carveout can take; empty where shared memory is fixed."""
    partitioned_caching: bool = False
    """Whether the SM supports partitioned global caching (CC 5.2, 5.3, 6.1, 6.2)."""
    barrier_slots_per_block: int = 0
    """Block barriers available per resident-block slot (counted from CC 9.0; 0 where not counted)."""
    sm_count: Optional[int] = None
    name: str = ""
    source: str = "table"

    def __post_init__(self) -> None:
        for attr in ("max_threads_per_sm", "max_blocks_per_sm", "warp_size", "max_threads_per_block",
                     "registers_per_sm", "registers_per_block", "max_registers_per_thread",
                     "register_alloc_unit", "sub_partitions", "shared_mem_per_sm", "shared_mem_per_block",
                     "shared_mem_alloc_unit"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidParameterError(f"SmResourceLimits.{attr}={value!r}, expected a positive integer")
        for attr in ("shared_mem_per_block_optin", "reserved_shared_mem_per_block", "barrier_slots_per_block"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidParameterError(f"SmResourceLimits.{attr}={value!r}, expected an integer >= 0")
        if self.sm_count is not None and (not isinstance(self.sm_count, int) or self.sm_count <= 0):
            raise InvalidParameterError(f"SmResourceLimits.sm_count={self.sm_count!r}, expected a positive integer or None")
        if list(self.shared_mem_configs) != sorted(set(self.shared_mem_configs)):
            raise InvalidParameterError(
                f"SmResourceLimits.shared_mem_configs={self.shared_mem_configs!r}, expected distinct sizes in increasing order")

    # ------------------------------------------------------------ derived

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    # ------------------------------------------------------------ constructors

    @classmethod
    def for_compute_capability(cls, cc: Union[str, float, Tuple[int, int]], sm_count: Optional[int] = None) -> "SmResourceLimits":
        """The table entry for ``cc`` ("9.0", (9, 0)); ``sm_count`` sets the product's SM count."""
        key = _parse_cc(cc)
        entry = _TABLE.get(key)
        if entry is None:
            raise InvalidParameterError(
                f"compute capability {key[0]}.{key[1]} is not in the table; expected one of "
                + ", ".join(f"{a}.{b}" for a, b in _TABLE))
        return entry if sm_count is None else replace(entry, sm_count=sm_count)

    @classmethod
    def from_device(cls, device: Any = None) -> "SmResourceLimits":
        """The limits of a live numba.cuda device (the current one when ``device`` is None).

        Every quantity the driver reports (threads, blocks, registers, shared memory, reservation,
        SM count) is read from the device; the allocation rules (granularities, sub-partitions,
        carveout configurations), which the driver does not report, come from the table entry of the
        device's compute capability (or of the nearest one of the same major version).
        """
        device = _live_device(device)
        cc = tuple(int(x) for x in device.compute_capability)
        rules = _rules_for(cc)
        get = lambda attr: int(getattr(device, attr))  # noqa: E731  (numba reads CU_DEVICE_ATTRIBUTE_<attr>)
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        smem_per_sm = get("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
        configs = rules.shared_mem_configs
        if configs and smem_per_sm > configs[-1]:  # a larger part than its table entry (e.g. CC 10.7)
            configs = configs + (smem_per_sm,)
        return replace(
            rules,
            shared_mem_configs=configs,
            barrier_slots_per_block=_barrier_slots(cc),
            compute_capability=cc,
            warp_size=get("WARP_SIZE"),
            max_threads_per_block=get("MAX_THREADS_PER_BLOCK"),
            max_threads_per_sm=get("MAX_THREADS_PER_MULTIPROCESSOR"),
            max_blocks_per_sm=get("MAX_BLOCKS_PER_MULTIPROCESSOR"),
            registers_per_sm=get("MAX_REGISTERS_PER_MULTIPROCESSOR"),
            registers_per_block=get("MAX_REGISTERS_PER_BLOCK"),
            shared_mem_per_sm=smem_per_sm,
            shared_mem_per_block=get("MAX_SHARED_MEMORY_PER_BLOCK"),
            shared_mem_per_block_optin=get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            reserved_shared_mem_per_block=get("RESERVED_SHARED_MEMORY_PER_BLOCK"),
            sm_count=get("MULTIPROCESSOR_COUNT"),
            name=name,
            source=f"device {name}" + ("" if rules.compute_capability == cc else f" (allocation rules of CC {rules.cc})"),
        )

    def as_rows(self) -> List[Tuple[str, str]]:
        """(quantity, value) pairs for tables."""
        configs = ", ".join(f"{c // KiB}" for c in self.shared_mem_configs) + " KiB" if self.shared_mem_configs else "fixed"
        return [
            ("compute capability", f"{self.cc} ({self.architecture})"),
            ("source", self.source + (f": {self.name}" if self.name and self.name not in self.source else "")),
            ("SMs", str(self.sm_count) if self.sm_count else "-"),
            ("warp size", str(self.warp_size)),
            ("max threads / block", str(self.max_threads_per_block)),
            ("max threads / SM", str(self.max_threads_per_sm)),
            ("max warps / SM", str(self.max_warps_per_sm)),
            ("max blocks / SM", str(self.max_blocks_per_sm)),
            ("registers / SM", str(self.registers_per_sm)),
            ("registers / block", str(self.registers_per_block)),
            ("max registers / thread", str(self.max_registers_per_thread)),
            ("register allocation unit (per warp)", str(self.register_alloc_unit)),
            ("register sub-partitions", str(self.sub_partitions)),
            ("shared memory / SM", f"{self.shared_mem_per_sm} B"),
            ("shared memory / block (default)", f"{self.shared_mem_per_block} B"),
            ("shared memory / block (opt-in)", f"{self.shared_mem_per_block_optin} B"),
            ("reserved shared memory / block", f"{self.reserved_shared_mem_per_block} B"),
            ("shared memory allocation unit", f"{self.shared_mem_alloc_unit} B"),
            ("carveout configurations", configs),
            ("partitioned global caching", "supported" if self.partitioned_caching else "-"),
            ("block barrier slots / block", str(self.barrier_slots_per_block) if self.barrier_slots_per_block else "-"),
        ]


def _parse_cc(cc: Any) -> Tuple[int, int]:
    try:
        if isinstance(cc, str):
            major, minor = cc.strip().split(".")
            return int(major), int(minor)
        if isinstance(cc, float):
            major, minor = f"{cc:.1f}".split(".")
            return int(major), int(minor)
        major, minor = cc
        return int(major), int(minor)
    except (TypeError, ValueError):
        raise InvalidParameterError(f"compute capability {cc!r}, expected 'major.minor' such as '9.0' or a (major, minor) tuple") from None


def _configs(*kib: int) -> Tuple[int, ...]:
    return tuple(k * KiB for k in kib)


_VOLTA_CONFIGS = _configs(0, 8, 16, 32, 64, 96)
_GA100_CONFIGS = _configs(0, 8, 16, 32, 64, 100, 132, 164)
_GA10X_CONFIGS = _configs(0, 8, 16, 32, 64, 100)
_GH100_CONFIGS = _configs(0, 8, 16, 32, 64, 100, 132, 164, 196, 228)


def _entry(cc, arch, threads, blocks, smem_sm, optin, **kw) -> SmResourceLimits:
    return SmResourceLimits(compute_capability=cc, architecture=arch, max_threads_per_sm=threads,
                            max_blocks_per_sm=blocks, shared_mem_per_sm=smem_sm * KiB,
                            shared_mem_per_block_optin=optin * KiB, **kw)


# The CUDA C++ Programming Guide's table "Technical Specifications per Compute Capability", with the
# allocation rules of cuda_occupancy.h (CUDA 13). Maxwell and Pascal have fixed shared memory (no
# carveout, no opt-in beyond 48 KiB); Tegra parts (5.3, 6.2) have half the registers per block.
_MAXWELL_PASCAL = dict(max_registers_per_thread=255)
_VOLTA_ON = dict(max_registers_per_thread=256)
_AMPERE_ON = dict(max_registers_per_thread=256, reserved_shared_mem_per_block=1 * KiB, shared_mem_alloc_unit=128)
_TABLE: Dict[Tuple[int, int], SmResourceLimits] = {e.compute_capability: e for e in (
    _entry((5, 0), "Maxwell", 2048, 32, 64, 48, **_MAXWELL_PASCAL),
    _entry((5, 2), "Maxwell", 2048, 32, 96, 48, partitioned_caching=True, **_MAXWELL_PASCAL),
    _entry((5, 3), "Maxwell (Tegra)", 2048, 32, 64, 48, registers_per_block=32 * KiB, partitioned_caching=True,
           **_MAXWELL_PASCAL),
    _entry((6, 0), "Pascal (GP100)", 2048, 32, 64, 48, sub_partitions=2, **_MAXWELL_PASCAL),
    _entry((6, 1), "Pascal", 2048, 32, 96, 48, partitioned_caching=True, **_MAXWELL_PASCAL),
    _entry((6, 2), "Pascal (Tegra)", 2048, 32, 64, 48, registers_per_block=32 * KiB, partitioned_caching=True,
           **_MAXWELL_PASCAL),
    _entry((7, 0), "Volta", 2048, 32, 96, 96, shared_mem_configs=_VOLTA_CONFIGS, **_VOLTA_ON),
    _entry((7, 2), "Volta (Tegra)", 2048, 32, 96, 96, shared_mem_configs=_VOLTA_CONFIGS, **_VOLTA_ON),
    _entry((7, 5), "Turing", 1024, 16, 64, 64, shared_mem_configs=_configs(32, 64), **_VOLTA_ON),
    _entry((8, 0), "Ampere (GA100)", 2048, 32, 164, 163, shared_mem_configs=_GA100_CONFIGS, **_AMPERE_ON),
    _entry((8, 6), "Ampere", 1536, 16, 100, 99, shared_mem_configs=_GA10X_CONFIGS, **_AMPERE_ON),
    _entry((8, 7), "Ampere (Tegra)", 1536, 16, 164, 163, shared_mem_configs=_GA100_CONFIGS, **_AMPERE_ON),
    _entry((8, 9), "Ada Lovelace", 1536, 24, 100, 99, shared_mem_configs=_GA10X_CONFIGS, **_AMPERE_ON),
    _entry((9, 0), "Hopper", 2048, 32, 228, 227, shared_mem_configs=_GH100_CONFIGS, barrier_slots_per_block=2,
           **_AMPERE_ON),
    _entry((10, 0), "Blackwell", 2048, 32, 228, 227, shared_mem_configs=_GH100_CONFIGS, barrier_slots_per_block=2,
           **_AMPERE_ON),
    _entry((12, 0), "Blackwell (GB20x)", 1536, 24, 100, 99, shared_mem_configs=_GA10X_CONFIGS,
           barrier_slots_per_block=1, **_AMPERE_ON),
)}
KNOWN_COMPUTE_CAPABILITIES: Tuple[Tuple[int, int], ...] = tuple(_TABLE)


def _rules_for(cc: Tuple[int, int]) -> SmResourceLimits:
    """The table entry whose allocation rules apply to ``cc``: itself, else the nearest minor of its major."""
    if cc in _TABLE:
        return _TABLE[cc]
    same_major = [k for k in _TABLE if k[0] == cc[0]]
    if not same_major:
        raise InvalidParameterError(
            f"compute capability {cc[0]}.{cc[1]} has no known allocation rules; expected a major version among "
            + ", ".join(sorted({str(k[0]) for k in _TABLE}, key=int)))
    return _TABLE[min(same_major, key=lambda k: (abs(k[1] - cc[1]), k[1]))]


def _barrier_slots(cc: Tuple[int, int]) -> int:
    """Block barriers per resident-block slot, as cuda_occupancy.h counts them (0: not counted, before 9.0)."""
    major, minor = cc
    if major < 9:
        return 0
    if major == 9 or (major == 10 and minor == 0) or (major == 11 and minor != 0):
        return 2
    return 1


def _live_device(device: Any) -> Any:
    """A real numba.cuda device (the current one for None); BackendUnavailableError where there is none."""
    try:
        from numba import cuda
    except Exception as exc:  # numba-cuda missing or broken
        raise BackendUnavailableError(f"numba.cuda cannot be imported: {exc}") from exc
    # An explicit device object is read as given; only the simulator's own device has no limits.
    if (device is None and cuda_simulator_enabled()) or type(device).__module__.startswith("numba.cuda.simulator"):
        raise BackendUnavailableError("numba's CUDA simulator has no occupancy (NUMBA_ENABLE_CUDASIM=1)")
    if device is None:
        if not cuda.is_available():
            raise BackendUnavailableError("no CUDA device is available to numba.cuda")
        device = cuda.get_current_device()
    if not hasattr(device, "compute_capability"):
        raise InvalidParameterError(f"device={device!r}, expected a numba.cuda device")
    return device


# ---------------------------------------------------------------- kernel resources


@dataclass(frozen=True)
class KernelResourceUsage:
    """What one thread block of a compiled kernel needs, as the driver reports it for the function.

    :param registers_per_thread: ``CU_FUNC_ATTRIBUTE_NUM_REGS``.
    :param static_shared_mem: ``CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES`` (bytes of ``cuda.shared.array``).
    :param max_threads_per_block: ``CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`` (launch bounds, register
        pressure); None for no limit of the kernel's own. Caps :func:`optimal_block_size`'s search.
    :param max_dynamic_shared_mem: ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``; None for the
        driver's default, the per-block default limit less the static shared memory. Raising it past
        that default is the opt-in to large shared memory.
    :param block_barriers: block barriers the kernel uses (``__syncthreads`` is barrier 0; the runtime
        assumes 1); they bound occupancy from CC 9.0 only when more than one is used.
    :param local_mem_per_thread: spill/stack bytes per thread; informative, no occupancy effect.
    """

    registers_per_thread: int
    static_shared_mem: int = 0
    max_threads_per_block: Optional[int] = None
    max_dynamic_shared_mem: Optional[int] = None
    block_barriers: int = 1
    local_mem_per_thread: int = 0

    def __post_init__(self) -> None:
        for attr in ("registers_per_thread", "static_shared_mem", "block_barriers", "local_mem_per_thread"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidParameterError(f"KernelResourceUsage.{attr}={value!r}, expected an integer >= 0")
        if self.max_threads_per_block is not None and (
                not isinstance(self.max_threads_per_block, int) or self.max_threads_per_block <= 0):
            raise InvalidParameterError(
                f"KernelResourceUsage.max_threads_per_block={self.max_threads_per_block!r}, expected a positive integer or None")
        if self.max_dynamic_shared_mem is not None and (
                not isinstance(self.max_dynamic_shared_mem, int) or self.max_dynamic_shared_mem < 0):
            raise InvalidParameterError(
                f"KernelResourceUsage.max_dynamic_shared_mem={self.max_dynamic_shared_mem!r}, expected an integer >= 0 or None")

    def dynamic_limit(self, limits: SmResourceLimits) -> int:
        """The most dynamic shared memory one launch may ask for."""
        if self.max_dynamic_shared_mem is not None:
            return self.max_dynamic_shared_mem
        return max(0, limits.shared_mem_per_block - self.static_shared_mem)

    @classmethod
    def from_kernel(cls, kernel: Any, signature: Any = None) -> "KernelResourceUsage":
        """Read a compiled numba.cuda kernel's resources (needs its device's context).

        ``kernel`` is a ``@cuda.jit`` dispatcher with one compiled signature (or ``signature`` naming
        one) or one compiled overload. Raises InvalidParameterError when it cannot tell which compiled
        variant is meant.
        """
        overload = _compiled_overload(kernel, signature)
        if overload is None:
            raise InvalidParameterError(
                f"kernel {kernel!r} has no single compiled variant; compile it for one signature first "
                "(or pass signature=)")
        return cls(
            registers_per_thread=int(overload.regs_per_thread),
            static_shared_mem=int(overload.shared_mem_per_block),
            max_threads_per_block=int(overload.max_threads_per_block),
            local_mem_per_thread=int(overload.local_mem_per_thread),
        )


def _compiled_overload(kernel: Any, signature: Any = None) -> Any:
    """The one compiled variant of a numba.cuda kernel, or None when there is none or several."""
    if all(hasattr(kernel, a) for a in ("regs_per_thread", "shared_mem_per_block", "max_threads_per_block")):
        return kernel  # already a compiled overload
    overloads = getattr(kernel, "overloads", None)
    if not isinstance(overloads, dict) or not overloads:
        return None
    if signature is not None:
        args = getattr(signature, "args", signature)
        return overloads.get(tuple(args))
    if len(overloads) != 1:
        return None
    return next(iter(overloads.values()))


# ---------------------------------------------------------------- results


class OccupancyLimiter(enum.Flag):
    """The resources that hold occupancy to its value (several when they tie)."""

    NONE = 0
    WARPS = 1
    REGISTERS = 2
    SHARED_MEMORY = 4
    BLOCKS = 8
    BARRIERS = 16

    def names(self) -> List[str]:
        return [m.name.lower() for m in OccupancyLimiter if m.value and m in self]

    def __str__(self) -> str:
        return "+".join(self.names()) or "none"


_LIMIT_KEYS = {
    "warps": OccupancyLimiter.WARPS,
    "registers": OccupancyLimiter.REGISTERS,
    "shared_memory": OccupancyLimiter.SHARED_MEMORY,
    "blocks": OccupancyLimiter.BLOCKS,
    "barriers": OccupancyLimiter.BARRIERS,
}


@dataclass(frozen=True)
class OccupancyResult:
    """The occupancy of one launch configuration on one SM.

    ``block_limits`` maps each resource (``warps``, ``registers``, ``shared_memory``, ``blocks``,
    ``barriers``) to the blocks per SM it alone would allow (:data:`UNLIMITED` where it does not bind).
    """

    block_size: int
    dynamic_shared_mem: int
    active_blocks_per_sm: int
    active_warps_per_sm: int
    max_warps_per_sm: int
    occupancy: float
    limiter: OccupancyLimiter
    block_limits: Dict[str, int]
    warps_per_block: int
    allocated_registers_per_block: int
    allocated_shared_mem_per_block: int
    shared_mem_per_sm: int
    """The shared-memory carveout this configuration runs with."""
    partitioned_caching: bool = False
    reason: str = ""
    """Why no block fits, when ``active_blocks_per_sm`` is 0."""

    @property
    def active_threads_per_sm(self) -> int:
        return self.active_blocks_per_sm * self.block_size


class BlockSizeSuggestion(NamedTuple):
    """What :func:`optimal_block_size` suggests (``cudaOccupancyMaxPotentialBlockSize``'s two outputs first)."""

    min_grid_size: Optional[int]
    """Blocks per SM times the SM count: the smallest grid that fills the device (None without an SM count)."""
    block_size: int
    blocks_per_sm: int
    occupancy: float


# ---------------------------------------------------------------- the calculator


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as a Python int (numpy integers accepted) when it is an integer >= minimum."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise InvalidParameterError(f"{name}={value!r}, expected an integer >= {minimum}")
    return number


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _align_to_config(size: int, limits: SmResourceLimits) -> int:
    """The smallest carveout configuration holding ``size`` bytes."""
    for config in limits.shared_mem_configs:
        if size <= config:
            return config
    raise InvalidParameterError(
        f"{size} B of shared memory per SM exceeds every carveout of CC {limits.cc} "
        f"(largest {limits.shared_mem_configs[-1] if limits.shared_mem_configs else limits.shared_mem_per_sm} B)")


def _check_carveout(carveout: Any) -> int:
    if not isinstance(carveout, int) or isinstance(carveout, bool) or not CARVEOUT_DEFAULT <= carveout <= CARVEOUT_MAX_SHARED:
        raise InvalidParameterError(f"carveout={carveout!r}, expected -1 (no preference) or a percentage 0 <= carveout <= 100")
    return carveout


def _preferred_shared_mem(limits: SmResourceLimits, carveout: int) -> int:
    """The per-SM shared memory the carveout preference asks for (the whole of it where it is fixed)."""
    if not limits.shared_mem_configs:  # Maxwell, Pascal: dedicated shared memory
        return limits.shared_mem_per_sm
    wanted = limits.shared_mem_per_sm if carveout == CARVEOUT_DEFAULT else carveout * limits.shared_mem_per_sm // 100
    return _align_to_config(wanted, limits)


def _registers_limit(limits: SmResourceLimits, usage: KernelResourceUsage, warps: int, caching: str,
                     sub_partitions: int) -> Tuple[int, int, str, str]:
    """(blocks, registers allocated per block, caching left on, reason when 0)."""
    regs_per_warp = _round_up(usage.registers_per_thread * limits.warp_size, limits.register_alloc_unit)
    per_block = regs_per_warp * warps
    # The hardware checks a block as if its warps were spread over every sub-partition at once.
    assumed = regs_per_warp * _round_up(warps, sub_partitions)
    if usage.registers_per_thread > limits.max_registers_per_thread:
        return 0, per_block, caching, (f"registers_per_thread={usage.registers_per_thread} exceeds the "
                                       f"{limits.max_registers_per_thread} a thread may use")
    if per_block > limits.registers_per_block or assumed > limits.registers_per_block:
        return 0, per_block, caching, (
            f"a block of {warps} warps needs {max(per_block, assumed)} registers "
            f"({regs_per_warp} per warp, warps rounded up to {sub_partitions} sub-partitions), more than the "
            f"{limits.registers_per_block} a block may use")
    if regs_per_warp == 0:
        return UNLIMITED, per_block, caching, ""
    warps_per_partition = (limits.registers_per_sm // sub_partitions) // regs_per_warp
    blocks = 0
    if caching != "off":  # a block is confined to half the SM
        blocks = (warps_per_partition * (sub_partitions // 2) // warps) * 2
    if blocks == 0 and caching != "strict":
        caching = "off"  # the driver turns caching off when a block cannot fit in half an SM
        blocks = (warps_per_partition * sub_partitions) // warps
    return blocks, per_block, caching, ""


def calculate_occupancy(limits: SmResourceLimits, usage: KernelResourceUsage, block_size: int, dynamic_smem: int = 0,
                        *, carveout: int = CARVEOUT_DEFAULT, partitioned_caching: str = "off") -> OccupancyResult:
    """Blocks of ``block_size`` threads that can be resident on one SM, as ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` counts them.

    :param limits: the SM (:meth:`SmResourceLimits.for_compute_capability` or :meth:`~SmResourceLimits.from_device`).
    :param usage: the kernel's registers and shared memory.
    :param block_size: threads per block (> 0).
    :param dynamic_smem: dynamic shared memory per block in bytes.
    :param carveout: the kernel's preferred shared-memory carveout in percent of the maximum (0-100), or
        -1 for none (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``); Volta and later.
    :param partitioned_caching: ``"off"`` (the runtime's default), ``"on"`` (prefer partitioned global
        caching where supported, dropped when a block cannot fit in half an SM) or ``"strict"`` (never dropped).
    :return: an :class:`OccupancyResult`; 0 active blocks with ``reason`` when the configuration cannot run.
    """
    if not isinstance(limits, SmResourceLimits):
        raise InvalidParameterError(f"limits={limits!r}, expected an SmResourceLimits")
    if not isinstance(usage, KernelResourceUsage):
        raise InvalidParameterError(f"usage={usage!r}, expected a KernelResourceUsage")
    block_size = _check_int("block_size", block_size, 1)
    dynamic_smem = _check_int("dynamic_smem", dynamic_smem, 0)
    _check_carveout(carveout)
    if partitioned_caching not in _CACHING:
        raise InvalidParameterError(f"partitioned_caching={partitioned_caching!r}, expected one of {_CACHING}")

    caching = partitioned_caching if limits.partitioned_caching else "off"
    warps = -(-block_size // limits.warp_size)
    reasons: Dict[str, str] = {}

    # Registers (they may also switch partitioned caching off, which the warp limit then sees).
    by_regs, regs_per_block, caching, why = _registers_limit(limits, usage, warps, caching, limits.sub_partitions)
    if why:
        reasons["registers"] = why
    if limits.compute_capability == (6, 0) and by_regs:
        # GP100 has 2 sub-partitions, the rest of Pascal 4: CUDA refuses on GP100 what GP10x cannot run.
        gp10x, _, _, why = _registers_limit(limits, usage, warps, caching, 4)
        if gp10x == 0:
            by_regs = 0
            reasons["registers"] = why + " (checked as on other Pascal GPUs)"

    # Warps.
    if block_size > limits.max_threads_per_block:
        by_warps = 0
        reasons["warps"] = f"block_size={block_size} exceeds the {limits.max_threads_per_block} threads a block may have"
    elif caching != "off":
        by_warps = (limits.max_warps_per_sm // 2 // warps) * 2
    else:
        by_warps = limits.max_warps_per_sm // warps

    # Shared memory.
    static = usage.static_shared_mem + limits.reserved_shared_mem_per_block
    smem_per_block = _round_up(static + dynamic_smem, limits.shared_mem_alloc_unit)
    dynamic_max = usage.dynamic_limit(limits)
    # The per-block ceiling is the opt-in one when the kernel's own maximum goes past the default.
    ceiling = (limits.shared_mem_per_block_optin
               if limits.compute_capability[0] >= 7 and static + dynamic_max > limits.shared_mem_per_block
               else limits.shared_mem_per_block)
    if limits.compute_capability[0] >= 8:
        ceiling += limits.reserved_shared_mem_per_block
    preferred = _preferred_shared_mem(limits, carveout)
    smem_per_sm = preferred
    if dynamic_smem > dynamic_max:
        by_smem = 0
        reasons["shared_memory"] = (f"dynamic_smem={dynamic_smem} B exceeds the kernel's maximum of {dynamic_max} B "
                                    "(raise it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)")
    elif smem_per_block > ceiling:
        by_smem = 0
        reasons["shared_memory"] = (f"a block needs {smem_per_block} B of shared memory ({usage.static_shared_mem} static + "
                                    f"{dynamic_smem} dynamic + {limits.reserved_shared_mem_per_block} reserved, rounded "
                                    f"to {limits.shared_mem_alloc_unit} B), more than the {ceiling} B a block may use")
    else:
        if preferred < smem_per_block:
            # The preference is ignored when it cannot hold one block: Volta and later take the
            # smallest carveout that does; older GPUs have all of it anyway.
            smem_per_sm = _align_to_config(smem_per_block, limits) if limits.shared_mem_configs else limits.shared_mem_per_sm
        by_smem = smem_per_sm // smem_per_block if smem_per_block else UNLIMITED

    by_blocks = limits.max_blocks_per_sm
    block_limits = {"warps": by_warps, "registers": by_regs, "shared_memory": by_smem, "blocks": by_blocks,
                    "barriers": UNLIMITED}
    if limits.barrier_slots_per_block and usage.block_barriers > 0:
        # From Hopper on, each resident-block slot brings a fixed number of block barriers.
        available = by_blocks * limits.barrier_slots_per_block
        block_limits["barriers"] = available // usage.block_barriers
        if block_limits["barriers"] == 0:
            reasons["barriers"] = f"{usage.block_barriers} block barriers exceed the {available} an SM has"
    limit = min(block_limits.values())
    # Every resource that alone allows exactly the final count limits it (cuda_occupancy.h marks the
    # barrier limit on top of the others; here the set is always the ties with the final count).
    limiter = OccupancyLimiter.NONE
    for key, count in block_limits.items():
        if count == limit:
            limiter |= _LIMIT_KEYS[key]

    reason = ""
    if limit == 0:
        reason = "; ".join(reasons.get(k, f"no block fits by {k.replace('_', ' ')}")
                           for k, count in block_limits.items() if count == 0)
    active_warps = limit * warps
    return OccupancyResult(
        block_size=block_size,
        dynamic_shared_mem=dynamic_smem,
        active_blocks_per_sm=limit,
        active_warps_per_sm=active_warps,
        max_warps_per_sm=limits.max_warps_per_sm,
        occupancy=active_warps / limits.max_warps_per_sm,
        limiter=limiter,
        block_limits=block_limits,
        warps_per_block=warps,
        allocated_registers_per_block=regs_per_block,
        allocated_shared_mem_per_block=smem_per_block,
        shared_mem_per_sm=smem_per_sm,
        partitioned_caching=caching != "off",
        reason=reason,
    )


DynamicSmem = Union[int, Callable[[int], int]]


_APIS = ("driver", "runtime")


def driver_potential_carveout(carveout: int) -> int:
    """The carveout preference ``cuOccupancyMaxPotentialBlockSize`` computes with, for the kernel's ``carveout``.

    Measured on an H200 (driver 580.159.04, CUDA 13.0; benchmarks/results/h200-occupancy-run1.json):
    the driver's block-size search honours a preference of 0 (maximum L1) but answers for 25, 50 and
    75 exactly as with no preference (all 538 recorded answers agree), although its active-block
    query honours every value. Values 1-24 and 76-99 were not measured; they are taken as 25-75 are.
    """
    carveout = _check_carveout(carveout)
    return carveout if carveout == CARVEOUT_MAX_L1 else CARVEOUT_DEFAULT


def optimal_block_size(limits: SmResourceLimits, usage: KernelResourceUsage, dynamic_smem: DynamicSmem = 0,
                       block_size_limit: int = 0, *, carveout: int = CARVEOUT_DEFAULT,
                       partitioned_caching: str = "off", api: str = "driver") -> BlockSizeSuggestion:
    """The block size that keeps the most threads resident per SM, as ``cuOccupancyMaxPotentialBlockSize`` picks it.

    Block sizes are tried from the largest allowed down in steps of the warp size (the largest first
    even when it is not a multiple of the warp size); a smaller block wins only with strictly more
    resident threads, so ties go to the larger block; the search stops once the SM is full.

    The driver's query and the runtime's C++ template differ in one respect, the kernel's
    shared-memory carveout preference: the driver's (``api="driver"``, measured) honours only a
    preference of 0 and searches as if there were none for any other value
    (:func:`driver_potential_carveout`); the runtime's ``cudaOccupancyMaxPotentialBlockSize``
    (``api="runtime"``) asks ``cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags`` for every
    block size, so the preference counts as :func:`calculate_occupancy` counts it. With no
    preference (-1) or 0 the two agree.

    :param dynamic_smem: bytes of dynamic shared memory per block, or a callable mapping a block size
        to them (``cudaOccupancyMaxPotentialBlockSizeVariableSMem``).
    :param block_size_limit: the largest block the kernel can take; 0 for the device's and the kernel's limit.
    :param carveout: the kernel's preferred shared-memory carveout, as for :func:`calculate_occupancy`.
    :param api: ``"driver"`` (``cuOccupancyMaxPotentialBlockSize``) or ``"runtime"``.
    :return: a :class:`BlockSizeSuggestion`; ``block_size`` 0 when no block size can run.
        ``blocks_per_sm`` and ``min_grid_size`` are counted as the chosen API counts them.
    """
    if not isinstance(limits, SmResourceLimits):
        raise InvalidParameterError(f"limits={limits!r}, expected an SmResourceLimits")
    if not isinstance(usage, KernelResourceUsage):
        raise InvalidParameterError(f"usage={usage!r}, expected a KernelResourceUsage")
    block_size_limit = _check_int("block_size_limit", block_size_limit, 0)
    carveout = _check_carveout(carveout)
    if api not in _APIS:
        raise InvalidParameterError(f"api={api!r}, expected one of {_APIS}")
    if api == "driver":
        carveout = driver_potential_carveout(carveout)
    if callable(dynamic_smem):
        smem_for = dynamic_smem
    else:
        constant = _check_int("dynamic_smem", dynamic_smem, 0)
        smem_for = lambda _block: constant  # noqa: E731

    limit = block_size_limit or limits.max_threads_per_block
    limit = min(limit, limits.max_threads_per_block)
    if usage.max_threads_per_block is not None:
        limit = min(limit, usage.max_threads_per_block)
    granularity = limits.warp_size
    best_block, best_blocks, best_threads = 0, 0, 0
    for aligned in range(_round_up(limit, granularity), 0, -granularity):
        block = min(limit, aligned)
        smem = _check_int(f"dynamic_smem({block}) returned", smem_for(block), 0)
        blocks = calculate_occupancy(limits, usage, block, smem, carveout=carveout,
                                     partitioned_caching=partitioned_caching).active_blocks_per_sm
        if block * blocks > best_threads:
            best_block, best_blocks, best_threads = block, blocks, block * blocks
        if best_threads == limits.max_threads_per_sm:
            break
    min_grid = best_blocks * limits.sm_count if limits.sm_count else None
    warps = best_blocks * -(-best_block // limits.warp_size) if best_block else 0
    return BlockSizeSuggestion(min_grid, best_block, best_blocks, warps / limits.max_warps_per_sm)


def launch_config(limits: SmResourceLimits, usage: KernelResourceUsage, elements: int,
                  dynamic_smem: DynamicSmem = 0) -> Tuple[int, int]:
    """``(grid, block)`` covering ``elements`` work items (one per thread) with the most resident threads per SM."""
    elements = _check_int("elements", elements, 0)
    suggestion = optimal_block_size(limits, usage, dynamic_smem)
    if suggestion.block_size == 0:
        raise InvalidParameterError(
            f"no block size of this kernel can run on CC {limits.cc}: "
            + calculate_occupancy(limits, usage, limits.warp_size,
                                  dynamic_smem(limits.warp_size) if callable(dynamic_smem) else dynamic_smem).reason)
    block = suggestion.block_size
    return max(1, -(-elements // block)), block


# ---------------------------------------------------------------- the plugin


def block_sizes(limits: SmResourceLimits, usage: KernelResourceUsage) -> List[int]:
    """Every whole-warp block size the kernel and the SM allow, smallest first."""
    top = min(limits.max_threads_per_block, usage.max_threads_per_block or limits.max_threads_per_block)
    return list(range(limits.warp_size, top + 1, limits.warp_size))


def _limits_for(device: Any) -> Optional[SmResourceLimits]:
    """The SM limits of a numba device, a compute capability, or the current device; None when unknowable."""
    if isinstance(device, SmResourceLimits):
        return device
    if isinstance(device, (tuple, list, str)):
        try:
            return SmResourceLimits.for_compute_capability(tuple(device) if isinstance(device, list) else device)
        except InvalidParameterError:  # not in the table: cannot tell
            return None
    try:
        return SmResourceLimits.from_device(device)
    except (BackendUnavailableError, InvalidParameterError):
        return None
    except Exception:  # a device that cannot answer its attributes: defer to another plugin
        return None


class OccupancyPlugin:
    """The ``occupancy`` analysis plugin: launch configurations for compiled numba.cuda kernels."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        return {"summary": "CUDA occupancy calculator (CC 5.0-12.0) and launch configurations for numba.cuda kernels"}

    @hookimpl
    def optirs_launch_config(self, kernel: Any, device: Any, elements: int) -> Optional[Tuple[int, int]]:
        """``(grid, block)`` for ``elements`` work items; None when the kernel or device cannot be read
        (simulator, no device, a dispatcher with no or several compiled signatures)."""
        if isinstance(kernel, KernelResourceUsage):
            usage = kernel
        else:
            if cuda_simulator_enabled():
                return None
            overload = _compiled_overload(kernel)
            if overload is None:
                return None
            try:
                usage = KernelResourceUsage.from_kernel(overload)
            except Exception:  # no context for the kernel's device: defer
                return None
        limits = _limits_for(device)
        if limits is None:
            return None
        try:
            return launch_config(limits, usage, int(elements))
        except InvalidParameterError:
            return None


plugin = OccupancyPlugin()
