"""Device allocation time with and without optirs' MemoryPool installed as numba's memory manager.

    source .device/gpu-setup.sh && python3 benchmarks/bench_memory_pool.py $OUT/pool.json

numba's memory manager can only be chosen before the first CUDA context exists, so each mode
runs in its own child process: ``default`` (numba's own cuMemAlloc/deferred cuMemFree) and
``pool`` (optirs.memory.pool.install()). Each child measures, per size, the time of an
allocate + release pair (``cuda.device_array`` then dropping it, pending frees flushed inside
the timed region), a mixed training-like pattern of many sizes, and, in pool mode, checks that
the wiring is right: pool-backed arrays keep their own data, an optirs Adam step on device arrays
matches the reference with its state taken from the pool, and the limit raises DeviceMemoryError.
Without a GPU it says so and exits with status 2 (writing the reason to the JSON file).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time

SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
REPEATS = {512: 2000, 4 << 10: 2000, 64 << 10: 2000, 1 << 20: 1000, 4 << 20: 500, 16 << 20: 300,
           64 << 20: 200, 256 << 20: 100}
MIXED_OPS = 4000


def _flush(cuda) -> None:
    # numba defers cuMemFree; count the frees inside the timed region
    cuda.current_context().memory_manager.deallocations.clear()


def _time_sizes(cuda, np):
    out = {}
    for size in SIZES:
        n = REPEATS[size]
        for _ in range(5):  # warm-up (and, in pool mode, the first segment)
            cuda.device_array(size, np.uint8)
        _flush(cuda)
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            a = cuda.device_array(size, np.uint8)
            del a
        _flush(cuda)
        cuda.synchronize()
        out[str(size)] = (time.perf_counter() - t0) / n * 1e6
    return out


def _time_mixed(cuda, np):
    """Log-uniform sizes 1 KiB..64 MiB, a working set of at most 32 live arrays, random frees."""
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(1 << 10), np.log(64 << 20), MIXED_OPS)).astype(np.int64)
    frees = rng.random(MIXED_OPS) < 0.5
    picks = rng.integers(0, 1 << 30, MIXED_OPS)
    live = []
    cuda.synchronize()
    t0 = time.perf_counter()
    for size, free, pick in zip(sizes, frees, picks):
        if (free or len(live) >= 32) and live:
            live.pop(int(pick) % len(live))
        else:
            live.append(cuda.device_array(int(size), np.uint8))
    live.clear()
    _flush(cuda)
    cuda.synchronize()
    return (time.perf_counter() - t0) / MIXED_OPS * 1e6


def _checks(cuda, np):
    """Pool mode only: the wiring on the real device."""
    import optirs
    from optirs.core import reference
    from optirs.memory import current_pool

    pool = current_pool()
    res = {"pool_installed": pool is not None}
    if pool is None:
        return res
    # 1. Many live pool-backed arrays keep their own data (no overlapping blocks).
    rng = np.random.default_rng(1)
    hosts = [rng.integers(0, 255, int(s), dtype=np.uint8) for s in rng.integers(1, 3 << 20, 64)]
    devs = [cuda.to_device(h) for h in hosts]
    res["data_intact"] = all(np.array_equal(d.copy_to_host(), h) for d, h in zip(devs, hosts))
    del devs
    # 2. An optirs step on device arrays: state buffers come from the pool, result matches the reference.
    p = rng.standard_normal(1 << 20).astype(np.float32)
    g = rng.standard_normal(1 << 20).astype(np.float32)
    opt = optirs.GpuAdam(optirs.AdamParams(lr=1e-2), config=optirs.GpuOptimizerConfig(backend="cuda"))
    dp, dg = cuda.to_device(p), cuda.to_device(g)
    cuda.synchronize()
    before = pool.stats().bytes_in_use
    opt.step_gpu(dp, dg)  # allocates exp_avg and exp_avg_sq (4 MiB each) on the device
    cuda.synchronize()
    ref, _ = reference.adam([p], [g], [{}], optirs.AdamParams(lr=1e-2), 1)
    res["adam_max_abs_err"] = float(np.max(np.abs(dp.copy_to_host() - ref[0])))
    res["optimizer_state_from_pool"] = pool.stats().bytes_in_use - before >= 4 * 2 * (1 << 20)
    # 3. The limit.
    pool.limit = pool.stats().bytes_reserved + (64 << 20)
    try:
        cuda.device_array(1 << 30, np.uint8)
        res["limit_raises"] = False
    except optirs.DeviceMemoryError as exc:
        res["limit_raises"] = True
        res["limit_message"] = str(exc)
    pool.limit = None
    return res


def child(mode: str) -> None:
    import numpy as np

    if mode == "pool":
        from optirs.memory import pool as poolmod

        poolmod.install()
    from numba import cuda

    cuda.current_context()
    dev = cuda.get_current_device()
    result = {"mode": mode, "device": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
              "cc": list(dev.compute_capability), "manager": type(cuda.current_context().memory_manager).__name__}
    result["alloc_free_us"] = _time_sizes(cuda, np)
    result["mixed_us_per_op"] = _time_mixed(cuda, np)
    if mode == "pool":
        result["checks"] = _checks(cuda, np)
        s = poolmod.current_pool().stats()
        result["pool_stats"] = {k: getattr(s, k) for k in s.__dataclass_fields__}
    print(json.dumps(result))


def _no_gpu_reason():
    try:
        from numba import config, cuda
    except Exception as exc:  # pragma: no cover - numba is a dependency
        return f"numba.cuda is not importable: {exc}"
    if config.ENABLE_CUDASIM:
        return "NUMBA_ENABLE_CUDASIM=1: the simulator has no device memory to pool"
    try:
        if not cuda.is_available():
            return "no CUDA GPU or driver here (numba.cuda.is_available() is False)"
    except Exception as exc:
        return f"CUDA is not usable here: {exc}"
    return None


def main(argv) -> int:
    if len(argv) == 3 and argv[1] == "--child":
        child(argv[2])
        return 0
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT.json", file=sys.stderr)
        return 2
    out_path = argv[1]
    reason = _no_gpu_reason()
    if reason:
        print(f"bench_memory_pool: {reason}; nothing measured", file=sys.stderr)
        with open(out_path, "w") as f:
            json.dump({"error": reason}, f)
        return 2
    results = {}
    for mode in ("default", "pool"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode],
                              capture_output=True, text=True, timeout=500)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
            results[mode] = {"error": proc.stderr[-2000:]}
            continue
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    import numba

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "python": platform.python_version(), "numba": numba.__version__,
              **results}
    d, p = results.get("default", {}), results.get("pool", {})
    rows = []
    if "alloc_free_us" in d and "alloc_free_us" in p:
        report["speedup"] = {k: d["alloc_free_us"][k] / p["alloc_free_us"][k] for k in d["alloc_free_us"]}
        report["speedup"]["mixed"] = d["mixed_us_per_op"] / p["mixed_us_per_op"]
        for k in d["alloc_free_us"]:
            rows.append((f"{int(k):>11,d} B", d["alloc_free_us"][k], p["alloc_free_us"][k], report["speedup"][k]))
        rows.append(("mixed 1K-64M", d["mixed_us_per_op"], p["mixed_us_per_op"], report["speedup"]["mixed"]))
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"device: {p.get('device') or d.get('device')}  cc {p.get('cc') or d.get('cc')}  numba {numba.__version__}")
    if "checks" in p:
        print("pool checks:", json.dumps(p["checks"]))
    print(f"{'size':>14}  {'numba us':>10}  {'pool us':>10}  {'speedup':>8}")
    for name, a, b, s in rows:
        print(f"{name:>14}  {a:10.2f}  {b:10.2f}  {s:8.1f}x")
    checks = p.get("checks", {})
    ok = bool(rows) and all(checks.get(k) for k in ("pool_installed", "data_intact", "limit_raises",
                                                    "optimizer_state_from_pool"))
    ok = ok and checks.get("adam_max_abs_err", 1.0) < 1e-5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
