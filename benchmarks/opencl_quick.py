"""Quick OpenCL check: each optimizer's step as a fraction of same-run device copy bandwidth,
and the host cost of a step (what docs/opencl.md quotes).

    python benchmarks/opencl_quick.py [--elements 268435456] [--json out.json]

Runs on the device optirs' opencl backend picks (or the one given by --platform/--device, or
PYOPENCL_CTX). Every figure is a median of batches of back-to-back steps timed on the host
after a queue finish, on random (non-zero) data in arrays far larger than any cache; bytes are
what each kernel must move per element (Adam: read p, g, m, v, write p, m, v = 28 B). The same
run checks the stepped values against optirs.core.reference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform as pyplatform
import statistics
import sys
import time

import numpy as np

import optirs
from optirs.core import reference
from optirs.optim.optimizers import OPTIMIZERS

# name, hyperparameters, bytes per element, target fraction of copy
CASES = [
    ("adam", optirs.AdamParams(), 28, 0.95),
    ("adamw", optirs.AdamParams(weight_decay=0.01), 28, 0.95),
    ("sgd", optirs.SgdParams(lr=0.01, momentum=0.9), 20, 0.88),
    ("rmsprop", optirs.RmspropParams(), 20, 0.88),
    ("adagrad", optirs.AdagradParams(), 20, 0.88),
    # two passes: moments (read g, m, v, p; write m, v) + apply (read p, m, v; write p)
    ("lamb", optirs.LambParams(), 40, 0.75),
]


def timed(fn, finish, reps: int, batches: int) -> float:
    """Median seconds per call over ``batches`` batches of ``reps`` back-to-back calls."""
    per_call = []
    for _ in range(batches):
        finish()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        finish()
        per_call.append((time.perf_counter() - t0) / reps)
    return statistics.median(per_call)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--platform", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", action="store_true", help="also time a 300-tensor model (separate buffers)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import pyopencl as cl
    import pyopencl.array as cla

    opts = {k: (int(v) if v.isdigit() else v) for k, v in (("platform", args.platform), ("device", args.device)) if v}
    cfg = optirs.GpuOptimizerConfig(backend="opencl", options=opts)
    backend = optirs.get_backend("opencl", **opts)
    ctx, q = backend.ctx, backend.ctx.queue
    dev = ctx.device
    n = args.elements
    rng = np.random.default_rng(7)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.name.strip(), "platform": ctx.platform.name.strip(), "opencl": dev.version.strip(),
        "driver": dev.driver_version.strip(), "pyopencl": cl.VERSION_TEXT, "numpy": np.__version__,
        "python": pyplatform.python_version(), "build_options": ctx.build_options, "elements": n, "rows": [],
    }
    finish = q.finish

    # Device-to-device copy of n float32 (read + write), the limit every step is compared to.
    src = cla.to_device(q, rng.standard_normal(n, dtype=np.float32))
    dst = cla.empty(q, n, np.float32)
    copy_s = timed(lambda: cl.enqueue_copy(q, dst.base_data, src.base_data, byte_count=4 * n), finish,
                   args.reps, args.batches)
    copy_bw = 8 * n / copy_s
    result["copy_GBps"] = copy_bw / 1e9
    print(f"copy: {copy_s * 1e3:.3f} ms  {copy_bw / 1e9:.0f} GB/s", flush=True)
    del dst

    p = src
    g = cla.to_device(q, rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2))
    for name, hp, nbytes, target in CASES:
        opt = OPTIMIZERS[name](hp, cfg)
        opt.step_gpu(p, g)  # allocate state, build nothing more (kernels exist)
        secs = timed(lambda: opt.step_gpu(p, g), finish, args.reps, args.batches)
        bw = nbytes * n / secs
        row = {"optimizer": name, "elements": n, "bytes_per_element": nbytes, "ms": secs * 1e3,
               "GBps": bw / 1e9, "fraction_of_copy": bw / copy_bw, "target": target}
        result["rows"].append(row)
        print(f"{name:8s} {secs * 1e3:8.3f} ms {bw / 1e9:7.0f} GB/s  {bw / copy_bw:6.1%} of copy (target {target:.0%})",
              flush=True)
        del opt

    # LAMB with global gradient clipping: one more read of g (44 B) and two more launches.
    opt = optirs.GpuLamb(optirs.LambParams(max_grad_norm=1.0), cfg)
    opt.step_gpu(p, g)
    secs = timed(lambda: opt.step_gpu(p, g), finish, args.reps, args.batches)
    result["rows"].append({"optimizer": "lamb+clip", "elements": n, "bytes_per_element": 44, "ms": secs * 1e3,
                           "GBps": 44 * n / secs / 1e9, "fraction_of_copy": 44 * n / secs / copy_bw, "target": 0.75})
    print(f"lamb+clip {secs * 1e3:7.3f} ms {44 * n / secs / 1e9:7.0f} GB/s  {44 * n / secs / copy_bw:6.1%} of copy",
          flush=True)
    del opt, p, g, src

    # Correctness in the same run: one Adam step on 1M elements against the float64 reference.
    m = 1 << 20
    hp = optirs.AdamParams(weight_decay=0.01)
    hp_p, hp_g = rng.standard_normal(m, dtype=np.float32), rng.standard_normal(m, dtype=np.float32)
    dp = cla.to_device(q, hp_p)
    optirs.GpuAdamW(hp, cfg).step_gpu(dp, cla.to_device(q, hp_g))
    (want,), _ = reference.adamw([hp_p], [hp_g], [{}], hp, 1)
    err = float(np.max(np.abs(dp.get() - want)) / np.max(np.abs(want)))
    result["adamw_max_rel_error_vs_reference"] = err
    print(f"check: AdamW 1M max error / max |p| = {err:.2e}", flush=True)

    # Host cost of one step on a small array (the device keeps up, so this is the enqueue path).
    small_p = cla.to_device(q, rng.standard_normal(4096, dtype=np.float32))
    small_g = cla.to_device(q, rng.standard_normal(4096, dtype=np.float32))
    opt = optirs.GpuAdam(optirs.AdamParams(), cfg)
    for _ in range(50):
        opt.step_gpu(small_p, small_g)
    finish()
    hook = backend.step_fn("adam")
    state, layout, scal = opt._state, opt._layout, opt.step_scalars(51)
    kernel = ctx.kernels["adam_flat4"]
    rec = np.array(tuple(scal), ctx.records["adam"])
    s = [state["exp_avg"].base_data, state["exp_avg_sq"].base_data, ctx.dummy]

    def per_call(fn, count=2000):
        ts = []
        for _ in range(count):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        finish()
        return statistics.median(ts) * 1e6

    result["host_us"] = {
        "step_gpu": per_call(lambda: opt.step_gpu(small_p, small_g)),
        "step_hook": per_call(lambda: hook(ctx, [small_p], [small_g], state, layout, scal)),
        "kernel_enqueue": per_call(lambda: kernel(q, (1024,), (ctx.work_group,), small_p.base_data, 0,
                                                  small_g.base_data, 0, *s, 0, 4096, rec)),
    }
    print("host us per step (median): " + ", ".join(f"{k} {v:.1f}" for k, v in result["host_us"].items()), flush=True)

    if args.model:
        # 300 tensors, 134M elements, separate buffers: chunked kernel, ceil(300 / SLOTS) launches.
        shapes = [(1024, 1280), (1280,), (1280, 4)] * 100
        total = sum(int(np.prod(s)) for s in shapes)
        ps = [cla.to_device(q, rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        gs = [cla.to_device(q, rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        opt = optirs.GpuAdam(optirs.AdamParams(), cfg)
        opt.step_gpu(ps, gs)
        secs = timed(lambda: opt.step_gpu(ps, gs), finish, args.reps, args.batches)
        bw = 28 * total / secs
        result["model_300_separate"] = {"elements": total, "ms": secs * 1e3, "GBps": bw / 1e9,
                                        "fraction_of_copy": bw / copy_bw}
        print(f"adam 300 tensors {total} elements, separate buffers: {secs * 1e3:.3f} ms, {bw / copy_bw:.1%} of copy",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
