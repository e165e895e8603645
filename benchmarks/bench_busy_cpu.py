"""examples/train_torch.py quiet and with the cores busy: optirs.torch.AdamW's and torch.optim.AdamW's
median opt.step() in the same process, per run, and their ratio.

Busy means ``--busy`` (default: one per core) Python busy loops running beside the example. Each
condition runs ``--runs`` times, alternating, so a change in what else the machine runs falls on
both; the load average is recorded with every run (on a shared machine "quiet" is only quieter).

    python benchmarks/bench_busy_cpu.py --runs 3 --json benchmarks/results/cpu-busy-train-torch.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(torch\.optim\.AdamW|optirs\.torch\.AdamW)\s.*median step\s+([\d.]+) us", re.M)


def one_run(steps: int, busy: int) -> dict:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0)
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_torch.py"), "--steps", str(steps),
                              "--target", "99"], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    found = dict((name, float(us)) for name, us in LINE.findall(out.stdout))
    if len(found) != 2:
        raise RuntimeError(f"train_torch.py printed no step times:\n{out.stdout}\n{out.stderr}")
    return {"busy_loops": busy, "load_1min_before": load, "torch_us": found["torch.optim.AdamW"],
            "optirs_us": found["optirs.torch.AdamW"],
            "optirs_over_torch": found["optirs.torch.AdamW"] / found["torch.optim.AdamW"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per condition (default 3)")
    ap.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy loops beside a busy run "
                    "(default: one per core)")
    ap.add_argument("--json", metavar="PATH", help="write every run as JSON")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        for busy in (0, args.busy):
            r = one_run(args.steps, busy)
            runs.append(r)
            print(f"{'busy' if busy else 'quiet'}: torch {r['torch_us']:8.1f} us, optirs {r['optirs_us']:8.1f} us, "
                  f"optirs/torch {r['optirs_over_torch']:.2f} (load {r['load_1min_before']:.1f})", flush=True)
    summary = {}
    for label, busy in (("quiet", 0), ("busy", args.busy)):
        rs = [r for r in runs if r["busy_loops"] == busy]
        summary[label] = {key: statistics.median(r[key] for r in rs) for key in ("torch_us", "optirs_us",
                                                                                  "optirs_over_torch")}
        s = summary[label]
        print(f"{label} median: torch {s['torch_us']:.1f} us, optirs {s['optirs_us']:.1f} us, "
              f"optirs/torch {s['optirs_over_torch']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "cores": os.cpu_count(), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
