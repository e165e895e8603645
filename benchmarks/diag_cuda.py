"""Diagnostics for the CUDA step kernels on one flat tensor: launch shapes, registers, and data.

    python benchmarks/diag_cuda.py [--elements N] [--json diag.json]

For Adagrad and RMSprop (same byte count, 20 B/element) it times the backend's step hook with the
occupancy plugin's launch size and with resident grids, on gradients of two scales, and with
variants of the element formula that isolate the division and the square root (variants that
change rounding are for diagnosis only).
"""

import argparse
import json
import math
import statistics
import sys

import numba
import numpy as np


@numba.njit
def _div_outside(p, g, acc, unused1, unused2, sc):
    acc = acc + g * g
    return p - sc.clr * (g / (math.sqrt(acc) + sc.eps)), acc, unused1, unused2


@numba.njit
def _no_div(p, g, acc, unused1, unused2, sc):  # diagnosis only: reciprocal-multiply rounding
    acc = acc + g * g
    return p - sc.clr * (sc.eps + math.sqrt(acc)) * g, acc, unused1, unused2


@numba.njit
def _no_sqrt(p, g, acc, unused1, unused2, sc):  # diagnosis only
    acc = acc + g * g
    return p - sc.clr * g / (acc + sc.eps), acc, unused1, unused2


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=256 * 2**20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from numba import cuda

    import optirs
    from optirs.backends.cuda import kernels as K
    from optirs.backends.cuda import device_address
    from optirs.core.layout import TensorLayout
    from optirs.optim.optimizers import GpuAdagrad, GpuRmsprop
    from optirs.plugin.registry import REGISTRY

    backend = optirs.get_backend("cuda")
    ctx = backend.ctx
    n = args.elements
    rng = np.random.default_rng(0)
    p = cuda.to_device(rng.random(n, dtype=np.float32) - np.float32(0.5))
    g_host = rng.random(n, dtype=np.float32) - np.float32(0.5)
    grads = {"g~U(-.005,.005)": cuda.to_device(g_host * np.float32(0.01)), "g~U(-.5,.5)": cuda.to_device(g_host)}
    del g_host

    def timed(fn, reps=20, repeats=5):
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
    copy_gbps = 8 * n / timed(lambda: dst.copy_to_device(p)) / 1e6
    del dst
    rows = []
    s0 = backend.alloc(ctx, n, np.float32, 0.0)
    state_addr = device_address(s0)
    variants = [("adagrad", K.STEP_FUNCTIONS["adagrad"], GpuAdagrad().step_scalars(2)),
                ("rmsprop", K.STEP_FUNCTIONS["rmsprop"], GpuRmsprop().step_scalars(2)),
                ("adagrad_div_outside", K._make_step_kernel(_div_outside), GpuAdagrad().step_scalars(2)),
                ("adagrad_no_div(diag)", K._make_step_kernel(_no_div), GpuAdagrad().step_scalars(2)),
                ("adagrad_no_sqrt(diag)", K._make_step_kernel(_no_sqrt), GpuAdagrad().step_scalars(2))]
    for gname, g in grads.items():
        for vname, fn, sc in variants:
            for launch in ("plan", 256, 1024):
                layout = TensorLayout([(n,)])
                compiled, chunk, grid, block = ctx.plan(vname, fn, "step", sc, layout)
                if launch != "plan" and launch > getattr(compiled.kernel, "max_threads_per_block", 1024):
                    continue  # too many registers for blocks this large
                if launch != "plan":
                    per_sm = ctx.launcher.active_blocks(compiled.handle, launch) if ctx.launcher else 1
                    chunk, block = K.CHUNK, launch
                    grid = min(len(layout.chunks(chunk)[0]), per_sm * ctx.sm_count)
                    layout.cache[("cuda.plan", vname)] = (compiled, chunk, grid, block)
                chunks, nchunks = ctx.chunk_table(layout, chunk)
                ptrs = ctx.pointer_table(layout, (device_address(p),), (device_address(g),))
                argv_ = (chunks, ptrs, nchunks, state_addr, 0, 0, 1, sc)
                ms = timed(lambda: ctx.launch(compiled, argv_, grid, block))
                row = {"grads": gname, "variant": vname, "launch": str(launch), "chunk": chunk, "grid": grid,
                       "block": block, "regs": getattr(compiled.kernel, "regs_per_thread", None), "ms": ms,
                       "copy_fraction": 20 * n / ms / 1e6 / copy_gbps}
                rows.append(row)
                print(json.dumps(row), flush=True)
    # The plan every optimizer's kernels get on this tensor (occupancy plugin + chunk rule).
    from optirs.optim.optimizers import OPTIMIZERS

    for name, cls in OPTIMIZERS.items():
        layout = TensorLayout([(n,)])
        opt = cls()
        st = {k: backend.alloc(ctx, n, np.float32, float(v)) for k, v in opt.state_slots(opt.params).items()}
        staged = backend.stage(ctx, [p], [grads["g~U(-.005,.005)"]])
        backend.step_fn(name)(ctx, staged.params, staged.grads, st, layout, opt.step_scalars(1))
        for key, value in layout.cache.items():
            if isinstance(key, tuple) and key[0] == "cuda.plan":
                compiled, chunk, grid, block = value
                row = {"plan": key[1], "optimizer": name, "regs": getattr(compiled.kernel, "regs_per_thread", None),
                       "chunk": chunk, "grid": grid, "block": block}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del st
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
