"""CPUOffload's step beside a Python thread that holds the GIL in bursts: the offload's GIL switch
interval (``optirs.torch._gil``) against Python's own, alternating in one process.

A step's chunk runs on a worker thread that needs the GIL around each kernel; a thread busy in
Python hands it over only at a blocking call or after the switch interval. The model is the 194
small tensors of GPT-2 1.3B's second param group (biases and layer norms, bf16 + remainder8 +
int8_sqrt state: one chunk), on CPU tensors; the busy thread counts in bursts of ``--burst``
iterations with a ``time.sleep(0)`` between them.

    python benchmarks/bench_offload_gil.py                      # bursts of 2e3, 2e4, 2e5 iterations
    python benchmarks/bench_offload_gil.py --bursts 0 --json g.json  # 0: no busy thread
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

SMALL = [2048, 2048, 6144, 2048, 2048, 2048, 8192, 2048] * 24 + [2048, 2048]  # GPT-2 1.3B's small tensors


def measure(burst: int, steps: int, reps: int) -> Dict[str, Any]:
    import torch

    import optirs.torch as ot
    import optirs.torch._gil as gil
    from optirs.torch.offload import OffloadTiming

    params = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in SMALL]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ot.CPUOffload(ot.AdamW, params, lr=1e-3, state_dtype="int8_sqrt", master_weights="remainder8")
    for _ in range(3):
        opt.step()
    running = [True]

    def busy() -> None:
        x = 0
        while running[0]:
            for _ in range(burst):
                x += 1
            time.sleep(0)

    thread = threading.Thread(target=busy, daemon=True) if burst else None
    if thread is not None:
        thread.start()
    lowered = gil.SWITCH_INTERVAL
    out: Dict[str, Dict[str, List[float]]] = {"python's interval": {"wall_ms": [], "cpu_step_ms": []},
                                              "the offload's": {"wall_ms": [], "cpu_step_ms": []}}
    try:
        for _ in range(reps):
            for mode, interval in (("python's interval", float("inf")), ("the offload's", lowered)):
                gil.SWITCH_INTERVAL = interval  # inf: never lowered
                opt.timing = OffloadTiming()
                t0 = time.perf_counter()
                for _ in range(steps):
                    opt.step()
                out[mode]["wall_ms"].append((time.perf_counter() - t0) / steps * 1e3)
                out[mode]["cpu_step_ms"].append(1e3 * opt.timing.cpu_step_s / opt.timing.steps)
    finally:
        gil.SWITCH_INTERVAL = lowered
        running[0] = False
        if thread is not None:
            thread.join()
    return {mode: {k: statistics.median(v) for k, v in row.items()} for mode, row in out.items()}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bursts", default="2000,20000,200000",
                    help="comma-separated iterations a burst of the busy thread (0: no busy thread)")
    ap.add_argument("--steps", type=int, default=10, help="steps a measurement")
    ap.add_argument("--reps", type=int, default=4, help="measurements of each interval (alternating; the median)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        bursts = [int(b) for b in args.bursts.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--bursts {args.bursts!r}: expected comma-separated integers >= 0")
    if not bursts or any(b < 0 for b in bursts) or args.steps < 1 or args.reps < 1:
        ap.error(f"--bursts {args.bursts!r}, --steps {args.steps}, --reps {args.reps}: expected integers >= 0, "
                 "and steps and reps >= 1")
    from rich.console import Console
    from rich.table import Table

    results: Dict[str, Any] = {"switch_interval_python": sys.getswitchinterval(), "rows": {}}
    table = Table(title="CPUOffload step beside a busy Python thread (194 small tensors, one chunk)")
    for col in ("burst (iterations)", "interval", "step wall ms", "chunk step ms", "wall vs python's"):
        table.add_column(col, justify="right" if col != "interval" else "left")
    for burst in bursts:
        row = measure(burst, args.steps, args.reps)
        results["rows"][str(burst)] = row
        base = row["python's interval"]["wall_ms"]
        for mode, r in row.items():
            print(f"bench_offload_gil: burst {burst}: {mode}: step {r['wall_ms']:.2f} ms, chunk step "
                  f"{r['cpu_step_ms']:.2f} ms", flush=True)
            table.add_row(str(burst), mode, f"{r['wall_ms']:.2f}", f"{r['cpu_step_ms']:.2f}", f"{r['wall_ms'] / base:.2f}")
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
