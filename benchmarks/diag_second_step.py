"""Where a process's second ``opt.step()`` spends its host time, against the steps after it.

    python benchmarks/diag_second_step.py --device cuda --case float32 --mode phases
    python benchmarks/diag_second_step.py --device cuda --case bf16 --mode profile

The model and loop are ``bench_first_step.py``'s (an MLP of 1M parameters, a backward before every
step, only ``opt.step()`` timed, the device synchronized on both sides). Modes:

* ``times``: each step's time (ms) and the second over the median of the later ones;
* ``phases``: inclusive timers around the parts of the step (the front end's check and plan, the
  bucket's preparation, the transaction, the cuda backend's pointer tables and launches), in
  microseconds per step: the part that costs the second step more than the later ones;
* ``profile``: cProfile of steps 2 and 5 of the same process, the functions by how much more time
  they took in step 2 (call counts beside: a count that differs is a path only one step takes).

Run it with a warm kernel cache (run it once first, or after ``bench_first_step.py``): a cold
process compiles in its first step, which is not what this looks at.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import pstats
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

CASES = {"float32": ("float32", {}), "bf16": ("bfloat16", {"master_weights": "float32"}),
         "int8": ("float32", {"state_dtype": "int8"})}
# (module, attribute path) of the parts the phases mode times; a name the code lacks is reported
PHASES = [("optirs.torch._frontend", "OptirsOptimizer.step"), ("optirs.torch._frontend", "OptirsOptimizer._hyper"),
          ("optirs.torch._frontend", "_GroupPlan.current"), ("optirs.torch._buckets", "Bucket.prepare"),
          ("optirs.torch._buckets", "Bucket.grad_arrays"), ("optirs.optim.engine", "StepEngine.prepare_again"),
          ("optirs.torch._frontend", "run_steps"), ("optirs.optim.engine", "PreparedStep.launch"),
          ("optirs.torch._frontend", "OptirsOptimizer._commit"), ("optirs.backends.cuda.steps", "CudaSteps._pointwise"),
          ("optirs.backends.cuda.context", "CudaContext.pointer_table"),
          ("optirs.backends.cuda.context", "PointerTables.table"),
          ("optirs.backends.cuda.context", "CudaContext.launch"),
          ("optirs.backends.cuda.context", "PreparedLaunch.__call__")]


def timed_parts(acc: Dict[str, int]) -> List[str]:
    """Wrap each of PHASES with an inclusive timer adding to ``acc``; returns the names not found."""
    missing = []
    for module, path in PHASES:
        owner: Any = importlib.import_module(module)
        parts = path.split(".")
        try:
            for part in parts[:-1]:
                owner = getattr(owner, part)
            fn = getattr(owner, parts[-1])
        except AttributeError:
            missing.append(f"{module}.{path}")
            continue

        def timer(fn=fn, label=path):
            @functools.wraps(fn)
            def wrapped(*args, **kwargs):
                start = time.perf_counter_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    acc[label] = acc.get(label, 0) + time.perf_counter_ns() - start
            return wrapped

        setattr(owner, parts[-1], timer())
    return missing


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--case", choices=tuple(CASES), default="float32")
    ap.add_argument("--mode", choices=("times", "phases", "profile"), default="times")
    ap.add_argument("--steps", type=int, default=16, help="steps of the times mode (at least 3)")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error(f"--steps={args.steps}, expected at least 3")
    import torch

    import optirs.torch as ot

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"diag_second_step: torch {torch.__version__} sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    dtype_name, formats = CASES[args.case]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512)).to(device=args.device, dtype=dtype)
    x = torch.randn(64, 512, device=args.device, dtype=dtype)
    y = torch.randn(64, 512, device=args.device, dtype=dtype)
    opt = ot.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, backend=args.device, **formats)
    acc: Dict[str, int] = {}

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def one(profile: Optional[cProfile.Profile] = None) -> Tuple[float, Dict[str, int]]:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        sync()
        acc.clear()
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        opt.step()
        if profile is not None:
            profile.disable()
        sync()
        return time.perf_counter() - start, dict(acc)

    if args.mode == "times":
        times = [one()[0] for _ in range(args.steps)]
        print(f"{args.case} step ms: " + " ".join(f"{t * 1e3:.3f}" for t in times)
              + f" | second / steady {times[1] / statistics.median(times[2:]):.2f}x")
    elif args.mode == "phases":
        for name in timed_parts(acc):
            print(f"diag_second_step: {name} not found (the code moved): not timed", file=sys.stderr)
        rows = [one() for _ in range(8)]
        print(f"{args.case} step ms: " + " ".join(f"{t * 1e3:.3f}" for t, _ in rows))
        for key in sorted({k for _, a in rows for k in a}):
            print(f"  {key:34s} " + " ".join(f"{a.get(key, 0) / 1e3:8.1f}" for _, a in rows) + " us")
    else:
        one()
        profiles = []
        for _ in range(4):
            profile = cProfile.Profile()
            t, _ = one(profile)
            profiles.append((t, pstats.Stats(profile).stats))
        print(f"{args.case} profiled steps 2-5, ms: " + " ".join(f"{t * 1e3:.2f}" for t, _ in profiles))
        second, later = profiles[0][1], profiles[3][1]
        rows = []
        for key in set(second) | set(later):
            a, b = second.get(key, (0, 0, 0.0)), later.get(key, (0, 0, 0.0))
            rows.append((a[2] - b[2], a[2], b[2], a[1], b[1], f"{key[0].split('site-packages/')[-1]}:{key[1]}:{key[2]}"))
        rows.sort(reverse=True)
        print("  more in step 2 (us), step 2, step 5, calls 2, calls 5, function")
        for diff, a, b, ca, cb, name in rows[:30]:
            print(f"  {diff * 1e6:8.1f} {a * 1e6:8.1f} {b * 1e6:8.1f} {ca:5d} {cb:5d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
