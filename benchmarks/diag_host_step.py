"""The float32 AdamW step of a whole model on the host: optirs' cpu backend beside torch's fused CPU AdamW.

CPU offload's float32 row adds what its CPU step takes, less what overlaps; torchao's offload steps
with torch's fused CPU AdamW. A step of one chunk that fits the last-level cache says nothing of
either (the H200 host's 300 MB L3 held a 16M-element chunk), so this steps every tensor of a model
(GPT-2 1.3B shapes by default: 1.31G parameters, 21 GB of float32 p, g, m, v) as one optimizer
would, at each thread count asked, with a parallel host copy of 2 GB beside:

    python benchmarks/diag_host_step.py --shapes 1.3b --threads 16,12,8 --steps 3
    python benchmarks/diag_host_step.py --shapes 124m --threads 2          # a quick look anywhere

Each row's figure is the median step and its GB/s at 28 bytes a parameter (p, g, m, v read; p, m, v
written). ``optirs (free cores)`` steps as CPUOffload does, on the threads its backend picks from
the cores other processes leave free; the other optirs rows force numba's thread count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's optirs, not another installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ncu_formats import gpt2_shapes  # noqa: E402  (the same model shapes as the GPU kernels' profile)


def median_ms(fn: Callable[[], None], steps: int) -> float:
    fn()  # compiled, state allocated
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_gbps(torch) -> float:
    """A parallel host copy of 2 GB (torch ``copy_`` on its threads): bytes read + written per second."""
    src = torch.ones(1 << 29)
    dst = torch.empty_like(src)
    return 8 * (1 << 29) / median_ms(lambda: dst.copy_(src), 5) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=("124m", "1.3b"), default="1.3b")
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default: every core)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    import os

    import numba
    import torch

    import optirs.torch as ot

    cores = os.cpu_count() or 1
    try:
        counts = [int(t) for t in args.threads.split(",") if t.strip()] or [cores]
    except ValueError:
        print(f"--threads takes comma-separated integers, got {args.threads!r}", file=sys.stderr)
        return 2
    if any(t < 1 or t > numba.config.NUMBA_NUM_THREADS for t in counts):
        print(f"--threads must be within 1..{numba.config.NUMBA_NUM_THREADS}, got {counts}", file=sys.stderr)
        return 2
    shapes = gpt2_shapes(args.shapes)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    print(f"diag_host_step: {len(shapes)} tensors, {n} parameters ({28 * n / 1e9:.1f} GB moved a step), "
          f"torch {torch.__version__}, numba {numba.__version__}, {cores} cores", flush=True)

    def model():  # filled, not drawn: 21 GB of random numbers take minutes, and the step's time does not care
        ps = [torch.empty(s).fill_(0.02) for s in shapes]
        for p in ps:
            p.grad = torch.empty(p.shape).fill_(1e-3)
        return ps

    rows = []
    for t in counts:
        torch.set_num_threads(t)
        print(f"  torch copy of 2 GB, {t} threads: {copy_gbps(torch):.1f} GB/s", flush=True)
        ps = model()
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True)
        rows.append((f"torch fused AdamW, {t} threads", median_ms(opt.step, args.steps)))
        print(f"  {rows[-1][0]}: {rows[-1][1]:.1f} ms, {28 * n / rows[-1][1] / 1e6:.1f} GB/s", flush=True)
        del opt, ps
        ps = model()
        opt = ot.AdamW(ps, lr=1e-3, weight_decay=0.1, backend="cpu")
        numba.set_num_threads(t)
        rows.append((f"optirs AdamW (cpu backend), {t} threads", median_ms(opt.step, args.steps)))
        print(f"  {rows[-1][0]}: {rows[-1][1]:.1f} ms, {28 * n / rows[-1][1] / 1e6:.1f} GB/s", flush=True)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        del opt, ps
    torch.set_num_threads(cores)
    ps = model()
    opt = ot.AdamW(ps, lr=1e-3, weight_decay=0.1, backend="cpu")
    rows.append(("optirs AdamW (cpu backend), free cores", median_ms(opt.step, args.steps)))
    print(f"  {rows[-1][0]}: {rows[-1][1]:.1f} ms, {28 * n / rows[-1][1] / 1e6:.1f} GB/s", flush=True)
    print(f"\n{'row':48s} {'ms':>9s} {'GB/s':>8s}")
    for name, ms in rows:
        print(f"{name:48s} {ms:9.1f} {28 * n / ms / 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
