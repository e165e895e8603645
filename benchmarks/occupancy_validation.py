"""Validate optirs' occupancy calculator against the CUDA driver on a real GPU.

For a set of real numba.cuda kernels (register counts from a handful to 255, static shared memory,
dynamic shared memory with and without the opt-in, shared-memory carveout preferences, launch
bounds) and every block size from 32 to 1024 in steps of 32 (plus a few that are not warp
multiples), compare

- ``calculate_occupancy`` with ``cuOccupancyMaxActiveBlocksPerMultiprocessor``, and
- ``optimal_block_size`` with ``cuOccupancyMaxPotentialBlockSize`` (constant and
  block-size-dependent dynamic shared memory, several block-size limits), and
  ``optimal_block_size(api="runtime")`` with the search of the runtime's C++
  ``cudaOccupancyMaxPotentialBlockSize`` (cuda_runtime.h), done here over the driver's
  active-block query,

reading each kernel's resources from the driver (``cuFuncGetAttribute``) and the device's limits
from its attributes (``SmResourceLimits.from_device``). The table entry of the device's compute
capability is compared too. Mismatches are printed (zero expected) and everything is written as
JSON to the path given.

Usage (on the GPU machine)::

    source .device/gpu-setup.sh && python3 benchmarks/occupancy_validation.py $OUT/occupancy.json

Exit status: 0 when everything matches, 1 on mismatches or errors, 2 when there is no CUDA GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import platform
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

KiB = 1024
BLOCK_SIZES = list(range(32, 1025, 32)) + [1, 17, 33, 100, 250, 1000]
CARVEOUTS = (-1, 0, 25, 50, 75, 100)
# Preferences the first H200 run did not try: where the driver's block-size search stops honouring
# the carveout (0 honoured; 25, 50, 75 searched as if there were none).
PROBE_CARVEOUTS = (1, 5, 10, 20, 80)


def write(path: str, doc: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


# ---------------------------------------------------------------- kernels


def heavy_source(n: int) -> str:
    """A kernel keeping ``n`` float64 values live across a loop (many registers unless capped)."""
    lines = ["def heavy(out, x, steps):",
             "    i = cuda.grid(1)",
             "    if i < x.size:",
             "        v = x[i]"]
    lines += [f"        a{k} = v * {1.0 + k / 97.0!r}" for k in range(n)]
    lines += ["        for s in range(steps):"]
    lines += [f"            a{k} = a{k} * a{(k + 1) % n} + {0.5 / (k + 1)!r}" for k in range(n)]
    lines += ["        out[i] = " + " + ".join(f"a{k}" for k in range(n))]
    return "\n".join(lines)


def build_kernels(cuda, numba_types) -> List[Dict[str, Any]]:
    """(name, dispatcher, signature, dynamic shared sizes to try, opt-in) for every kernel of the study."""
    f32, f64, i64 = numba_types.float32, numba_types.float64, numba_types.int64
    arr32 = f32[::1]
    arr64 = f64[::1]
    kernels: List[Dict[str, Any]] = []

    def add(name, disp, sig, dynamic=(0,), opt_in=False, carveouts=(-1,)):
        kernels.append(dict(name=name, disp=disp, sig=sig, dynamic=tuple(dynamic), opt_in=opt_in, carveouts=carveouts))

    def copy(out, x):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = x[i]

    add("copy", cuda.jit(copy), (arr32, arr32))

    def saxpy_grid_stride(out, x, a):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, x.size, stride):
            out[i] = a * x[i] + out[i]

    add("saxpy_grid_stride", cuda.jit(saxpy_grid_stride), (arr32, arr32, f32))

    scope: Dict[str, Any] = {"cuda": cuda}
    # 128 live float64 values want more than 255 registers (ptxas 13 for sm_90: 255 uncapped);
    # register caps then give every count of interest, odd ones included (37: the Best Practices example).
    exec(compile(heavy_source(128), "<heavy>", "exec"), scope)
    heavy = scope["heavy"]
    add("heavy_uncapped", cuda.jit(heavy), (arr64, arr64, i64))
    for cap in (24, 32, 37, 40, 56, 64, 72, 96, 128, 144, 168, 200, 232):
        add(f"heavy_maxreg{cap}", cuda.jit(heavy, max_registers=cap), (arr64, arr64, i64))

    # Static shared memory (numba allows up to the 48 KiB default per block).
    for kib in (1, 12, 40, 47):
        n = kib * KiB // 4
        src = (f"def static_{kib}k(out, x):\n"
               f"    buf = cuda.shared.array({n}, numba_float32)\n"
               f"    t = cuda.threadIdx.x\n"
               f"    i = cuda.grid(1)\n"
               f"    for j in range(t, {n}, cuda.blockDim.x):\n"
               f"        buf[j] = j\n"
               f"    cuda.syncthreads()\n"
               f"    if i < x.size:\n"
               f"        out[i] = x[i] + buf[(t * 7) % {n}]\n")
        scope = {"cuda": cuda, "numba_float32": f32}
        exec(compile(src, f"<static_{kib}k>", "exec"), scope)
        add(f"static_smem_{kib}KiB", cuda.jit(scope[f"static_{kib}k"]), (arr32, arr32), dynamic=(0, 1, 4 * KiB))

    def dyn(out, x):
        buf = cuda.shared.array(0, f32)
        t = cuda.threadIdx.x
        i = cuda.grid(1)
        buf[t] = x[i] if i < x.size else 0
        cuda.syncthreads()
        if i < x.size:
            out[i] = buf[cuda.blockDim.x - 1 - t]

    dynamic_sizes = (0, 1, 1000, 4 * KiB, 8 * KiB, 20 * KiB, 33 * KiB, 47 * KiB, 48 * KiB)
    add("dynamic_smem", cuda.jit(dyn), (arr32, arr32), dynamic=dynamic_sizes, carveouts=CARVEOUTS + PROBE_CARVEOUTS)
    optin_sizes = (48 * KiB + 4, 64 * KiB, 100 * KiB, 113 * KiB, 150 * KiB, 200 * KiB, 227 * KiB, 227 * KiB + 1)
    add("dynamic_smem_optin", cuda.jit(dyn), (arr32, arr32), dynamic=(0, 8 * KiB) + optin_sizes, opt_in=True,
        carveouts=(-1, 0, 50, 100))

    # Launch bounds make the kernel's own block limit smaller than the device's.
    add("copy_launch_bounds_256", cuda.jit(copy, launch_bounds=(256,)), (arr32, arr32))
    add("heavy_launch_bounds_640", cuda.jit(heavy, launch_bounds=(640,)), (arr64, arr64, i64))
    return kernels


# ---------------------------------------------------------------- driver access


class Driver:
    """The few driver calls we need, through cuda.bindings, raising on errors."""

    def __init__(self):
        from cuda.bindings import driver
        self.d = driver
        self.attr = driver.CUfunction_attribute

    def check(self, result, what: str):
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            name = self.d.cuGetErrorName(err)[1] if hasattr(self.d, "cuGetErrorName") else err
            raise RuntimeError(f"{what} failed: {name}")
        return values[0] if len(values) == 1 else tuple(values)

    def function(self, overload) -> Any:
        """The CUfunction of a compiled numba overload in the current context."""
        cufunc = overload.library.get_cufunc()
        handle = getattr(cufunc, "handle", cufunc)
        handle = getattr(handle, "handle", handle)  # a cuda.core Kernel object
        if isinstance(handle, self.d.CUfunction):
            return handle
        if isinstance(handle, self.d.CUkernel):  # context-less kernel: its function in this context
            return self.check(self.d.cuKernelGetFunction(handle), "cuKernelGetFunction")
        return self.d.CUfunction(int(handle))

    def get(self, f, name: str) -> int:
        return int(self.check(self.d.cuFuncGetAttribute(getattr(self.attr, name), f), f"cuFuncGetAttribute({name})"))

    def set(self, f, name: str, value: int) -> None:
        self.check(self.d.cuFuncSetAttribute(f, getattr(self.attr, name), int(value)), f"cuFuncSetAttribute({name}={value})")

    def active_blocks(self, f, block: int, dynamic: int) -> int:
        return int(self.check(self.d.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, block, dynamic),
                              "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def potential(self, f, dynamic: int, limit: int, b2d: Optional[Callable[[int], int]] = None):
        keep = None
        callback = None  # NULL: constant dynamic shared memory
        if b2d is not None:
            keep = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int)(lambda b: int(b2d(b)))
            callback = self.d.CUoccupancyB2DSize(ctypes.cast(keep, ctypes.c_void_p).value)
        grid, block = self.check(self.d.cuOccupancyMaxPotentialBlockSize(f, callback, dynamic, limit),
                                 "cuOccupancyMaxPotentialBlockSize")
        del keep
        return int(grid), int(block)

    def runtime_potential(self, f, smem_for: Callable[[int], int], limit: int, device_max_threads: int,
                          threads_per_sm: int, warp: int, sm_count: int):
        """(min grid, block) as the runtime's C++ cudaOccupancyMaxPotentialBlockSize finds them: its
        search (cuda_runtime.h), asking the driver's active-block query for every block size."""
        top = min(device_max_threads, self.get(f, "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"))
        if 0 < limit < top:
            top = limit
        best_block = best_blocks = best_threads = 0
        for aligned in range(-(-top // warp) * warp, 0, -warp):
            block = min(top, aligned)
            blocks = self.active_blocks(f, block, smem_for(block))
            if block * blocks > best_threads:
                best_block, best_blocks, best_threads = block, blocks, block * blocks
            if best_threads == threads_per_sm:
                break
        return best_blocks * sm_count, best_block


# ---------------------------------------------------------------- the study


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where to write the JSON results")
    args = parser.parse_args(argv)
    started = time.time()
    doc: Dict[str, Any] = {"benchmark": "occupancy_validation", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           "python": platform.python_version(), "status": "started"}

    try:
        import numba
        from numba import cuda
        from numba.core import types as numba_types
        doc["numba"] = numba.__version__
        try:
            import numba_cuda
            doc["numba_cuda"] = getattr(numba_cuda, "__version__", "?")
        except Exception:
            pass
        from optirs.core.simulator import cuda_simulator_enabled
        if cuda_simulator_enabled():
            raise RuntimeError("numba's CUDA simulator is enabled (NUMBA_ENABLE_CUDASIM=1)")
        if not cuda.is_available():
            raise RuntimeError("numba.cuda sees no CUDA GPU")
        device = cuda.get_current_device()
        drv = Driver()
    except Exception as exc:
        doc.update(status="skipped", reason=f"no CUDA GPU to validate against: {exc}")
        write(args.out, doc)
        print(f"occupancy_validation: skipped: {doc['reason']} (wrote {args.out})", file=sys.stderr)
        return 2

    from optirs.analysis.occupancy import (KernelResourceUsage, SmResourceLimits, calculate_occupancy,
                                           optimal_block_size)
    from optirs.plugin.registry import REGISTRY

    limits = SmResourceLimits.from_device(device)
    doc["device"] = {"name": limits.name, "compute_capability": limits.cc, "sm_count": limits.sm_count}
    doc["limits_from_device"] = dataclasses.asdict(limits)
    try:
        doc["cuda_driver_version"] = drv.check(drv.d.cuDriverGetVersion(), "cuDriverGetVersion")
        import importlib  # (``import cuda.bindings`` here would rebind ``cuda``, numba's module)
        doc["cuda_bindings"] = getattr(importlib.import_module("cuda.bindings"), "__version__", "?")
    except Exception as exc:
        doc["cuda_driver_version"] = f"? ({exc})"
    print(f"device: {limits.name}, CC {limits.cc}, {limits.sm_count} SMs; driver {doc['cuda_driver_version']}")

    # The table entry of this compute capability against the device's own report.
    table_diffs = {}
    try:
        table = SmResourceLimits.for_compute_capability(limits.compute_capability, sm_count=limits.sm_count)
        for fld in dataclasses.fields(SmResourceLimits):
            if fld.name in ("name", "source", "sm_count"):
                continue
            a, b = getattr(table, fld.name), getattr(limits, fld.name)
            if a != b:
                table_diffs[fld.name] = {"table": a, "device": b}
    except Exception as exc:
        table = None
        table_diffs["error"] = str(exc)
    doc["table_vs_device"] = table_diffs or "identical"
    print("table entry vs device attributes:", "identical" if not table_diffs else table_diffs)

    kernels_out: List[Dict[str, Any]] = []
    mismatches: List[Dict[str, Any]] = []
    table_mismatches = 0
    alt_mismatches = 0
    potential_out: List[Dict[str, Any]] = []
    errors: List[Dict[str, str]] = []
    compared = 0
    compared_potential = 0
    runtime_out: List[Dict[str, Any]] = []

    def compare_runtime(f, name, dynamic, smem_for, carveout, limit) -> Dict[str, Any]:
        grid, block = drv.runtime_potential(f, smem_for, limit, limits.max_threads_per_block,
                                            limits.max_threads_per_sm, limits.warp_size, limits.sm_count)
        s = optimal_block_size(limits, usage, smem_for, limit, carveout=carveout, api="runtime")
        return dict(kernel=name, dynamic=dynamic, carveout=carveout, limit=limit, runtime=[grid, block],
                    ours=[s.min_grid_size, s.block_size], match=(s.min_grid_size, s.block_size) == (grid, block))

    for spec in build_kernels(cuda, numba_types):
        name = spec["name"]
        record: Dict[str, Any] = {"name": name}
        kernels_out.append(record)
        try:
            disp = spec["disp"]
            disp.compile(spec["sig"])
            overload = disp.overloads[tuple(spec["sig"])]
            f = drv.function(overload)
            if spec["opt_in"]:
                static = drv.get(f, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")
                drv.set(f, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", limits.shared_mem_per_block_optin - static)
            usage = KernelResourceUsage(
                registers_per_thread=drv.get(f, "CU_FUNC_ATTRIBUTE_NUM_REGS"),
                static_shared_mem=drv.get(f, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"),
                max_threads_per_block=drv.get(f, "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
                max_dynamic_shared_mem=drv.get(f, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"),
                local_mem_per_thread=drv.get(f, "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES"),
            )
            record["usage"] = dataclasses.asdict(usage)
            # The numba dispatcher API (what the launch-config plugin reads) must agree with the driver.
            from_numba = KernelResourceUsage.from_kernel(disp)
            record["numba_api_agrees"] = (
                (from_numba.registers_per_thread, from_numba.static_shared_mem, from_numba.max_threads_per_block)
                == (usage.registers_per_thread, usage.static_shared_mem, usage.max_threads_per_block))
            n_before = len(mismatches)
            n_compared = 0
            for carveout in spec["carveouts"]:
                try:
                    drv.set(f, "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT", carveout)
                except Exception as exc:
                    errors.append({"kernel": name, "what": f"carveout {carveout}", "error": str(exc)})
                    continue
                for dynamic in spec["dynamic"]:
                    for block in BLOCK_SIZES:
                        theirs = drv.active_blocks(f, block, dynamic)
                        ours = calculate_occupancy(limits, usage, block, dynamic, carveout=carveout)
                        n_compared += 1
                        # cuda_occupancy.h ignores the kernel's own block limit (launch bounds) here;
                        # count what enforcing it would give too, so the driver's choice shows.
                        beyond = bool(usage.max_threads_per_block and block > usage.max_threads_per_block)
                        alt_mismatches += (0 if beyond else ours.active_blocks_per_sm) != theirs
                        if ours.active_blocks_per_sm != theirs:
                            mismatches.append(dict(kernel=name, block=block, dynamic=dynamic, carveout=carveout,
                                                   driver=theirs, ours=ours.active_blocks_per_sm,
                                                   beyond_kernel_max_threads=beyond,
                                                   limits=ours.block_limits, reason=ours.reason))
                        if table is not None:
                            t = calculate_occupancy(table, usage, block, dynamic, carveout=carveout)
                            table_mismatches += t.active_blocks_per_sm != theirs
                    for limit in (0, 1000, 256, 96):
                        grid, block = drv.potential(f, dynamic, limit)
                        s = optimal_block_size(limits, usage, dynamic, limit, carveout=carveout, api="driver")
                        ok = (s.min_grid_size, s.block_size) == (grid, block)
                        compared_potential += 1
                        potential_out.append(dict(kernel=name, dynamic=dynamic, carveout=carveout, limit=limit,
                                                  driver=[grid, block], ours=[s.min_grid_size, s.block_size], match=ok))
                        runtime_out.append(compare_runtime(f, name, dynamic, lambda _b, d=dynamic: d, carveout, limit))
                # Block-size-dependent dynamic shared memory (cudaOccupancyMaxPotentialBlockSizeVariableSMem).
                if spec["dynamic"] != (0,):
                    for per_thread in (4, 16, 48):
                        b2d = lambda b, k=per_thread: b * k  # noqa: E731
                        try:
                            grid, block = drv.potential(f, 0, 0, b2d)
                        except Exception as exc:
                            errors.append({"kernel": name, "what": f"variable smem {per_thread} B/thread", "error": str(exc)})
                            continue
                        s = optimal_block_size(limits, usage, b2d, 0, carveout=carveout, api="driver")
                        ok = (s.min_grid_size, s.block_size) == (grid, block)
                        compared_potential += 1
                        potential_out.append(dict(kernel=name, dynamic=f"{per_thread}*block", carveout=carveout, limit=0,
                                                  driver=[grid, block], ours=[s.min_grid_size, s.block_size], match=ok))
                        runtime_out.append(compare_runtime(f, name, f"{per_thread}*block", b2d, carveout, 0))
            drv.set(f, "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT", -1)
            record.update(compared=n_compared, mismatches=len(mismatches) - n_before)
            compared += n_compared
            # The plugin path the CUDA backend uses: (grid, block) for a million elements.
            config = REGISTRY.launch_config(kernel=disp, device=device, elements=1_000_000)
            record["launch_config_1M"] = list(config) if config else None
        except Exception as exc:
            errors.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)})
            record["error"] = str(exc)

    potential_mismatches = [p for p in potential_out if not p["match"]]
    runtime_mismatches = [p for p in runtime_out if not p["match"]]
    doc.update(
        status="done",
        block_sizes=BLOCK_SIZES,
        kernels=kernels_out,
        active_blocks={"compared": compared, "mismatches": len(mismatches), "mismatch_examples": mismatches[:50],
                       "table_entry_mismatches": table_mismatches,
                       "mismatches_if_kernel_max_threads_enforced": alt_mismatches},
        potential_block_size={"compared": compared_potential, "mismatches": len(potential_mismatches),
                              "mismatch_examples": potential_mismatches[:50], "all": potential_out},
        runtime_potential_block_size={"compared": len(runtime_out), "mismatches": len(runtime_mismatches),
                                      "all": runtime_out},
        errors=errors,
        seconds=round(time.time() - started, 1),
    )
    write(args.out, doc)

    print(f"\n{'kernel':<26} {'regs':>4} {'static':>7} {'maxthr':>6} {'compared':>8} {'mismatch':>8}  launch_config(1M)")
    for r in kernels_out:
        u = r.get("usage", {})
        print(f"{r['name']:<26} {u.get('registers_per_thread', '-'):>4} {u.get('static_shared_mem', '-'):>7} "
              f"{u.get('max_threads_per_block', '-'):>6} {r.get('compared', 0):>8} {r.get('mismatches', '-'):>8}  "
              f"{r.get('launch_config_1M', r.get('error', ''))}")
    for m in mismatches[:12]:
        print(f"MISMATCH active blocks: {m['kernel']} block={m['block']} dynamic={m['dynamic']} carveout={m['carveout']}: "
              f"driver {m['driver']}, ours {m['ours']} {m['limits']}"
              + (" (block above the kernel's max threads)" if m["beyond_kernel_max_threads"] else ""))
    for p in potential_mismatches[:12]:
        print(f"MISMATCH potential block size: {p['kernel']} dynamic={p['dynamic']} carveout={p['carveout']} "
              f"limit={p['limit']}: driver (grid, block) {p['driver']}, ours {p['ours']}")
    for p in runtime_mismatches[:12]:
        print(f"MISMATCH runtime potential block size: {p['kernel']} dynamic={p['dynamic']} carveout={p['carveout']} "
              f"limit={p['limit']}: runtime search (grid, block) {p['runtime']}, ours {p['ours']}")
    for e in errors[:12]:
        print("ERROR:", e["kernel"], e.get("what", ""), e["error"])
    print(f"\ncuOccupancyMaxActiveBlocksPerMultiprocessor: {compared} configurations, {len(mismatches)} mismatches "
          f"(table entry instead of device attributes: {table_mismatches}; "
          f"if the kernel's own max threads per block were enforced: {alt_mismatches})")
    print(f"cuOccupancyMaxPotentialBlockSize: {compared_potential} configurations, {len(potential_mismatches)} mismatches")
    print(f"runtime cudaOccupancyMaxPotentialBlockSize search: {len(runtime_out)} configurations, "
          f"{len(runtime_mismatches)} mismatches")
    print(f"errors: {len(errors)}; wrote {args.out}")
    return 0 if (not mismatches and not potential_mismatches and not runtime_mismatches and not errors
                 and table_mismatches == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
