"""Data-parallel optimizer step: per-rank state memory and step time, allreduce vs zero1 vs one device.

Launch with torchrun, one process per GPU (NCCL), or per CPU process (gloo) for a smoke test:

    source .device/gpu-setup.sh && torchrun --standalone --nproc_per_node=2 \\
        benchmarks/bench_sharded.py --json $OUT/sharded.json
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py --backend cpu --numel 2e6 --steps 3

For each optimizer (Adam, LAMB) it times, on a model of ``--tensors`` tensors holding ``--numel``
float32 parameters in all:

- ``single``: the plain optimizer on one device (rank 0 alone, before the others join in);
- ``allreduce``: DataParallelOptimizer(mode="allreduce") on every rank;
- ``zero1``: DataParallelOptimizer(mode="zero1") on every rank.

Reported per rank: optimizer state bytes held, the wrapper's communication buffers, and the median
step time (gradients already on the device; the step includes the collectives). Rank 0 writes
the JSON. The 2-GPU machine was not lent when this was written: these figures are still to be
measured (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List

import numpy as np


def _model(numel: int, tensors: int, device, torch, seed: int = 0):
    sizes = np.full(tensors, numel // tensors, dtype=np.int64)
    sizes[: numel % tensors] += 1
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(0.01 * torch.randn(int(n), generator=g)).to(device) for n in sizes]


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="optirs backend (NCCL for cuda, gloo for cpu)")
    ap.add_argument("--numel", type=float, default=256e6, help="parameters in the model (float32)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optimizers", default="adam,lamb")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from optirs import AdamParams, GpuAdam, GpuLamb, GpuOptimizerConfig, LambParams
    from optirs.optim.data_parallel import DataParallelOptimizer, init_process_group_from_env

    rank, world = init_process_group_from_env("nccl" if args.backend == "cuda" else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "cuda" else torch.device("cpu")
    numel = int(args.numel)
    cfg = GpuOptimizerConfig(backend=args.backend)
    make = {"adam": lambda: GpuAdam(AdamParams(lr=1e-4), cfg),
            "lamb": lambda: GpuLamb(LambParams(lr=1e-4, max_grad_norm=1.0), cfg)}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def as_arrays(ts):
        return [t.numpy() for t in ts] if device.type == "cpu" else ts

    def timed(opt, params, grads, together=True):
        for _ in range(args.warmup):
            opt.step_gpu(params, grads)
        sync()
        times = []
        for _ in range(args.steps):
            if together and world > 1:
                dist.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            opt.step_gpu(params, grads)
            sync()
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times))

    results: Dict[str, Any] = {}
    for name in args.optimizers.split(","):
        params = _model(numel, args.tensors, device, torch)
        grads = _model(numel, args.tensors, device, torch, seed=rank + 1)
        row: Dict[str, Any] = {}
        if rank == 0:
            plain = make[name]()
            ms = timed(plain, as_arrays(params), as_arrays(grads), together=False)
            row["single"] = {"step_ms": ms, "state_bytes": numel * 4 * len(plain.state_slots(plain.params))}
            del plain
        if world > 1:
            dist.barrier()
        for mode in ("allreduce", "zero1"):
            opt = DataParallelOptimizer(make[name](), mode=mode)
            ms = timed(opt, as_arrays(params), as_arrays(grads))
            buffers = sum(b.numel() * 4 for b in opt._buffers.values())
            mine = torch.tensor([ms, float(opt.state_bytes()), float(buffers)], dtype=torch.float64, device=device)
            gathered = [mine]
            if world > 1:
                gathered = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine)
            row[mode] = [{"rank": r, "step_ms": float(g[0]), "state_bytes": int(g[1]), "buffer_bytes": int(g[2])}
                         for r, g in enumerate(gathered)]
            del opt
        results[name] = row
        if rank == 0:
            print(name, json.dumps(row), flush=True)
    out = {
        "benchmark": "sharded_optimizer_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world": world, "backend": args.backend, "numel": numel, "tensors": args.tensors,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "nccl": str(torch.cuda.nccl.version()) if device.type == "cuda" else None},
        "results": results,
    }
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
