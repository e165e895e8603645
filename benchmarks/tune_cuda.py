"""Tuning sweep for the CUDA step kernel: Adam on one flat tensor, per chunk size and launch shape.

    python benchmarks/tune_cuda.py [--elements 268435456] [--json tune.json]

Times the backend's Adam step hook (CUDA events, median of batches) against a device-to-device
copy of the same tensor, for the occupancy plugin's launch size and for "resident" grids
(as many blocks of a given size as stay resident on every SM).
"""

import argparse
import json
import statistics
import sys

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=256 * 2**20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from numba import cuda

    import optirs
    from optirs.backends.cuda import kernels as K
    from optirs.core.layout import TensorLayout
    from optirs.optim.optimizers import GpuAdam
    from optirs.plugin.registry import REGISTRY

    backend = optirs.get_backend("cuda")
    ctx = backend.ctx
    n = args.elements
    rng = np.random.default_rng(0)
    p = cuda.to_device(rng.random(n, dtype=np.float32))
    g = cuda.to_device(rng.random(n, dtype=np.float32) - np.float32(0.5))
    m = backend.alloc(ctx, n, np.float32, 0.0)
    v = backend.alloc(ctx, n, np.float32, 0.0)
    state = {"exp_avg": m, "exp_avg_sq": v}
    sc = GpuAdam().step_scalars(2)
    step = backend.step_fn("adam")
    staged = backend.stage(ctx, [p], [g])

    def timed(fn, reps=20, repeats=7):
        for _ in range(3):
            fn()
        out = []
        for _ in range(repeats):
            a, b = cuda.event(), cuda.event()
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / reps)
        return statistics.median(out)

    dst = cuda.device_array(n, np.float32)
    copy_ms = timed(lambda: dst.copy_to_device(g))
    copy_gbps = 8 * n / copy_ms / 1e6
    results = {"elements": n, "copy_gbps": copy_gbps, "variants": []}
    step(ctx, staged.params, staged.grads, state, TensorLayout([(n,)]), sc)  # compile
    compiled = [c for (name, _), c in ctx._compiled.items() if name == "adam"][0]
    results["regs"] = getattr(compiled.kernel, "regs_per_thread", None)
    for chunk in (2048, 4096, 8192, 16384, 32768):
        for launch in ("plugin", 256, 1024):
            layout = TensorLayout([(n,)])
            nchunks = len(layout.chunks(chunk)[0])
            if launch == "plugin":
                cfg = REGISTRY.launch_config(compiled.kernel, ctx.device, (n + 3) // 4)
                if cfg is None:
                    continue
                grid, block = min(int(cfg[0]), nchunks), int(cfg[1])
            else:
                block = launch
                per_sm = ctx.launcher.active_blocks(compiled.handle, block)
                grid = min(per_sm * ctx.sm_count, nchunks)
            layout.cache[("cuda.plan", "adam")] = (compiled, chunk, grid, block)
            ms = timed(lambda: step(ctx, staged.params, staged.grads, state, layout, sc))
            gbps = 28 * n / ms / 1e6
            row = {"chunk": chunk, "launch": str(launch), "grid": grid, "block": block, "ms": ms, "gbps": gbps,
                   "copy_fraction": gbps / copy_gbps}
            results["variants"].append(row)
            print(json.dumps(row), flush=True)
    del p, g, m, v, state, staged, dst
    # Host overhead: a small model (1M params, 50 tensors), wall time per step through step_gpu,
    # with the cached raw launch and with numba's own launch path.
    import time

    from optirs.tools.bench import case_sizes

    sizes = case_sizes("small", 1.0)
    ps = [cuda.to_device(rng.random(k, dtype=np.float32)) for k in sizes]
    gs = [cuda.to_device(rng.random(k, dtype=np.float32) - np.float32(0.5)) for k in sizes]
    for mode in ("raw", "numba"):
        opt = GpuAdam()
        opt.step_gpu(ps, gs)
        if mode == "numba":
            for prepared in ctx._launches.values():
                prepared.fn = None
        walls = []
        for _ in range(7):
            cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                opt.step_gpu(ps, gs)
            cuda.synchronize()
            walls.append((time.perf_counter() - t0) / 200 * 1e6)
        row = {"host_overhead": mode, "us_per_step": statistics.median(walls)}
        results.setdefault("host", []).append(row)
        print(json.dumps(row), flush=True)
    try:
        import torch

        tp = [torch.rand(k, device="cuda") for k in sizes]
        for t in tp:
            t.grad = torch.rand_like(t)
        topt = torch.optim.Adam(tp, lr=1e-3, fused=True)
        topt.step()
        walls = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                topt.step()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / 200 * 1e6)
        row = {"host_overhead": "torch fused Adam", "us_per_step": statistics.median(walls)}
        results.setdefault("host", []).append(row)
        print(json.dumps(row), flush=True)
    except Exception as exc:
        print("torch comparison skipped:", exc)
    best = max(results["variants"], key=lambda r: r["gbps"])
    print(f"copy {copy_gbps:.0f} GB/s; best {best}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
