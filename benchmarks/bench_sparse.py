"""SparseAdam vs dense Adam on one embedding table, on one backend.

A ``rows x dim`` float32 table (default 1M x 128, 512 MB) gets a gradient touching ``fraction``
of its rows per step (default 1%, unique random rows). Timed per step, same backend, same table:

- ``sparse_lazy``: optirs SparseAdam, LazyAdamMode.LAZY (touches only the present rows);
- ``sparse_dense_decay``: optirs SparseAdam, LazyAdamMode.DENSE_DECAY (every row, sparse input);
- ``dense_adam``: optirs GpuAdam on the same table with the zero-filled dense gradient;
- ``torch_sparse_adam``: torch.optim.SparseAdam on the same device, as the peer (when torch has it).

The speedup reported is dense_adam / sparse_lazy. Effective bandwidth counts the bytes each
method must move per step (Adam: read p, g, m, v and write p, m, v: 28 bytes per element it
updates). Runs unattended:

    python3 benchmarks/bench_sparse.py --backend cpu --json sparse-cpu.json
    source .device/gpu-setup.sh && python3 benchmarks/bench_sparse.py --backend cuda --json $OUT/sparse.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
import warnings
from typing import Any, Callable, Dict, List

import numpy as np


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("numba", "torch", "pyopencl"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            pass
    return out


class Dev:
    """Arrays and synchronization on the chosen backend (device-resident inputs: no transfers timed)."""

    def __init__(self, backend: str):
        import optirs

        self.backend = backend
        self.bound = optirs.get_backend(backend)  # the optimizers' backend: its synchronize hook
        if backend == "cuda":
            from numba import cuda

            self.cuda = cuda
            name = getattr(cuda.get_current_device(), "name", "numba CUDA simulator")
            self.name = name.decode() if isinstance(name, bytes) else name
        elif backend == "opencl":
            import optirs
            import pyopencl.array as cla

            self.cla = cla
            self.queue = optirs.get_backend("opencl").ctx.queue
            self.name = self.queue.device.name
        else:
            from optirs.backends.cpu import cpu_name

            self.name = cpu_name()

    def put(self, host: np.ndarray):
        if self.backend == "cuda":
            return self.cuda.to_device(host)
        if self.backend == "opencl":
            return self.cla.to_device(self.queue, host)
        return host

    def sync(self) -> None:
        self.bound.synchronize()


def timed(step: Callable[[int], None], dev: Dev, warmup: int, steps: int) -> Dict[str, float]:
    for t in range(warmup):
        step(t)
    dev.sync()
    times = []
    for t in range(steps):
        t0 = time.perf_counter()
        step(warmup + t)
        dev.sync()
        times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(np.min(times)), "steps": steps}


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "opencl"])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed dense steps (default 5 on cpu, 20 on a GPU); the sparse ones time 10x as many")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.optim.SparseAdam peer")
    ap.add_argument("--skip-dense-decay", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    steps = args.steps or (5 if args.backend == "cpu" else 20)

    from optirs import AdamParams, GpuAdam, GpuOptimizerConfig
    from optirs.optim.sparse import CooGradient, LazyAdamMode, SparseAdam, SparseAdamConfig

    dev = Dev(args.backend)
    rows, dim = args.rows, args.dim
    n = max(1, int(round(rows * args.fraction)))
    rng = np.random.default_rng(0)
    table0 = (0.01 * rng.standard_normal((rows, dim))).astype(np.float32)
    # A few distinct gradients, cycled, uploaded once (their upload is not part of a step).
    kinds = 2
    idx = [np.sort(rng.choice(rows, n, replace=False)).astype(np.int64) for _ in range(kinds)]
    host_vals = [rng.standard_normal((n, dim)).astype(np.float32) for _ in range(kinds)]
    vals = [dev.put(v) for v in host_vals]
    grads = [CooGradient(i, v) for i, v in zip(idx, vals)]
    results: Dict[str, Any] = {}
    elem_bytes = 28  # Adam: p, g, m, v read; p, m, v written (float32)

    def record(name: str, r: Dict[str, float], elements: int) -> None:
        r["elements_per_step"] = elements
        r["effective_GBps"] = elem_bytes * elements / (r["median_ms"] * 1e-3) / 1e9
        results[name] = r
        print(f"{name:>20}: {r['median_ms']:10.3f} ms/step (min {r['min_ms']:.3f}, {r['steps']} steps)  "
              f"({r['effective_GBps']:7.1f} GB/s effective)", flush=True)

    cfg = dict(lr=1e-3, backend=args.backend)
    for mode in [LazyAdamMode.LAZY] + ([] if args.skip_dense_decay else [LazyAdamMode.DENSE_DECAY]):
        table = dev.put(table0.copy())
        opt = SparseAdam(SparseAdamConfig(mode=mode, **cfg))
        lazy = mode is LazyAdamMode.LAZY
        # Lazy steps are cheap: time more of them so a noisy machine's median means something.
        r = timed(lambda t: opt.step(table, grads[t % kinds]), dev, args.warmup, steps * 10 if lazy else steps)
        record(f"sparse_{mode.value}", r, n * dim if mode is LazyAdamMode.LAZY else rows * dim)
        del opt, table
        gc.collect()

    # Dense Adam on the same table: the zero-filled gradients, device-resident.
    table = dev.put(table0.copy())
    dense_host = np.zeros((rows, dim), np.float32)
    dense = []
    for i, v in zip(idx, host_vals):
        dense_host[:] = 0
        dense_host[i] = v
        dense.append(dev.put(dense_host.copy()))
    del dense_host
    adam = GpuAdam(AdamParams(lr=1e-3), GpuOptimizerConfig(backend=args.backend))
    r = timed(lambda t: adam.step_gpu(table, dense[t % kinds]), dev, args.warmup, steps)
    record("dense_adam", r, rows * dim)
    del adam, table, dense
    gc.collect()

    if not args.no_torch:
        try:
            import torch

            tdev = {"cpu": "cpu", "cuda": "cuda"}.get(args.backend)
            if tdev is None or (tdev == "cuda" and not torch.cuda.is_available()):
                raise RuntimeError(f"no torch device for backend {args.backend}")
            p = torch.tensor(table0, device=tdev, requires_grad=True)
            topt = torch.optim.SparseAdam([p], lr=1e-3)
            with warnings.catch_warnings():  # torch notes that it skips sparse invariant checks
                warnings.simplefilter("ignore", UserWarning)
                tg = [torch.sparse_coo_tensor(torch.as_tensor(i, device=tdev)[None], torch.as_tensor(v, device=tdev),
                                              (rows, dim)).coalesce() for i, v in zip(idx, host_vals)]

            def tstep(t):
                p.grad = tg[t % kinds]
                topt.step()
                if tdev == "cuda":
                    torch.cuda.synchronize()

            record("torch_sparse_adam", timed(tstep, dev, args.warmup, steps * 10), n * dim)
            del p, topt, tg
        except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
            print(f"torch peer skipped: {exc}", flush=True)
            results["torch_sparse_adam"] = {"skipped": str(exc)}

    speedup = results["dense_adam"]["median_ms"] / results["sparse_lazy"]["median_ms"]
    print(f"speedup sparse (lazy) vs dense Adam: {speedup:.1f}x", flush=True)
    out = {
        "benchmark": "sparse_adam_vs_dense",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": args.backend,
        "device": dev.name,
        "machine": platform.node(),
        "versions": _versions(),
        "table": [rows, dim],
        "rows_touched": n,
        "fraction": args.fraction,
        "results": results,
        "speedup_lazy_vs_dense": speedup,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
