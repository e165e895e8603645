"""The ``fingerprint`` capability on the cuda backend: one kernel launch per request.

Each thread sums its words and keeps its largest key (:mod:`optirs.backends.common.fingerprint`,
the terms the cpu loop shares) over a grid-stride loop of 16-byte loads (four 32-bit or eight
16-bit words; an array not 16-byte aligned, and the words past the last whole load, one word a
load), the block folds them in shared memory and one thread adds the block's sum into the array's
row of ``out`` and raises its key there (64-bit atomics at the row's address). The rows are cleared
first on the same stream (``cuMemsetD32Async``).

- One array (the torch front end fingerprints each gradient in its hook, on autograd's thread):
  every argument is a number (address, count, width, row address), the launch is prepared once
  per grid size and each call rewrites those values and calls ``cuLaunchKernel``.
- Several arrays (``step()``'s check of every gradient): one launch over a table of the arrays
  (address, count, width, row address, first block: :class:`~optirs.backends.cuda.context.PointerTables`,
  rewritten only when the arrays change), each array given blocks in proportion to its size and
  each block finding its array by a binary search of the first blocks. A launch per array cost
  the 1.3B model's 292 gradients 4-7 ms of host time a round.

numba.cuda is imported on first use, never when the backend is imported.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.plugin.hookspecs import hookimpl

BLOCK = 256
WORDS_PER_THREAD = 8  # words a thread reads at least before the grid stops growing
BLOCKS_PER_SM = 16
TABLE_COLUMNS = 5  # a table row: address, count, bits a word, row address, first block

# bound on first use (the kernel reads them as module globals; the simulator swaps the globals that
# are numba.cuda for its own while a kernel runs)
cuda: Any = None
ld_u16: Any = None
ld_u32: Any = None
ld_u32x4: Any = None
ld_u32x2: Any = None
ld_i64: Any = None
fold_word: Any = None
atomic_add_i64: Any = None
atomic_max_i64: Any = None
fingerprint_word: Any = None
fingerprint_key: Any = None
int64: Any = None
_READY: list = []


def _ld_i64(addr):
    """The int64 at ``addr`` (compiled as a device function by :func:`_bind`)."""
    lo, hi = ld_u32x2(addr)
    return int64(lo) | (int64(hi) << 32)


def fingerprint_kernel(sc):
    """``sc`` = (address, count, bits, row address, table address, arrays): the words' sum and
    largest key into the row; with ``arrays`` > 0, those of every array of the table (int64 rows of
    TABLE_COLUMNS), each block on the array whose blocks hold it."""
    narrays = sc[5]
    if narrays == 0:
        addr, n, bits, row = sc[0], sc[1], sc[2], sc[3]
        first = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
    else:
        table = sc[4]
        width = int64(8 * TABLE_COLUMNS)
        b = int64(cuda.blockIdx.x)
        lo = int64(0)  # the last array whose first block is at most b
        hi = narrays - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ld_i64(table + width * mid + 32) <= b:
                lo = mid
            else:
                hi = mid - 1
        at = table + width * lo
        addr, n, bits, row = ld_i64(at), ld_i64(at + 8), ld_i64(at + 16), ld_i64(at + 24)
        start_block = ld_i64(at + 32)
        stop_block = ld_i64(at + width + 32) if lo + 1 < narrays else int64(cuda.gridDim.x)
        first = (b - start_block) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        stride = (stop_block - start_block) * int64(cuda.blockDim.x)
    total = int64(0)
    best = int64(0)
    start = int64(0)  # the scalar loop's first element
    if addr % 16 == 0:  # 16-byte loads: 4 words of 32 bits or 8 of 16 a load
        per = 128 // bits
        vectors = n // per
        j = first
        while j < vectors:
            a, b, c, d = ld_u32x4(addr + 16 * j)
            e = j * per
            step = per // 4
            total, best = fold_word(total, best, a, bits, e)
            total, best = fold_word(total, best, b, bits, e + step)
            total, best = fold_word(total, best, c, bits, e + 2 * step)
            total, best = fold_word(total, best, d, bits, e + 3 * step)
            j += stride
        start = vectors * per
    i = start + first
    if bits == 32:
        while i < n:
            u = ld_u32(addr + 4 * i)
            total += fingerprint_word(u, 32)
            best = max(best, fingerprint_key(u, 32, i))
            i += stride
    else:
        while i < n:
            u = ld_u16(addr + 2 * i)
            total += fingerprint_word(u, 16)
            best = max(best, fingerprint_key(u, 16, i))
            i += stride
    sums = cuda.shared.array(BLOCK, int64)
    keys = cuda.shared.array(BLOCK, int64)
    t = cuda.threadIdx.x
    sums[t] = total
    keys[t] = best
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if t < half:
            sums[t] += sums[t + half]
            keys[t] = max(keys[t], keys[t + half])
        cuda.syncthreads()
        half //= 2
    if t == 0:
        atomic_add_i64(row, sums[0])
        atomic_max_i64(row + 8, keys[0])


def _simulated_atomics():
    """The two atomics on host memory (the simulator's device memory), under one lock."""
    lock = threading.Lock()

    def add(addr, value):
        with lock:
            cell = ctypes.c_int64.from_address(int(addr))
            cell.value = (cell.value + int(value) + (1 << 63)) % (1 << 64) - (1 << 63)

    def largest(addr, value):
        with lock:
            cell = ctypes.c_int64.from_address(int(addr))
            cell.value = max(cell.value, int(value))

    return add, largest


def _device_atomics():
    """``atomicrmw add`` / ``max`` of an int64 at a global address (no array around it)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    def make(op):
        @intrinsic
        def rmw(typingctx, addr, value):
            def codegen(context, builder, sig, args):
                ptr = builder.inttoptr(args[0], ir.PointerType(i64, 1))  # the global address space
                builder.atomic_rmw(op, ptr, args[1], "monotonic")
                return context.get_dummy_value()

            return types.void(types.int64, types.int64), codegen

        return rmw

    return make("add"), make("max")


def _bind(ctx: Any) -> None:
    global cuda, ld_u16, ld_u32, ld_u32x2, ld_u32x4, ld_i64, atomic_add_i64, atomic_max_i64
    global fingerprint_word, fingerprint_key, fold_word, int64
    if _READY:
        return
    import numba

    from optirs.backends.common import fingerprint as terms
    from optirs.backends.cuda.formats_memory import ld_u16 as load16
    from optirs.backends.cuda.formats_memory import ld_u32 as load32
    from optirs.backends.cuda.formats_memory import ld_u32x2 as load32x2
    from optirs.backends.cuda.formats_memory import ld_u32x4 as load32x4

    cuda, int64 = ctx.cuda, numba.int64
    ld_u16, ld_u32, ld_u32x2, ld_u32x4 = load16, load32, load32x2, load32x4
    ld_i64 = ctx.cuda.jit(device=True)(_ld_i64)
    atomic_add_i64, atomic_max_i64 = _simulated_atomics() if ctx.simulator else _device_atomics()
    fingerprint_word, fingerprint_key, fold_word = terms.fingerprint_word, terms.fingerprint_key, terms.fold_word
    _READY.append(True)


def _described(a: Any, what: str):
    """(address, elements, bytes an element, C-contiguous, device index or None, dtype, shape) of a
    CUDA array."""
    if type(a).__module__.startswith("torch"):  # its own accessors: no interface dict made per call
        import numpy as np

        dtype = np.dtype(str(a.dtype).replace("torch.", ""))
        return (a.data_ptr(), a.numel(), a.element_size(), a.is_contiguous(), a.device.index, dtype,
                tuple(a.shape))
    from optirs.backends.cuda.replica_reduce import device_of
    from optirs.core.arrays import describe
    from optirs.core.simulator import is_simulator_array

    if not (is_simulator_array(a) or hasattr(a, "__cuda_array_interface__")):
        raise InvalidParameterError(
            f"{what} is a {type(a).__module__}.{type(a).__name__}, expected a CUDA device array "
            "(__cuda_array_interface__: numba, CuPy, torch) on the cuda backend")
    meta = describe(a, what)
    device = None if is_simulator_array(a) else device_of(a)
    return meta.address, meta.size, meta.dtype.itemsize, meta.contiguous, device, meta.dtype, meta.shape


class CudaFingerprint:
    """Mixin of :class:`optirs.backends.cuda.CudaBackend` (CUDA device arrays of any library)."""

    @hookimpl
    def optirs_fingerprint(self, ctx: Any, arrays: Sequence[Any], out: Any, rows: Sequence[int]) -> None:
        from optirs.backends.common.fingerprint import check_request

        described = [_described(a, f"arrays[{k}]") for k, a in enumerate(arrays)]
        whole = _described(out, "out")
        oaddr, _, _, ocontig, _, odtype, oshape = whole
        error = check_request([d[2] for d in described], [d[3] for d in described], oshape, odtype, ocontig, rows)
        if error is not None:
            raise error
        here = None if ctx.simulator else ctx.device.id
        for k, d in enumerate(described + [whole]):
            if here is not None and d[4] is not None and d[4] != here:
                what = f"arrays[{k}]" if k < len(described) else "out"
                raise UnsupportedOperationError(
                    f"{what} is on GPU {d[4]}, but this cuda backend runs on GPU {here}; expected arrays on its device")
        ctx.resolve_stream(out)
        _bind(ctx)
        compiled = ctx.compiled("fingerprint", fingerprint_kernel, _argument_types())
        rows = [int(r) for r in rows]
        if rows and sorted(rows) == list(range(min(rows), min(rows) + len(rows))):
            _clear(ctx, oaddr + 16 * min(rows), len(rows))  # a run of rows (step()'s check: all of them)
        else:
            for r in rows:
                _clear(ctx, oaddr + 16 * r, 1)
        if len(described) == 1:
            addr, count, width = described[0][:3]
            grid, block = _launch_size(ctx, count)
            ctx.launch(compiled, ((addr, count, 8 * width, oaddr + 16 * rows[0], 0, 0),), grid, block)
        elif described:
            _launch_table(ctx, compiled, described, [oaddr + 16 * r for r in rows])


def _argument_types() -> tuple:
    from numba import types

    return (types.UniTuple(types.int64, 6),)


def _launch_size(ctx: Any, count: int):
    """(grid, block): enough blocks for WORDS_PER_THREAD words a thread, up to BLOCKS_PER_SM a
    multiprocessor, rounded up to a power of two (few distinct launches to prepare)."""
    if ctx.simulator:
        from optirs.backends.cuda.context import SIM_BLOCK, SIM_GRID

        return SIM_GRID, SIM_BLOCK
    grid = 1 << (_blocks_wanted(count) - 1).bit_length()
    return min(grid, ctx.sm_count * BLOCKS_PER_SM), BLOCK


def _blocks_wanted(count: int) -> int:
    """Blocks for WORDS_PER_THREAD words a thread of an array of ``count`` words (at least one)."""
    return max(1, -(-count // (BLOCK * WORDS_PER_THREAD)))


def _launch_table(ctx: Any, compiled: Any, described: list, row_addresses: list) -> None:
    """One launch over every array of ``described``: each gets the blocks :func:`_launch_size` would
    give it alone (without the rounding to a power of two), one after another in the grid."""
    if ctx.simulator:
        from optirs.backends.cuda.context import SIM_BLOCK

        blocks, block = [1] * len(described), SIM_BLOCK
    else:
        cap, block = ctx.sm_count * BLOCKS_PER_SM, BLOCK
        blocks = [min(cap, _blocks_wanted(d[1])) for d in described]
    starts, total = [], 0
    for b in blocks:
        starts.append(total)
        total += b
    columns = (tuple(d[0] for d in described), tuple(d[1] for d in described),
               tuple(8 * d[2] for d in described), tuple(row_addresses), tuple(starts))
    table = ctx.row_tables("fingerprint", len(described), TABLE_COLUMNS).address(*columns)
    ctx.launch(compiled, ((0, 0, 0, 0, table, len(described)),), total, block)


def _clear(ctx: Any, address: int, rows: int) -> None:
    """Zero ``rows`` rows (16 bytes each) at ``address``, ordered on the stream in use."""
    if ctx.simulator:
        ctypes.memset(address, 0, 16 * rows)
        return
    ctx.launcher.memset32(address, 4 * rows, ctx.stream)
